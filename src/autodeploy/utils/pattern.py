"""Subgraph pattern matching on exported aten graphs.

A pattern is a plain Python function traced with ``torch.export`` exactly like models are, so its
aten ops are the ones a model's graph holds (``aten.linear``, ``aten.view``, ...). Matching uses
``torch.fx``'s :class:`SubgraphMatcher`: the pattern's placeholders bind to any node of the model
graph, and the match gives, per pattern placeholder and output, the model node it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher


@dataclass
class PatternMatch:
    """One occurrence of a pattern: the model nodes for the pattern's inputs and outputs."""

    inputs: dict[str, Node | object]  # pattern placeholder name -> bound model node (or literal)
    outputs: list[Node]  # model nodes producing the pattern's outputs, in order
    nodes: list[Node]  # every model node the pattern covers (outputs included)


def trace_pattern(fn: Callable, example_args: Sequence[torch.Tensor], dynamic_dims: dict[int, Sequence[int]] | None = None) -> GraphModule:
    """Trace ``fn`` to an aten graph with ``torch.export`` (non-strict), without export's guards.

    ``dynamic_dims`` maps argument index -> dims to mark dynamic, so that the pattern holds
    ``aten.sym_size``/``view`` nodes the way a dynamically exported model does.
    """

    class _Pattern(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    dynamic_shapes = None
    if dynamic_dims:
        dims: dict[int, torch.export.Dim] = {}
        per_arg = tuple(
            {d: dims.setdefault(d, torch.export.Dim.AUTO) for d in dynamic_dims.get(i, ())} or None
            for i in range(len(example_args))
        )
        dynamic_shapes = (per_arg,)  # forward(*args): one entry, the args tuple
    program = torch.export.export(_Pattern(), tuple(example_args), dynamic_shapes=dynamic_shapes, strict=False)
    gm = program.module()
    gm.graph._codegen = torch.fx.graph.CodeGen()
    for node in list(gm.graph.nodes):
        if (node.op == "call_module" or "assert" in str(node.target)) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def find_matches(gm: GraphModule, pattern: GraphModule, ignore_literals: bool = False) -> list[PatternMatch]:
    """Non-overlapping occurrences of ``pattern`` in ``gm``."""
    matcher = SubgraphMatcher(
        pattern.graph, match_output=False, match_placeholder=False,
        remove_overlapping_matches=True, ignore_literals=ignore_literals,
    )
    placeholders = [n for n in pattern.graph.nodes if n.op == "placeholder"]
    results = []
    for match in matcher.match(gm.graph):
        results.append(_to_pattern_match(match, placeholders))
    return results


def _to_pattern_match(match: InternalMatch, placeholders: list[Node]) -> PatternMatch:
    inputs = {p.name: match.nodes_map[p] for p in placeholders if p in match.nodes_map}
    nodes = [n for p, n in match.nodes_map.items() if p.op not in ("placeholder", "output") and isinstance(n, Node)]
    return PatternMatch(inputs=inputs, outputs=list(match.returning_nodes), nodes=nodes)
