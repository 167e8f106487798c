"""With ``AUTODEPLOY_NATIVE_KERNELS=0`` every configuration builds and runs on the ops' plain-torch
implementations, and gives what the native kernels give: the same greedy tokens in float32 (the kernels
change only float32 rounding), and for int8 weights logits within the stated bound of the path the kernel
replaces (without it, decode products take torch's int8 kernel with bfloat16 activations).

Each side runs in its own process: the kernels register as the ops' CPU implementations once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from autodeploy.custom_ops import native
from autodeploy.custom_ops.quant_linear import INT8_GEMV_VS_TORCH_RTOL

pytestmark = pytest.mark.slow  # whole pipelines in child processes, twice each

PROMPTS = [[3, 17, 9, 40, 2], [8, 1], [5, 6, 7, 8, 9, 10, 11]]
FP32 = {}
INT8 = {"transforms.quantize_weights.enabled": True, "transforms.fuse_gemms.enabled": True}
COMPILE = {"transforms.compile_model.backend": "torch-compile", "transforms.compile_model.capture_batch_sizes": [1, 2]}
AOTI = {"transforms.compile_model.backend": "aoti"}  # the default where it is validated: a served package

# runs in a child process: greedy tokens through LLM.generate and the prompt logits after post_load_fusion
_WORKER = r"""
import json, sys, torch
from autodeploy import LLM, SamplingParams, optimize
path, overrides, prompts, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
llm = LLM(path, max_batch_size=2, max_seq_len=64, kv_cache_config={"max_tokens": 64, "page_size": 16},
          overrides=overrides)
tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
module = optimize(path, until="post_load_fusion", overrides=overrides)
with torch.no_grad():
    logits = [module(torch.tensor([p]), torch.arange(len(p))[None])[0][0] for p in prompts]
torch.save({"tokens": tokens, "logits": logits, "served": type(llm.module).__name__}, out)
"""


def _run(path, overrides: dict, kernels: bool, tmp_path) -> dict:
    out = tmp_path / f"{'on' if kernels else 'off'}.pt"
    env = {**os.environ, native.DISABLE_ENV: "1" if kernels else "0"}
    result = subprocess.run([sys.executable, "-c", _WORKER, str(path), json.dumps(overrides), json.dumps(PROMPTS),
                             str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


def _compare(path, overrides, tmp_path, int8: bool, reference: dict | None = None):
    """The kernels-off run of ``overrides`` against the kernels-on run of ``reference`` (by default the same)."""
    on = _run(path, overrides if reference is None else reference, True, tmp_path)
    off = _run(path, overrides, False, tmp_path)
    for got, want in zip(off["logits"], on["logits"]):
        if int8:  # torch's int8 kernel instead of int8_gemv: per-product bound, through two layers
            scale = float(want.abs().max())
            assert float((got - want).abs().max()) <= 2 * INT8_GEMV_VS_TORCH_RTOL * scale
        else:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    if overrides.get("transforms.compile_model.backend") == "aoti":  # served from a package, not a fallback
        assert off["served"] == "PackagedModel"
    if not int8:
        assert off["tokens"] == on["tokens"]
    assert all(len(t) == 8 for t in off["tokens"])


@pytest.mark.parametrize("overrides, int8", [(FP32, False), (INT8, True)], ids=["fp32", "int8+fuse_gemms"])
def test_kernels_off_eager(overrides, int8, tiny_checkpoint, tmp_path):
    _compare(tiny_checkpoint("llama"), overrides, tmp_path, int8)


@pytest.mark.slow  # compiles with Inductor
@pytest.mark.parametrize("overrides, int8", [({**FP32, **AOTI}, False), ({**INT8, **COMPILE}, True)],
                         ids=["fp32-aoti", "int8+fuse_gemms-torch-compile"])
def test_kernels_off_compiled(overrides, int8, tiny_checkpoint, tmp_path):
    """Compiled both ways: the default (aoti: the decode step packaged by AOTInductor, served from a
    package) in float32, against the uncompiled graph with the kernels (one AOTInductor compile, not two:
    aoti with the kernels is tests/runtime/test_package.py's); torch-compile with int8 weights, both sides."""
    _compare(tiny_checkpoint("llama"), overrides, tmp_path, int8, reference=FP32 if not int8 else None)
