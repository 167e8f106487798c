"""End to end: autodeploy.LLM over the whole pipeline (cache_init included) generates greedy tokens
identical to HF ``generate(do_sample=False)``, for a batch of prompts of different lengths served by
continuous batching with a KV cache that holds only two sequences at once."""

import pytest
import torch

from autodeploy import LLM, SamplingParams
from tiny_models import ARCHS, VOCAB, hf_reference

pytestmark = pytest.mark.slow  # whole architectures end to end, generation against HF generate

MAX_TOKENS = 10
PROMPT_LENS = [1, 5, 9, 17, 3]
PAGE = 16
KV_MAX_TOKENS = 4 * PAGE  # every request needs <= 2 pages of 16 tokens: two sequences at once


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _hf_greedy(reference, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    llm = LLM(path, max_batch_size=4, max_seq_len=64,
              kv_cache_config={"max_tokens": KV_MAX_TOKENS, "page_size": PAGE})
    spec = llm.engine.spec
    assert (spec.page_size, spec.num_pages) == (PAGE, KV_MAX_TOKENS // PAGE)
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    reference = hf_reference(path)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == _hf_greedy(reference, prompt)
    sched = llm.engine.scheduler
    assert sched.max_pages_in_use <= spec.num_pages and sched.pool.num_free == spec.num_pages
    # streaming produces the same tokens
    streamed = {i: [] for i in range(len(prompts))}
    for i, token, _ in llm.generate_stream(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)):
        streamed[i].append(token)
    assert [streamed[i] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in outs]
    # a prompt over the limits is a ValueError naming it
    with pytest.raises(ValueError, match="max_seq_len=64"):
        llm.generate([list(range(60))], SamplingParams(max_tokens=10))


def test_demo_model_text_matches_hf(tmp_path, monkeypatch):
    """The embedded demo model (char tokenizer): text prompts in, text out, greedy = HF generate."""
    from autodeploy.models.demo import demo_model_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = demo_model_path()
    llm = LLM(path, max_batch_size=2, max_seq_len=64, kv_cache_config={"max_tokens": 64, "page_size": 16})
    prompts = ["hello world", "ab"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    reference = hf_reference(path)
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer(prompt)["input_ids"]
        assert out.prompt == prompt and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == _hf_greedy(reference, ids)
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
