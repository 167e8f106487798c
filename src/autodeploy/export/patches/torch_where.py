"""``torch.where(cond)`` (one argument) is an alias of ``torch.nonzero(cond, as_tuple=True)``.

The one-argument form has no export-friendly decomposition; the explicit nonzero does.
"""

import contextlib
from unittest import mock

import torch

from .registry import ExportPatch, ExportPatchRegistry


@ExportPatchRegistry.register("torch_where_single_arg")
class TorchWhereSingleArg(ExportPatch):
    @contextlib.contextmanager
    def patch(self):
        original = torch.where

        def where(condition, *args, **kwargs):
            if not args and not kwargs:
                return torch.nonzero(condition, as_tuple=True)
            return original(condition, *args, **kwargs)

        with mock.patch.object(torch, "where", where):
            yield
