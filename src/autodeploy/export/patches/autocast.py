"""Autocast regions cannot be traced on the meta device; inside export they are no-ops.

HF models wrap e.g. RoPE in ``torch.autocast(..., enabled=False)`` to force fp32; the code inside
already casts explicitly, so skipping the context changes nothing in the traced computation.
"""

import contextlib
from unittest import mock

import torch

from .registry import ExportPatch, ExportPatchRegistry


@ExportPatchRegistry.register("autocast_noop")
class AutocastNoop(ExportPatch):
    @contextlib.contextmanager
    def patch(self):
        with mock.patch.object(torch.autocast, "__enter__", lambda self: self), \
             mock.patch.object(torch.autocast, "__exit__", lambda self, *exc: False):
            yield
