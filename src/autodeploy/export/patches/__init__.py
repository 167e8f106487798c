"""Export patches: named context managers applied around ``torch.export`` (see registry.py)."""

# Import the modules that register patches.
from . import autocast, gated_delta, mamba, moe, sparse_indexer, tensor_constants, torch_where  # noqa: E402,F401
from .registry import ExportPatch, ExportPatchRegistry, apply_export_patches

__all__ = ["ExportPatch", "ExportPatchRegistry", "apply_export_patches"]
