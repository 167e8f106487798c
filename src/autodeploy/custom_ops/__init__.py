"""Canonical ops in the ``auto_deploy`` torch.library namespace.

Each op has a plain-torch reference implementation and a fake (meta) implementation, so export,
shape propagation and torch.compile work on graphs that use them. The pattern matcher rewrites
model-specific subgraphs into these ops; later stages (KV cache, fusions, kernels) work on them.
"""

from . import attention, cached_attention, moe, quant_linear, rmsnorm, rope  # noqa: F401  (registers the ops)
