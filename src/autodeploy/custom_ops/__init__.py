"""Canonical ops in the ``auto_deploy`` torch.library namespace.

Each op has its schema, a plain-torch reference implementation and a fake (meta) implementation defined in
Python, so export, shape propagation and torch.compile work on graphs that use them, on every machine. The
pattern matcher rewrites model-specific subgraphs into these ops; later stages (KV cache, fusions, kernels)
work on them. Native kernels (:mod:`autodeploy.custom_ops.native`) register as the CPU implementation of
some of them where they build. Product ops declare themselves in the product-op registry
(:mod:`autodeploy.utils.products`), pure ops their compile forms (:mod:`.compile_forms`).
"""

import importlib
import pkgutil

# every module here defines ops (and their registry entries) when imported: discovered, not listed, so a new
# op family is its own file and nothing else
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
