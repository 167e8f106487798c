"""Autocast regions cannot be traced on the meta device; inside export they are no-ops.

``torch.autocast(device_type="meta")`` raises, and HF code opens autocast regions on the input's
device (e.g. to force fp32 RoPE). The code inside already casts explicitly, so replacing the
context by a no-op changes nothing in the traced computation.
"""

import contextlib
from unittest import mock

import torch

from .registry import ExportPatch, ExportPatchRegistry


class _NoopAutocast(contextlib.ContextDecorator):
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@ExportPatchRegistry.register("autocast_noop")
class AutocastNoop(ExportPatch):
    @contextlib.contextmanager
    def patch(self):
        with (
            mock.patch.object(torch, "autocast", _NoopAutocast),
            mock.patch.object(torch.amp, "autocast", _NoopAutocast),
        ):
            yield
