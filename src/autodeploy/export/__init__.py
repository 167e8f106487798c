from .export import torch_export_to_gm

__all__ = ["torch_export_to_gm"]
