"""Helpers shared by the tests: export a module (or a tiny HF model) to a GraphModule the way the pipeline
does, run one transform on a graph, count ops, and a toy LM whose exported graph already holds
``auto_deploy::torch_attention``. Importable by name (pytest's ``pythonpath = ["tests"]``)."""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
from torch import nn
from torch.fx import GraphModule

import autodeploy.custom_ops.attention  # noqa: F401  (registers torch_attention, which ToyLM calls)
from autodeploy.export import torch_export_to_gm
from autodeploy.export.export import flatten_io
from autodeploy.transform import PipelineContext, TransformRegistry, transform_history
from tiny_models import make_config

Dims = dict[int, torch.export.Dim] | None


# -- export ---------------------------------------------------------------------------------------
def export_gm(
    module: nn.Module,
    *args,
    dims: Dims | tuple[Dims, ...] = None,
    strict: bool = True,
    cleanup: Iterable[str] = (),
) -> GraphModule:
    """``torch.export`` ``module`` on ``args`` and flatten its calling convention as the pipeline's export
    does (``forward(*inputs)`` returns a flat tuple), then run the ``post_export`` clean-ups named in
    ``cleanup`` in that order (e.g. ``cleanup_input_constraints``: export's assertion and guard nodes).

    ``dims``: the dynamic dims, one ``{dim: torch.export.Dim}`` used for every argument, or a tuple with
    one entry (a mapping or None) per argument; None exports static shapes."""
    dynamic = tuple(dims for _ in args) if isinstance(dims, dict) else dims
    gm = flatten_io(torch.export.export(module, args, dynamic_shapes=dynamic, strict=strict).module())
    for key in cleanup:
        gm = run_transform(key, gm, "post_export")
    return gm


def export_hf(model: nn.Module, num_moe_experts_for_export: int | None = None) -> GraphModule:
    """An HF causal LM's graph from the project's export driver directly (no pipeline): batch up to 4,
    sequence up to 64; ``num_moe_experts_for_export`` traces only that many experts per MoE block."""
    config = types.SimpleNamespace(num_moe_experts_for_export=num_moe_experts_for_export)
    return torch_export_to_gm(model, max_batch_size=4, max_seq_len=64, export_config=config)


def export_tiny_hf(arch: str, num_moe_experts_for_export: int | None = None, seed: int = 0, **overrides):
    """``(model, gm)``: a tiny random-weight HF model of ``arch`` (``tiny_models.make_config`` with
    ``overrides``, weights from ``seed``, eval mode) and its ``export_hf`` graph."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, **overrides), dtype=torch.float32).eval()
    return model, export_hf(model, num_moe_experts_for_export)


# -- transforms -----------------------------------------------------------------------------------
def run_transform(transform, gm: nn.Module, stage: str, ctx: PipelineContext | None = None, **fields) -> nn.Module:
    """Run one transform (a registry key or a transform class) on ``gm`` as the pipeline would at
    ``stage``: its own config class with ``fields``; ``ctx`` defaults to a fresh PipelineContext."""
    cls = TransformRegistry.get(transform) if isinstance(transform, str) else transform
    config = cls.get_config_class()(stage=stage, **fields)
    return cls(config)(gm, PipelineContext() if ctx is None else ctx)


def run_transforms(gm: nn.Module, keys: Iterable[str], stage: str, ctx: PipelineContext | None = None) -> nn.Module:
    """``run_transform`` for each of ``keys`` in order (each with a fresh context when ``ctx`` is None)."""
    for key in keys:
        gm = run_transform(key, gm, stage, ctx)
    return gm


def count(gm: GraphModule, target) -> int:
    """The number of ``call_function`` nodes of ``gm`` calling ``target``."""
    return len(gm.graph.find_nodes(op="call_function", target=target))


def num_matches(gm: nn.Module, key: str) -> int:
    """How many matches transform ``key`` reported on ``gm`` (its transform history)."""
    return transform_history(gm)[key].info.num_matches


# -- a toy LM -------------------------------------------------------------------------------------
def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class _ToyLayer(nn.Module):
    def __init__(self, hidden, n_heads, n_kv, head_dim):
        super().__init__()
        self.q = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.k = nn.Linear(hidden, n_kv * head_dim, bias=False)
        self.v = nn.Linear(hidden, n_kv * head_dim, bias=False)
        self.o = nn.Linear(n_heads * head_dim, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        self.n1 = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.n2 = nn.Parameter(1 + 0.1 * torch.randn(hidden))


class ToyLM(nn.Module):
    """A hand-written decoder-only LM: embedding, LAYERS x (RMSNorm, GQA attention with RoPE through
    ``auto_deploy::torch_attention``, RMSNorm, ReLU MLP), final norm, LM head, then optionally a logit
    soft-cap (``softcap``) or a scale (``logit_scale``: sharper logits, fewer near-ties in greedy).
    ``forward(input_ids, position_ids) -> (logits,)`` like an exported HF model; weights from torch's
    global RNG (seed it first)."""

    VOCAB, HIDDEN, N_HEADS, N_KV, LAYERS = 64, 32, 4, 2, 2

    def __init__(self, vocab: int = VOCAB, layout: str = "bsnd", softcap: float | None = None,
                 logit_scale: float | None = None):
        super().__init__()
        self.layout, self.softcap, self.logit_scale = layout, softcap, logit_scale
        self.head_dim = self.HIDDEN // self.N_HEADS
        self.embed = nn.Embedding(vocab, self.HIDDEN)
        self.layers = nn.ModuleList(
            _ToyLayer(self.HIDDEN, self.N_HEADS, self.N_KV, self.head_dim) for _ in range(self.LAYERS))
        self.norm = nn.Parameter(torch.ones(self.HIDDEN))
        self.lm_head = nn.Linear(self.HIDDEN, vocab, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def _rope(self, x, cos, sin):  # x [b, s, n, d]
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        h = self.embed(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)[:, :, None, :]
        cos, sin = emb.cos(), emb.sin()
        n_heads, n_kv, head_dim = self.N_HEADS, self.N_KV, self.head_dim
        for layer in self.layers:
            x = _rms(h, layer.n1)
            q = self._rope(layer.q(x).view(b, s, n_heads, head_dim), cos, sin)
            k = self._rope(layer.k(x).view(b, s, n_kv, head_dim), cos, sin)
            v = layer.v(x).view(b, s, n_kv, head_dim)
            if self.layout == "bnsd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                a = torch.ops.auto_deploy.torch_attention(q, k, v, is_causal=True, layout="bnsd").transpose(1, 2)
            else:
                a = torch.ops.auto_deploy.torch_attention(q, k, v, is_causal=True, layout="bsnd")
            h = h + layer.o(a.reshape(b, s, -1))
            h = h + layer.down(torch.relu(layer.up(_rms(h, layer.n2))))
        logits = self.lm_head(_rms(h, self.norm))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        return (logits,)


def export_toy_lm(model: nn.Module) -> GraphModule:
    """``model(input_ids, position_ids)`` exported with dynamic batch (up to 8) and sequence (up to 64)
    dims, export's assertion nodes removed: the graph the cache_init transforms expect."""
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=1, max=64)
    args = (torch.zeros(2, 4, dtype=torch.long), torch.arange(4).expand(2, 4))
    return export_gm(model, *args, dims={0: batch, 1: seq}, cleanup=["cleanup_input_constraints"])
