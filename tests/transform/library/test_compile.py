"""compile stage: compile_model's backends (one small torch.compile smoke test)."""

import pytest

from autodeploy import LLM, SamplingParams
from autodeploy.errors import ConfigError
from autodeploy.transform import transform_history
from autodeploy.transform.library.compile import _warmup_shapes

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def test_warmup_shapes_capped_by_max_batch_size():
    assert _warmup_shapes([1, 2, 4, 8], 4, prefill=False) == [(1, 1), (2, 1), (4, 1)]
    assert _warmup_shapes([1, 16], 2, prefill=True) == [(1, 1), (2, 1), (1, 2), (2, 2)]


def test_bad_backend_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="backend"):
        LLM(tiny_checkpoint("llama"), overrides={"transforms.compile_model.backend": "tensorrt"})


def test_torch_compile_same_greedy_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    simple = LLM(path, max_batch_size=2, max_seq_len=64)
    assert transform_history(simple.module)["compile_model"].info.skipped
    expected = [o.outputs[0].token_ids for o in simple.generate(PROMPTS, params)]
    compiled = LLM(path, max_batch_size=2, max_seq_len=64,
                   overrides={"transforms.compile_model.backend": "torch-compile",
                              "transforms.compile_model.capture_batch_sizes": [2],
                              "transforms.compile_model.warmup_prefill": False})
    assert type(compiled.module).__name__ == "OptimizedModule"
    assert [o.outputs[0].token_ids for o in compiled.generate(PROMPTS, params)] == expected
