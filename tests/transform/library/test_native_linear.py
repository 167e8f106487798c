"""post_load_fusion: native_linear moves float32 linears onto auto_deploy::f32_linear (the native kernel up
to 16 rows, torch's linear beyond): counts, what it leaves alone, logits against HF, and the skip without
the native kernels."""

import pytest
import torch

import autodeploy
from autodeploy.custom_ops import native
from autodeploy.transform import transform_history
from helpers import count, export_gm, run_transform
from tiny_models import hf_reference, random_batch

aten = torch.ops.aten
needs_native = pytest.mark.skipif(not native.f32_linear_available(),
                                  reason="needs an x86 CPU with AVX-512 and C/C++ compilers")


def _native_linear(gm):
    return run_transform("native_linear", gm, "post_load_fusion")


@needs_native
def test_llama_linears_use_the_native_operator_and_match_hf(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    gm = _native_linear(autodeploy.optimize(path, until="weight_load"))
    linears = 7 * 2 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert transform_history(gm)["native_linear"].info.num_matches == linears
    assert count(gm, torch.ops.auto_deploy.f32_linear.default) == linears and count(gm, aten.linear.default) == 0
    hf = hf_reference(path)
    # 1 and 5 rows: the native kernel; 27 rows: torch's linear
    for batch, seq in ((1, 1), (1, 5), (3, 9)):
        ids, pos = random_batch(batch, seq)
        with torch.no_grad():
            torch.testing.assert_close(gm(ids, pos)[0], hf(ids, position_ids=pos).logits, atol=1e-4, rtol=0)


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.native = torch.nn.Linear(32, 8)  # with a bias: the operator adds it
        self.odd = torch.nn.Linear(22, 8)  # K a multiple of no vector width (4, 8, 16 floats): stays
        self.bf16 = torch.nn.Linear(32, 8, bias=False).to(torch.bfloat16)  # not float32: stays

    def forward(self, x, y):
        return self.native(x), self.odd(y), self.bf16(x.to(torch.bfloat16))


@needs_native
def test_only_float32_linears_with_k_a_multiple_of_the_vector_width():
    torch.manual_seed(0)
    x, y = torch.randn(3, 32), torch.randn(3, 22)
    batch = torch.export.Dim("batch", min=1, max=32)
    gm = export_gm(Mixed(), x, y, dims={0: batch})
    expected = gm(x, y)
    gm = _native_linear(gm)
    assert transform_history(gm)["native_linear"].info.num_matches == 1
    assert count(gm, torch.ops.auto_deploy.f32_linear.default) == 1 and count(gm, aten.linear.default) == 2
    for out, ref in zip(gm(x, y), expected):
        torch.testing.assert_close(out, ref)
    # more rows than a decode batch (a prompt): the kernel up to the build's gemm_max_rows, torch's linear past
    # it (bit for bit there: tests/custom_ops/test_native.py); float32 rounding apart, the same product
    big_x, big_y = torch.randn(20, 32), torch.randn(20, 22)
    torch.testing.assert_close(gm(big_x, big_y)[0], torch.nn.functional.linear(big_x, gm.native.weight, gm.native.bias))


class Chained(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.second(self.first(x))  # a linear's input is a linear (gemma3n's laurel blocks)


@needs_native
def test_a_linear_of_a_linear_stays_in_order():
    torch.manual_seed(0)
    x = torch.randn(3, 32)
    gm = export_gm(Chained(), x, dims={0: torch.export.Dim("batch", min=1, max=32)})
    expected = gm(x)[0]
    gm = _native_linear(gm)
    gm.graph.lint()  # topologically ordered: the second reads the first's replacement
    assert count(gm, torch.ops.auto_deploy.f32_linear.default) == 2 and count(gm, aten.linear.default) == 0
    torch.testing.assert_close(gm(x)[0], expected)


def test_skipped_where_the_native_kernel_does_not_run(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(native, "f32_linear_available", lambda: False)
    gm = _native_linear(autodeploy.optimize(tiny_checkpoint("llama"), until="weight_load"))
    assert transform_history(gm)["native_linear"].info.skipped
    assert count(gm, aten.linear.default) == 7 * 2 + 1


def test_no_float32_linears_skips_without_building_the_library(monkeypatch):
    """bf16 (or GPU) models have nothing for the kernel: the transform skips before asking for the library."""
    def must_not_build():
        raise AssertionError("the native library was asked for")

    monkeypatch.setattr(native, "f32_linear_available", must_not_build)
    module = torch.nn.Linear(32, 8).to(torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    batch = torch.export.Dim("batch", min=1, max=32)
    gm = export_gm(module, x, dims={0: batch})
    gm = _native_linear(gm)
    assert transform_history(gm)["native_linear"].info.skipped
    assert count(gm, aten.linear.default) == 1


@needs_native
def test_chained_linears_each_read_the_replaced_input():
    """A linear whose input is another linear (Zamba2's adapters): both move, the second onto the first's new node."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 32))
    x = torch.randn(3, 32)
    gm = export_gm(module, x, dims={0: torch.export.Dim("batch", min=1, max=32)})
    gm = _native_linear(gm)
    gm.graph.lint()  # every node defined before it is used
    assert count(gm, torch.ops.auto_deploy.f32_linear.default) == 2 and count(gm, aten.linear.default) == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(x)[0], module(x))
