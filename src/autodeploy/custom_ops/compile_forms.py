"""Compile forms: how an ``auto_deploy`` op reads as plain torch to ``torch.compile``.

A custom op is an opaque call to Dynamo, so Inductor cannot fuse it with its neighbours. An op that is pure
torch underneath declares a compile form beside its definition; the ``torch-compile`` backend points the
graph's nodes at these forms before compiling. A form factory takes ``decode`` (the form is for the
decode-only graph, where one token per sequence is known, or for the general graph) and returns the
callable. Product ops give theirs in their product-registry entry (:mod:`autodeploy.utils.products`).
"""

from __future__ import annotations

from typing import Any, Callable

from ..utils.products import product_ops

FormFactory = Callable[[bool], Callable]

_FORMS: dict[Any, FormFactory] = {}


def register_compile_form(op: Any, factory: FormFactory) -> None:
    """Declare the plain-torch form of ``op`` (an OpOverload) for compiled graphs."""
    _FORMS[op] = factory


def compile_forms(decode: bool) -> dict[Any, Callable]:
    """op -> its plain-torch form, for the decode graph (``decode``) or the general graph."""
    factories = {**_FORMS, **{p.op: p.compile_form for p in product_ops() if p.compile_form is not None}}
    return {op: make(decode) for op, make in factories.items()}
