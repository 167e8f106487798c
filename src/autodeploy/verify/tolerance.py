"""The tolerances ``--verify`` checks each transform's logits against.

A transform passes when every logit ``a`` of its graph and ``b`` of the reference satisfy
``|a - b| <= atol + rtol * |b| + std_fraction * std(reference logits)``. The defaults depend on the model's
dtype; a transform whose error is expected (quantized weights) has its own, looser tolerance and is checked
against the graph before it, whose logits then become the reference of the later transforms
(:func:`after_expected_error`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float = 0.0
    std_fraction: float = 0.0  # a share of the reference logits' standard deviation (lossy transforms)

    def describe(self) -> str:
        parts = [f"atol {self.atol:g}", f"rtol {self.rtol:g}"]
        if self.std_fraction:
            parts.append(f"{self.std_fraction:g} x std of the reference logits")
        return ", ".join(parts)


#: defaults by model dtype: fp32 is the oracle standard; half precisions round every op's output to a few
#: significant digits (bf16: 8 bits of mantissa), so reordered arithmetic moves logits by several ulps
DTYPE_TOLERANCES = {
    torch.float32: Tolerance(atol=1e-4),
    torch.bfloat16: Tolerance(atol=5e-2, rtol=2e-2),
    torch.float16: Tolerance(atol=1e-2, rtol=2e-3),
}

#: transforms whose numerical error is expected, by key: int8 weight-only products keep ~2-3 significant
#: digits of each weight (docs/performance.md: 125M Llama, max abs logit error 0.11 at a std of ~0.55)
EXPECTED_ERROR = {
    "quantize_weights": Tolerance(atol=0.0, std_fraction=0.5),
}


def default_tolerance(dtype: torch.dtype, atol: float | None = None, rtol: float | None = None) -> Tolerance:
    """The dtype's tolerance with ``atol`` / ``rtol`` replacing its fields where given."""
    base = DTYPE_TOLERANCES.get(dtype, DTYPE_TOLERANCES[torch.float32])
    return Tolerance(atol=base.atol if atol is None else atol, rtol=base.rtol if rtol is None else rtol)


def expected_error(transform) -> Tolerance | None:
    """The tolerance of a transform whose error is expected: a ``verify_tolerance`` attribute of its class
    (user transforms may declare one), else :data:`EXPECTED_ERROR`; None for transforms that must be exact."""
    declared = getattr(transform, "verify_tolerance", None)
    if isinstance(declared, Tolerance):
        return declared
    return EXPECTED_ERROR.get(transform.get_transform_key())


def after_expected_error(tol: Tolerance, error: float) -> Tolerance:
    """The tolerance of the transforms after one whose error ``error`` was expected: its logits are their
    reference, within ``tol`` plus a tenth of that error (int8 products round activations differently at
    different row counts, so the same graph run as prefill or decode steps moves by a fraction of it)."""
    return Tolerance(atol=tol.atol + 0.1 * error, rtol=tol.rtol, std_fraction=tol.std_fraction)


@dataclass(frozen=True)
class Comparison:
    max_abs_error: float
    max_rel_error: float  # max abs error / the largest reference logit's magnitude
    passed: bool


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    out, ref = out.detach().double(), ref.detach().double()
    if out.shape != ref.shape:
        raise ValueError(f"logits of shape {tuple(out.shape)}, the reference has {tuple(ref.shape)}")
    diff = (out - ref).abs()
    if not torch.isfinite(out).all():
        return Comparison(float("inf"), float("inf"), False)
    bound = tol.atol + tol.rtol * ref.abs() + tol.std_fraction * float(ref.std())
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return Comparison(max_abs, max_abs / scale if scale else max_abs, bool((diff <= bound).all()))
