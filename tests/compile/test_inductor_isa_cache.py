"""Inductor's on-disk cache and the instruction set it generates code for.

Inductor's FX-graph cache key leaves out the vector instruction set it picks (``ATEN_CPU_CAPABILITY`` lowers
it), so a graph cached under AVX2 came back under AVX-512 with 8-lane kernel source compiled for 16 lanes:
stores past the buffers' ends, heap corruption at the first decode step. ``inductor_options`` pins
``cpp.simdlen``, which the key includes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.compile.torch_compile import inductor_options

_HAS_AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _simdlen_in_child(env: dict) -> int:
    code = "from autodeploy.compile.torch_compile import inductor_options; print(inductor_options()['cpp.simdlen'])"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


def test_the_compile_options_name_the_vector_width_inductor_picks():
    from torch._inductor import cpu_vec_isa

    options = inductor_options()
    assert options["cpp.simdlen"] == cpu_vec_isa.pick_vec_isa().bit_width()
    assert options["size_asserts"] is False
    if _HAS_AVX512:
        assert options["cpp.simdlen"] == 512
        assert _simdlen_in_child(_AVX2_ENV) == 256


def test_the_probe_runs_in_the_background_when_the_pipeline_will_compile(monkeypatch):
    """compile_model's prepare starts Inductor's ISA probe in a thread (torch-compile only); the options
    then take its answer."""
    import threading

    from torch._inductor import cpu_vec_isa

    from autodeploy.compile import torch_compile
    from autodeploy.transform.library.compile import CompileModel, CompileModelConfig

    monkeypatch.setattr(torch_compile, "_isa_probe", None)
    threads = []
    real_pick = cpu_vec_isa.pick_vec_isa
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: threads.append(threading.current_thread()) or real_pick())
    monkeypatch.setenv("AUTODEPLOY_COMPILE_BACKEND", "torch-simple")
    CompileModel(CompileModelConfig(stage="compile")).prepare(None)
    assert torch_compile._isa_probe is None  # nothing to compile: no probe
    monkeypatch.setenv("AUTODEPLOY_COMPILE_BACKEND", "torch-compile")
    CompileModel(CompileModelConfig(stage="compile")).prepare(None)
    assert torch_compile._isa_probe is not None
    assert inductor_options()["cpp.simdlen"] == real_pick().bit_width()
    assert threads and threads[0] is not threading.main_thread()
    assert len(threads) == 1  # inductor_options took the thread's answer


# runs in a child process: greedy tokens of the compiled model
_WORKER = r"""
import json, sys
from autodeploy import LLM, SamplingParams
path, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(path, max_batch_size=4, max_seq_len=64, kv_cache_config={"max_tokens": 256, "page_size": 16},
          overrides={"transforms.compile_model.backend": "torch-compile",
                     "transforms.compile_model.capture_batch_sizes": [1, 4]})
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print("@@tokens@@", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


@pytest.mark.slow  # compiles the model with Inductor twice
@pytest.mark.skipif(not _HAS_AVX512, reason="needs a CPU with AVX-512 to compile for two instruction sets")
def test_a_graph_compiled_for_avx2_is_not_reused_for_avx512(tiny_checkpoint, tmp_path):
    """One Inductor cache, the same model compiled with AVX2 code and then with AVX-512 code: both give the
    uncompiled model's greedy tokens (before the fix the second build reused the first's kernel source)."""
    path = tiny_checkpoint("llama")
    prompts = [[3, 17, 9, 40, 2], [8, 1], [5, 6, 7, 8, 9, 10, 11], [12]]
    eager = LLM(path, max_batch_size=4, max_seq_len=64, kv_cache_config={"max_tokens": 256, "page_size": 16})
    want = [o.outputs[0].token_ids
            for o in eager.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for env in ({**cache, **_AVX2_ENV}, cache):
        result = subprocess.run([sys.executable, "-c", _WORKER, str(path), json.dumps(prompts)],
                                env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        line = next(x for x in result.stdout.splitlines() if x.startswith("@@tokens@@"))
        assert json.loads(line.split(" ", 1)[1]) == want, env
