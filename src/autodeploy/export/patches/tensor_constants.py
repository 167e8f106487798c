"""Tensors made from Python data inside ``forward`` keep their values when the model is on the meta device.

The model is exported on the meta device (no weight memory). A tensor that its code builds from Python
data while tracing, ``torch.tensor(2.0, device=x.device)`` or the list in an index such as Falcon's
``qkv[:, :, :, [-2]]``, is then created on meta too, and export lifts it as a constant whose value is
lost (``load_weights`` later reports it as a graph tensor no checkpoint provides). While export runs, this
patch builds such tensors on the CPU and moves them with ``.to(meta)``: the graph holds the real CPU
constant and a ``_to_copy(device=meta)`` node, whose device ``load_weights`` rewrites to the target
device like every other ``device=meta`` argument. Applies only to models on the meta device.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from .registry import ExportPatch, ExportPatchRegistry

_META = torch.device("meta")
_FACTORIES = (torch.tensor, torch.as_tensor)


def _is_int_list(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(v, (int, bool)) for v in value))


def _target_device(kwargs) -> torch.device:
    device = kwargs.get("device")
    if device is None:
        return torch.get_default_device()
    return torch.device(device) if not isinstance(device, torch.device) else device


class _DataTensorsOnCPU(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and args and not isinstance(args[0], torch.Tensor) and _target_device(kwargs) == _META:
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).to(_META)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2:
            self_, index = args[0], args[1]
            if isinstance(self_, torch.Tensor) and self_.device == _META:
                parts = index if isinstance(index, tuple) else (index,)
                if any(isinstance(p, list) and _is_int_list(p) for p in parts):
                    def convert(p):
                        if isinstance(p, list) and _is_int_list(p):
                            dtype = torch.bool if all(isinstance(v, bool) for v in p) else torch.long
                            return torch.tensor(p, dtype=dtype, device="cpu").to(_META)
                        return p

                    converted = tuple(convert(p) for p in parts)
                    index = converted if isinstance(index, tuple) else converted[0]
                    args = (self_, index, *args[2:])
        return func(*args, **kwargs)


@ExportPatchRegistry.register("tensor_constants_off_meta")
class TensorConstantsOffMeta(ExportPatch):
    def applies(self) -> bool:
        return any(p.is_meta for p in self.model.parameters())

    @contextlib.contextmanager
    def patch(self):
        with _DataTensorsOnCPU():
            yield
