"""``auto_deploy::materialize(x) -> x.clone()``: a barrier for the compiler.

Opaque to Inductor, so the chain that computes ``x`` is evaluated once into a buffer instead of inside
each consumer's kernel (the ``torch-compile`` backend routes shared RoPE cos/sin tables through it).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("auto_deploy::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@materialize.register_fake
def _materialize_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
