"""How much of a model the pattern matcher canonicalized: one line a user can read at a glance.

Counts the canonical ``auto_deploy`` ops in the graph against what the model holds: its number of
layers (a sequence mixer per layer: attention or a state-space scan; RoPE when the graph computes sin/cos,
or complex frequencies with polar, at all), its MoE blocks (3D expert weights) and what is left unmatched
(SDPA or softmax nodes for attention, ``rsqrt`` for norms, ``aten.layer_norm`` for LayerNorms).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .fx import named_graphmodules, node_val

aten = torch.ops.aten
#: the canonical state-space scans, one per state-space layer
SSM_OPS = frozenset({"torch_selective_scan", "torch_ssd_scan", "torch_gated_delta_rule"})


@dataclass
class Coverage:
    layers: int | None
    attention: int
    attention_unmatched: int
    rope: int
    uses_rope: bool  # the graph computes sin/cos (otherwise the model has no rotary embedding)
    rmsnorm: int
    norm_unmatched: int
    moe: int
    moe_blocks: int
    layernorm: int = 0
    layernorm_unmatched: int = 0  # aten.layer_norm / native_layer_norm left in the graph
    ssm: int = 0  # state-space scans (torch_selective_scan, ...): the sequence mixer of non-attention layers
    conv: int = 0  # causal convolutions (torch_causal_conv1d): a short-convolution layer's mixer, or a scan's input
    rope_layers: int | None = None  # layers with RoPE when the config declares NoPE layers (else the attention ones)

    @property
    def complete(self) -> bool:
        mixers = self.attention + self.recurrent  # hybrids mix attention and state-space layers
        attention_ok = self.attention_unmatched == 0 and (self.layers is None or mixers >= self.layers)
        # RoPE belongs to the attention layers with RoPE: a hybrid's state-space layers and NoPE layers have none
        expected = self._rope_expected
        rope_ok = not self.uses_rope or expected is None or self.rope >= expected
        norms_ok = self.norm_unmatched == 0 and self.layernorm_unmatched == 0
        return attention_ok and rope_ok and norms_ok and self.moe == self.moe_blocks

    @property
    def recurrent(self) -> int:
        """Layers mixing with a state-space scan or a short convolution (a Mamba layer has a conv before its
        scan, so the larger count)."""
        return max(self.ssm, self.conv)

    @property
    def _rope_expected(self) -> int | None:
        if self.rope_layers is not None:
            return self.rope_layers
        return None if self.layers is None else self.layers - self.recurrent

    @property
    def _of_attention_layers(self) -> str:
        return "" if self._rope_expected is None else f"/{self._rope_expected}"

    def line(self) -> str:
        of_layers = f"/{self.layers}" if self.layers is not None else ""
        parts = [
            f"attention {self.attention}{of_layers}"
            + (f" ({self.attention_unmatched} unmatched)" if self.attention_unmatched else ""),
            f"rope {self.rope}{self._of_attention_layers}" if self.uses_rope else "rope n/a",
            f"rmsnorm {self.rmsnorm}" + (f" ({self.norm_unmatched} unmatched)" if self.norm_unmatched else ""),
            f"moe {self.moe}/{self.moe_blocks}",
        ]
        if self.ssm:  # shown only for state-space models
            parts.insert(1, f"ssm {self.ssm}{of_layers}")
        elif self.conv:  # short-convolution layers without a scan (LFM2)
            parts.insert(1, f"conv {self.conv}{of_layers}")
        if self.layernorm or self.layernorm_unmatched:  # shown only for models with LayerNorms
            parts.insert(3, f"layernorm {self.layernorm}"
                         + (f" ({self.layernorm_unmatched} unmatched)" if self.layernorm_unmatched else ""))
        return "coverage: " + " | ".join(parts)


def _canonical_kind(target) -> str | None:
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "auto_deploy":
        name = target._schema.name.split("::")[-1]
        if name == "torch_mla":  # multi-head latent attention: a layer's attention
            return "torch_attention"
        if name in SSM_OPS:
            return "ssm"
        if name == "torch_causal_conv1d":
            return "conv"
        for kind in ("torch_attention", "torch_rope", "torch_rmsnorm", "torch_layernorm", "torch_moe"):
            if name.startswith(kind):
                return kind
    return None


def rope_layer_count(config) -> int | None:
    """How many layers use RoPE per the HF config when some are NoPE layers, else None (all of them):
    ``no_rope_layers`` (Llama 4, SmolLM3: 1 = uses RoPE), or ``rope_parameters`` per layer type with None
    for a NoPE type (Beam)."""
    layers = getattr(config, "num_hidden_layers", None)
    if config is None or layers is None:
        return None
    flags = getattr(config, "no_rope_layers", None)
    if isinstance(flags, (list, tuple)) and len(flags) >= layers:
        return sum(1 for f in flags[:layers] if f)
    params, types = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None)
    if isinstance(params, dict) and types and all(t in params for t in types[:layers]):
        return sum(1 for t in types[:layers] if params[t] is not None)
    return None


def measure_coverage(mod: nn.Module, num_layers: int | None, rope_layers: int | None = None) -> Coverage:
    kinds: Counter = Counter()
    attention_unmatched = norm_unmatched = layernorm_unmatched = 0
    uses_rope = False
    expert_weights: Counter = Counter()  # module -> its 3D (stacked per-expert) weights
    ssm_modules: set[str] = set()  # modules holding an A_log: state-space mixers
    for _, gm in named_graphmodules(mod):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                kind = _canonical_kind(node.target)
                if kind:
                    kinds[kind] += 1
                elif node.target in (
                    aten.scaled_dot_product_attention.default, aten._softmax.default, aten.softmax.int
                ):
                    attention_unmatched += (
                        node.target is aten.scaled_dot_product_attention.default or _is_attention_softmax(node)
                    )
                elif node.target in (aten.layer_norm.default, aten.native_layer_norm.default):
                    layernorm_unmatched += 1
                elif node.target is aten.rsqrt.default:
                    norm_unmatched += 1
                elif node.target in (aten.sin.default, aten.cos.default, aten.polar.default):  # polar: complex freqs
                    uses_rope = True
            elif node.op == "get_attr":
                module, _, name = node.target.rpartition(".")
                if name == "A_log":
                    ssm_modules.add(module)
                val = node_val(node)
                if val is not None and val.dim() == 3:
                    expert_weights[node.target.rpartition(".")[0]] += 1
    return Coverage(
        layers=num_layers,
        attention=kinds["torch_attention"],
        attention_unmatched=attention_unmatched,
        rope=kinds["torch_rope"],
        uses_rope=uses_rope or kinds["torch_rope"] > 0,
        rmsnorm=kinds["torch_rmsnorm"],
        norm_unmatched=norm_unmatched,
        moe=kinds["torch_moe"],
        # e.g. gate_up + down; a state-space mixer's 3D tensors (it owns an A_log: Zamba's per-head projections)
        # are not experts
        moe_blocks=sum(1 for module, n in expert_weights.items() if n >= 2 and module not in ssm_modules),
        layernorm=kinds["torch_layernorm"],
        layernorm_unmatched=layernorm_unmatched,
        ssm=kinds["ssm"],
        conv=kinds["conv"],
        rope_layers=rope_layers,
    )


def _is_attention_softmax(node) -> bool:
    """A softmax over a 4D score tensor (router softmaxes are 2D)."""
    val = node_val(node)
    return val is not None and val.dim() == 4
