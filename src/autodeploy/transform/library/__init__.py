"""The transform library: every module in this package is imported, and its transforms register themselves
(``@TransformRegistry.register``). Adding a transform means adding its module here and its YAML entry.
The canonical ops come first, so transforms and the product-op registry find them."""

import importlib
import pkgutil

from ... import custom_ops  # noqa: F401  (registers the canonical ops and the product ops)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
