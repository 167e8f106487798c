"""Subgraph pattern matching on exported aten graphs.

A pattern is a plain Python function traced with ``torch.export`` exactly like models are, so its
aten ops are the ones a model's graph holds (``aten.linear``, ``aten.view``, ...). Matching uses
``torch.fx``'s :class:`SubgraphMatcher`: the pattern's placeholders bind to any node of the model
graph, and the match gives, per pattern placeholder and output, the model node it stands for.

For patterns whose literals vary from model to model (sizes given as SymInt nodes, scales, head
counts), :func:`match_expr` matches declarative expression trees written with Inductor's pattern
language (``CallFunction``, ``KeywordArg``, ``Ignored``) at one anchor node; see
``autodeploy.transform.library.attention`` for examples.
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


def trace_pattern(
    fn: Callable, example_args: Sequence[torch.Tensor], dynamic_dims: dict[int, Sequence[int]] | None = None
) -> GraphModule:
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


class _LiteralTolerantMatcher(SubgraphMatcher):
    """``SubgraphMatcher`` whose ``ignore_literals`` only ignores literal-vs-literal differences.

    torch's own ``ignore_literals=True`` also accepts a pattern *node* standing where the graph has a
    literal (e.g. a pattern ``sym_size`` vs a graph int); the pattern node's inputs then never get bound
    and ``match()`` fails with a ``KeyError`` on the unbound placeholders. Here such a pair is simply
    not a match, and two differing plain literals (scales, sizes, dims) are accepted.
    """

    def __init__(self, *args, ignore_plain_literals: bool = False, **kwargs):
        super().__init__(*args, ignore_literals=False, **kwargs)
        self._ignore_plain_literals = ignore_plain_literals

    def _match_literals(self, pn, gn, match: InternalMatch) -> bool:
        if self._ignore_plain_literals and not isinstance(pn, Node) and not isinstance(gn, Node):
            return True
        return super()._match_literals(pn, gn, match)


def find_matches(gm: GraphModule, pattern: GraphModule, ignore_literals: bool = False) -> list[PatternMatch]:
    """Non-overlapping occurrences of ``pattern`` in ``gm``.

    ``ignore_literals``: plain literal arguments (numbers, dims, dtypes) need not be equal; a literal
    never matches a node, though.
    """
    matcher = _LiteralTolerantMatcher(
        pattern.graph, match_output=False, match_placeholder=False,
        remove_overlapping_matches=True, ignore_plain_literals=ignore_literals,
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


def match_expr(pattern, node: Node):
    """Match an Inductor pattern expression (``torch._inductor.pattern_matcher.PatternExpr``) rooted
    at ``node``: the :class:`~torch._inductor.pattern_matcher.Match` (``.kwargs``: the bound
    ``KeywordArg`` values, ``.nodes``: the covered nodes) or None.

    Intermediate nodes must have exactly the users the pattern gives them (one by default, ``_users=n``
    otherwise), so a match never covers a value that is also used outside it.
    """
    from torch._inductor.pattern_matcher import is_match

    result = pattern.match(node)
    return result if is_match(result) else None
