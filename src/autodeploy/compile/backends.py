"""The registry of compile backends: ``compile_model``'s ``backend`` names one of them.

A backend is a function ``(cached_graph, config) -> nn.Module``: it takes the graph ``cache_init`` produced
(the runtime's calling convention, see :mod:`autodeploy.runtime.sequence_info`) and the ``compile_model``
config, and returns the module the runtime serves, with the same calling convention.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.fx import GraphModule

from ..errors import ConfigError
from ..utils.logger import ad_logger

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


#: ``backend: auto`` (the default) resolves to the backend this names where set, e.g. ``torch-simple`` for
#: quick builds while debugging a model (the test suite sets it too)
AUTO_BACKEND_ENV = "AUTODEPLOY_COMPILE_BACKEND"


#: the CPU capabilities (torch's names) where ``auto`` compiles: Inductor's code for them is checked against
#: the uncompiled graph and timed (docs/performance.md)
VALIDATED_CAPABILITIES = ("AVX2", "AVX512")


def _inductor_compilers() -> tuple:
    """The C++ compiler(s) Inductor is configured to use: its config's where Inductor is loaded already,
    else its default (``$CXX``, else g++), without importing Inductor (70 MiB, which a process that serves a
    package never needs)."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        return config.cpp.cxx if isinstance(config.cpp.cxx, tuple) else (config.cpp.cxx,)
    return (os.environ.get("CXX", "g++"),)


def resolve_compile_backend(name: str) -> str:
    """The backend ``name`` stands for: itself, or for ``auto`` the fastest one validated here:
    ``aoti`` (the decode step compiled by AOTInductor, served by :class:`~autodeploy.LLM` from a process
    without the compiler) where Inductor finds a C++ compiler and generates AVX2 or AVX-512 code, else
    ``torch-simple``;
    ``$AUTODEPLOY_COMPILE_BACKEND`` overrides what ``auto`` picks."""
    if name != "auto":
        return name
    chosen = os.environ.get(AUTO_BACKEND_ENV, "").strip()
    if chosen:
        if chosen not in _BACKENDS:
            raise ConfigError(f"{AUTO_BACKEND_ENV}={chosen!r} names no compile backend; known: {', '.join(_BACKENDS)}")
        return chosen
    if not any(shutil.which(c) for c in (*_inductor_compilers(), "g++", "c++", "clang++") if c):
        ad_logger.warning("compile_model: no C++ compiler for Inductor, so the graph is served uncompiled "
                          "(torch-simple, slower); install g++ for the fast path")
        return "torch-simple"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VALIDATED_CAPABILITIES:
        # Inductor's code for other instruction sets (ARM's NEON/SVE among them) is not yet timed and checked
        # against the uncompiled graph here
        ad_logger.info(f"compile_model: the aoti backend is the default with AVX2 or AVX-512 code (this CPU's torch "
                       f"kernels: {capability}); serving uncompiled (torch-simple)")
        return "torch-simple"
    return "aoti"
