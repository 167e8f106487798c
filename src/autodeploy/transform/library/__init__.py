"""The transform library: importing it registers every transform."""

from . import (  # noqa: F401
    attention, build_model, cleanup, compile, export_to_gm, fusion, kvcache, load_weights, moe, native_linear,
    quantize, rmsnorm, rope,
)
