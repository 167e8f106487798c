"""The torch.export driver: HF model -> flat ``GraphModule(input_ids, position_ids) -> (logits,)``."""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from ..errors import ExportError
from ..utils.fx import mark_shapes_current
from ..utils.logger import ad_logger
from .patches import apply_export_patches

# Sample sizes used while tracing: >= 2 so that export does not specialize the dims to 0/1.
_SAMPLE_BATCH, _SAMPLE_SEQ = 2, 4


@contextlib.contextmanager
def _logits_only_forward(model: nn.Module):
    """Make ``model(input_ids, position_ids)`` return ``(logits,)`` while exporting."""
    original = model.forward

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        return (original(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits,)

    model.forward = types.MethodType(forward, model)
    try:
        yield
    finally:
        del model.forward  # back to the class's forward


def example_inputs(device: torch.device, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.zeros(_SAMPLE_BATCH, _SAMPLE_SEQ, dtype=torch.long, device=device)
    position_ids = torch.arange(_SAMPLE_SEQ, device=device).expand(_SAMPLE_BATCH, _SAMPLE_SEQ)
    return input_ids, position_ids


def dynamic_shapes(max_batch_size: int, max_seq_len: int):
    batch = torch.export.Dim("batch", min=1, max=max(max_batch_size, _SAMPLE_BATCH))
    seq = torch.export.Dim("seq", min=1, max=max(max_seq_len, _SAMPLE_SEQ))
    return ({0: batch, 1: seq}, {0: batch, 1: seq})


def flatten_io(gm: GraphModule) -> GraphModule:
    """A plain GraphModule without export's pytree calling convention and input-check hooks:
    ``forward(*inputs)`` (positional or by name) returns a flat tuple. Tensors are shared, not copied."""
    gm.graph._codegen = torch.fx.graph.CodeGen()
    plain = GraphModule(gm, gm.graph)
    plain.meta.update(getattr(gm, "meta", {}))
    return plain


def torch_export_to_gm(
    model: nn.Module,
    *,
    max_batch_size: int,
    max_seq_len: int,
    strict: bool = False,
    clone_state_dict: bool = False,
    patch_list: list[str] | None = None,
    export_config: Any = None,
) -> GraphModule:
    """Export ``model`` with dynamic batch/sequence dims and the selected export patches."""
    device = next(model.parameters()).device
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", 2)
    args = example_inputs(device, vocab_size)
    # no_grad: the graph is for inference, and a model's own ``torch.no_grad()`` blocks (HRM's reasoning
    # cycles) then change nothing, instead of becoming wrap_with_set_grad_enabled submodules
    with (apply_export_patches(model, export_config, patch_list, max_seq_len), _logits_only_forward(model),
          torch.no_grad()):
        try:
            # a guard the symbolic solver cannot prove over the whole seq range (e.g. Aria's
            # seq * min(64, 64 * seq) == 64 * seq) becomes a runtime assert in the graph instead of failing
            program = torch.export.export(
                model, args, dynamic_shapes=dynamic_shapes(max_batch_size, max_seq_len), strict=strict,
                prefer_deferred_runtime_asserts_over_guards=True,
            )
        except Exception as exc:  # torch.export raises many types; give one actionable message
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ExportError(
                f"torch.export failed for {type(model).__name__} ({type(exc).__name__}: {first_line}). "
                f"Set AUTO_DEPLOY_LOG_LEVEL=DEBUG for the full trace; an export patch "
                f"(transforms.export_to_gm.patch_list) may be needed for this model."
            ) from exc
    gm = flatten_io(program.module())
    mark_shapes_current(gm)  # export's values are exact: propagations recompute only what transforms change
    if clone_state_dict:
        for name, tensor in list(gm.state_dict(keep_vars=True).items()):
            assign_tensor(gm, name, tensor.clone())
    ad_logger.info(f"exported {type(model).__name__}: {len(gm.graph.nodes)} nodes")
    return gm


def assign_tensor(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the parameter/buffer ``name`` of ``root`` by ``tensor`` (no copy)."""
    module_name, _, attr = name.rpartition(".")
    module = root.get_submodule(module_name) if module_name else root
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        setattr(module, attr, tensor)
