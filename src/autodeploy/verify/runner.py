"""Run the pipeline's current graph on the verification samples, without changing it.

The graph runs as a *view*: a new GraphModule over a copy of its graph that shares its tensors. Before
``weight_load`` the view's meta tensors are the oracle's by name and its ``device=meta`` arguments point at
the device; a cached graph gets small zero-filled KV caches of its own, so the pipeline's caches (meta
before ``initialize_cache``, sized for serving after it) are neither needed nor touched.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.fx import Graph, GraphModule

from ..export.export import assign_tensor
from ..runtime.kv_cache import KV_CACHE_META_KEY, allocate_kv_caches
from ..runtime.sequence_info import LOGITS_IDX, SequenceInfo
from ..utils.fx import named_graphmodules, replace_device_args
from .reference import Outputs, Samples


class NotRunnable(Exception):
    """The graph cannot be run on the samples (the message says why)."""


def pipeline_graph(mod: nn.Module) -> GraphModule | None:
    """The graph the pipeline is building: the cached one once there is one, else the root/first graph."""
    gms = [gm for _, gm in named_graphmodules(mod)]
    cached = [gm for gm in gms if KV_CACHE_META_KEY in gm.meta]
    return (cached or gms or [None])[0]


def _view(gm: GraphModule, weights: dict[str, torch.Tensor], device: torch.device) -> GraphModule:
    spec = gm.meta.get(KV_CACHE_META_KEY)
    caches = {name for layer in spec.layers for name in (layer.k_name, layer.v_name)} if spec else set()
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    view = GraphModule(gm, graph)  # copies references to gm's tensors, not the tensors
    replace_device_args(view, torch.device("meta"), device)
    missing = []
    for name, tensor in list(view.named_parameters(remove_duplicate=False)) + list(
            view.named_buffers(remove_duplicate=False)):
        if not tensor.is_meta or name in caches:
            continue
        real = weights.get(name)
        if real is None or tuple(real.shape) != tuple(tensor.shape):
            missing.append(name)
            continue
        assign_tensor(view, name, real.to(device))
    if missing:
        raise NotRunnable(f"graph tensor(s) on the meta device with no checkpoint weight of that name and "
                          f"shape: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return view


def _placeholders(gm: GraphModule) -> list[str]:
    return [n.name for n in gm.graph.find_nodes(op="placeholder")]


@torch.no_grad()
def run_samples(mod: nn.Module, samples: Samples, weights: dict[str, torch.Tensor], device: str) -> Outputs:
    """The graph's logits on ``samples`` (batches for the uncached contract; the sequences in both: as
    whole sequences before ``cache_init``, prefilled and decoded after it). Raises :class:`NotRunnable`."""
    gm = pipeline_graph(mod)
    if gm is None:
        raise NotRunnable("no graph yet")
    device = torch.device(device)
    view = _view(gm, weights, device)
    try:
        if KV_CACHE_META_KEY in gm.meta:
            return Outputs(sequences=_run_cached(view, gm.meta[KV_CACHE_META_KEY], samples, device))
        out = Outputs()
        for ids, pos in samples.batches:
            out.batches.append(_logits(view(ids.to(device), pos.to(device))))
        for seq in samples.sequences:
            out.sequences.append(_logits(view(torch.tensor([seq], device=device),
                                              torch.arange(len(seq), device=device)[None]))[0])
        return out
    except NotRunnable:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the graph is the finding to report
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise NotRunnable(f"the graph failed on the samples: {type(exc).__name__}: {first_line}") from exc


def _logits(outputs) -> torch.Tensor:
    return (outputs[0] if isinstance(outputs, (tuple, list)) else outputs).float().cpu()


def _run_cached(view: GraphModule, spec, samples: Samples, device: torch.device) -> list[torch.Tensor]:
    """Prefill every sequence's prompt in one forward, then decode its next tokens one step at a time; the
    logits of every token, per sequence, in sequence order."""
    spec = copy.copy(spec)  # allocate_kv_caches records the allocation on the spec
    info = SequenceInfo(spec.max_batch_size, spec.max_seq_len, spec.page_size, num_pages=0)
    pages, first = [], 0
    for seq in samples.sequences:
        n = info.pages_needed(len(seq))
        pages.append(list(range(first, first + n)))
        first += n
    info.num_pages = first
    allocate_kv_caches(view, spec, first, device)
    gather = "all" if LOGITS_IDX in _placeholders(view) else None
    per_seq: list[list[torch.Tensor]] = [[] for _ in samples.sequences]

    def forward(requests, lens):
        batch = info.build(requests, gather=gather, device=device)
        logits = _logits(view(**batch.as_kwargs()))[0]
        for i, chunk in enumerate(torch.split(logits, lens)):
            per_seq[i].append(chunk)

    seqs = list(zip(samples.sequences, samples.prompt_lens, pages))
    forward([(seq[:p], 0, pg) for seq, p, pg in seqs], list(samples.prompt_lens))
    for step in range(samples.decode_steps):
        forward([([seq[p + step]], p + step, pg) for seq, p, pg in seqs], [1] * len(seqs))
    return [torch.cat(chunks) for chunks in per_seq]
