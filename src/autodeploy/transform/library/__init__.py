"""The transform library: importing it registers every transform."""

from . import attention, build_model, cleanup, export_to_gm, kvcache, load_weights, moe, rmsnorm, rope  # noqa: F401
