"""The registry of compile backends: ``compile_model``'s ``backend`` names one of them.

A backend is a function ``(cached_graph, config) -> nn.Module``: it takes the graph ``cache_init`` produced
(the runtime's calling convention, see :mod:`autodeploy.runtime.sequence_info`) and the ``compile_model``
config, and returns the module the runtime serves, with the same calling convention.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.fx import GraphModule

from ..errors import ConfigError

CompileBackend = Callable[[GraphModule, Any], nn.Module]

_BACKENDS: dict[str, CompileBackend] = {}


def register_compile_backend(name: str) -> Callable[[CompileBackend], CompileBackend]:
    """``@register_compile_backend("name")`` on a backend function."""

    def decorator(backend: CompileBackend) -> CompileBackend:
        if name in _BACKENDS and _BACKENDS[name] is not backend:
            raise ValueError(f"compile backend {name!r} is already registered")
        _BACKENDS[name] = backend
        return backend

    return decorator


def compile_backend_names() -> list[str]:
    return list(_BACKENDS)


def get_compile_backend(name: str) -> CompileBackend:
    if name not in _BACKENDS:
        raise ConfigError(f"unknown compile backend {name!r}; known: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]
