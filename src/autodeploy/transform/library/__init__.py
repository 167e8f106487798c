"""The transform library: importing it registers every transform."""

from . import build_model, cleanup, export_to_gm, load_weights  # noqa: F401
