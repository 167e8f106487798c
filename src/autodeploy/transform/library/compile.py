"""compile stage: ``compile_model`` compiles the cached graph (the one the runtime serves) with a backend of
the compile-backend registry (:mod:`autodeploy.compile`).

Config: ``backend``: ``auto`` (the default: ``aoti`` where Inductor finds a C++ compiler, else
``torch-simple``; ``$AUTODEPLOY_COMPILE_BACKEND`` overrides the choice; where ``aoti`` cannot package the
graph, ``auto`` compiles with ``torch-compile`` instead), ``aoti`` (the decode step compiled ahead of time by
AOTInductor, :mod:`autodeploy.compile.aoti`), ``torch-simple`` (no compilation: the GraphModule runs as
generated Python code) or ``torch-compile`` (Inductor, :mod:`autodeploy.compile.torch_compile`);
``capture_batch_sizes`` (decode batch sizes run once up front, like CUDA-graph batch sizes, so their graphs
are compiled before serving; capped by ``max_batch_size``); ``compile_prefill`` (also compile the graph that
serves prefill and mixed batches; default off: prompts ran faster eager on the CPUs measured, and the compiled
prefill graph with AVX2 code gave wrong greedy tokens at batch 16); ``freeze_weights`` (Inductor freezing of
the multi-sequence decode graph: the weights of its ``aten.linear`` nodes become constants that Inductor
prepacks for oneDNN, at the cost of a second copy of them; nothing to prepack where ``native_linear`` took the
linears); ``warmup_time_budget_s`` (stop warming up once this much time is spent: the remaining shapes compile
on first use).
"""

from __future__ import annotations

import time

from pydantic import Field, field_validator
from torch import nn
from torch.fx import GraphModule

from ...compile import compile_backend_names, get_compile_backend, resolve_compile_backend
from ...compile.torch_compile import start_isa_probe
from ...errors import AutoDeployError, PackageError
from ...runtime.kv_cache import KV_CACHE_META_KEY
from ...utils.fx import named_graphmodules, set_submodule
from ...utils.logger import ad_logger
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry


class CompileModelConfig(TransformConfig):
    backend: str = Field(
        default="auto",
        description="Compile backend: auto (aoti where Inductor finds a C++ compiler, else "
        "torch-simple; $AUTODEPLOY_COMPILE_BACKEND overrides), aoti (the decode step compiled ahead of time by "
        "AOTInductor, served from a package), torch-simple (no compilation) or torch-compile "
        "(torch.compile, Inductor).",
    )
    capture_batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8],
        description="Decode batch sizes compiled up front (capped by max_batch_size).",
    )
    compile_prefill: bool = Field(
        default=False, description="Also compile the graph serving prefill and mixed batches (and warm it up)."
    )
    freeze_weights: bool = Field(
        default=False,
        description="Inductor freezing for the decode graph: the weights of its aten.linear nodes become "
        "constants, prepacked for oneDNN (costs a second copy of them; nothing to gain where native_linear "
        "took the linears).",
    )
    warmup_time_budget_s: float | None = Field(
        default=600.0, description="Stop the warm-up after this many seconds (null: no limit)."
    )
    # the compiler's own memory, plus the prepacked weights with freeze_weights
    expect_mem_change: bool = True
    run_per_gm: bool = False
    requires_clean_graph: bool = False
    run_graph_cleanup: bool = False

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        if name != "auto" and name not in compile_backend_names():
            raise ValueError(f"unknown compile backend {name!r}; known: auto, {', '.join(compile_backend_names())}")
        return name


def _find_cached_graph(mod: nn.Module) -> tuple[str, GraphModule] | None:
    return next(((name, gm) for name, gm in named_graphmodules(mod) if KV_CACHE_META_KEY in gm.meta), None)


def _cached_graph(mod: nn.Module) -> tuple[str, GraphModule]:
    found = _find_cached_graph(mod)
    if found is None:
        raise AutoDeployError("compile_model needs the cached graph: run the cache_init stage first")
    return found


@TransformRegistry.register("compile_model")
class CompileModel(BaseTransform):
    """Compile the cached graph with the configured backend (see the module docstring)."""

    config: CompileModelConfig

    def prepare(self, ctx: PipelineContext) -> None:
        if resolve_compile_backend(self.config.backend) in ("torch-compile", "aoti"):
            start_isa_probe()  # answered while the earlier stages run

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        backend = resolve_compile_backend(self.config.backend)
        if backend != "torch-simple" and self.config.backend == "auto" and _find_cached_graph(mod) is None:
            backend = "torch-simple"  # nothing to compile; the runtime says what is missing (no KV cache)
        if backend != self.config.backend:
            ad_logger.info(f"backend {self.config.backend}: {backend}")
        if backend == "torch-simple":  # serves the graph as it is: nothing more to do or to log
            return mod, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        name, gm = _cached_graph(mod)
        start = time.perf_counter()
        try:
            served = get_compile_backend(backend)(gm, self.config)
        except PackageError as exc:
            if self.config.backend != "auto":
                raise
            ad_logger.warning(f"{exc}; compiling with torch-compile instead")
            served = get_compile_backend("torch-compile")(gm, self.config)
        ad_logger.info(f"compiled in {time.perf_counter() - start:.1f} s")
        mod = served if name == "" else set_submodule(mod, name, served)
        return mod, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=True)
