from .hf import HFCheckpointFactory

__all__ = ["HFCheckpointFactory"]
