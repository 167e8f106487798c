"""autodeploy: deploy Hugging Face causal LMs through an observable pipeline of graph transforms.

The public names load on first use (PEP 562), so that importing a submodule, e.g. the canonical ops in
:mod:`autodeploy.custom_ops` for a process that only serves a built model, does not import the export and
compile stacks (torch.export, Dynamo, Inductor, sympy) that building needs."""

from importlib import import_module
from typing import Any

from .errors import AutoDeployError, VerificationError

__version__ = "0.1.0"
__all__ = ["optimize", "LLM", "SamplingParams", "AutoDeployError", "VerificationError", "__version__"]

_LAZY = {"optimize": ".api", "LLM": ".llm", "SamplingParams": ".llm"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
