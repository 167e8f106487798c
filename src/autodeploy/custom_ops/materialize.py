"""``auto_deploy::materialize(x) -> x.clone()``: a barrier for the compiler.

Opaque to Inductor, so the chain that computes ``x`` is evaluated once into a buffer instead of inside
each consumer's kernel (the ``torch-compile`` backend routes shared RoPE cos/sin tables through it).
Defined through the low-level library API, not ``torch.library.custom_op``, and given a C++ CPU
implementation where the native kernels load (``native/ops.cpp``): compiled decode graphs call it every step,
and a Python custom op cost 30-45 us per call there (two calls per step, about 2 % of a batch-1 int8 step).
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_LIB.define("materialize(Tensor x) -> Tensor")


def materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_LIB.impl("materialize", materialize, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::materialize", lib=_LIB)
def _materialize_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
