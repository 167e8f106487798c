"""The cached graph as it is served eagerly: its calls of autodeploy's Python ops made as plain function calls.

Where the cached graph runs as its generated Python code (prefill, chunked and mixed batches of the ``aoti``
backend, whose decode step is compiled), each call of an op defined with ``torch.library.custom_op`` goes
through the dispatcher and that op's autograd and redispatch wrappers before its Python implementation runs.
On the Intel Xeon of docs/performance.md, a 128-token prompt of the 125M Llama took 1.8-2.6 ms less with the
implementations called directly (fp32, int4 and int8 weights; in the int8 model, 73 calls of the products, RoPE
and cached attention). Nothing in a served graph needs the wrappers (no autograd, one device, no tracing), so
its nodes can call the implementations themselves, which compute the same tensors.

An op qualifies when its implementation is the only one (no kernel registered per device) and can be imported
by its own name, so that the package's code (:mod:`autodeploy.runtime.package`) imports it like any global.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch.fx import GraphModule

_NAMESPACE = "auto_deploy"


def _implementation(op: object) -> Callable | None:
    """The Python function behind ``op`` (an OpOverload of a ``torch.library.custom_op`` of autodeploy's), or
    None where the op does not qualify (see the module docstring)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != _NAMESPACE or op._overloadname != "default":
        return None
    from torch._library import custom_ops

    opdef = getattr(custom_ops, "OPDEFS", {}).get(op._schema.name)
    kernels = getattr(opdef, "_backend_fns", None)
    fn = getattr(opdef, "_init_fn", None)
    if fn is None or kernels is None or set(kernels) != {None}:
        return None
    try:
        importable = getattr(importlib.import_module(fn.__module__), fn.__qualname__, None) is fn
    except ImportError:
        return None
    return fn if importable else None


def call_implementations_directly(gm: GraphModule) -> int:
    """Point ``gm``'s calls of qualifying ops at their Python implementations; returns how many nodes changed.
    For a graph that is served as it is: graphs derived from it (a decode graph) must be made before."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and (fn := _implementation(node.target)) is not None:
            node.target = fn
            changed += 1
    if changed:
        gm.recompile()
    return changed
