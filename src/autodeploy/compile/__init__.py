"""Compile backends behind a registry (``torch-simple``, ``torch-compile``, ``aoti``); ``compile_model`` picks one by
name (``auto``, the default: ``torch-compile`` where Inductor can run). A new backend (e.g.
``torch-cudagraph``) is a module here registering itself with :func:`register_compile_backend`."""

from . import aoti, torch_compile, torch_simple  # noqa: F401  (registers the backends)
from .backends import (
    AUTO_BACKEND_ENV,
    compile_backend_names,
    get_compile_backend,
    register_compile_backend,
    resolve_compile_backend,
)

__all__ = ["AUTO_BACKEND_ENV", "compile_backend_names", "get_compile_backend", "register_compile_backend",
           "resolve_compile_backend"]
