"""The ``torch-simple`` backend: no compilation; the cached graph runs as its generated Python code, its calls of
autodeploy's Python ops made as plain calls of their implementations (:mod:`.eager`)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.fx import GraphModule

from ..utils.logger import ad_logger
from .backends import register_compile_backend
from .eager import call_implementations_directly


@register_compile_backend("torch-simple")
def serve_as_is(gm: GraphModule, config: Any) -> nn.Module:
    ad_logger.info(f"torch-simple: the graph calls {call_implementations_directly(gm)} op implementation(s) directly")
    return gm
