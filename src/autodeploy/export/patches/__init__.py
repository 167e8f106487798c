"""Export patches: named context managers applied around ``torch.export`` (see registry.py)."""

from .registry import ExportPatch, ExportPatchRegistry, apply_export_patches

# Import the modules that register patches.
from . import autocast, moe, torch_where  # noqa: E402,F401

__all__ = ["ExportPatch", "ExportPatchRegistry", "apply_export_patches"]
