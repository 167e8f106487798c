"""The ``torch-simple`` backend: no compilation; the cached graph runs as its generated Python code."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.fx import GraphModule

from .backends import register_compile_backend


@register_compile_backend("torch-simple")
def serve_as_is(gm: GraphModule, config: Any) -> nn.Module:
    return gm
