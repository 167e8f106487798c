import os
from pathlib import Path

import pytest

from tiny_models import save_tiny_checkpoint

# Inductor's FX-graph cache key leaves out the instruction set it compiles for (compile/torch_compile.py pins the
# vector width for the product's own graphs). Tests that call torch.compile themselves, run with
# ATEN_CPU_CAPABILITY=avx2 after a run without it, reloaded the AVX-512 run's kernels and got wrong results; so
# each capability set that way gets a cache of its own, unless the caller chose one.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch, **config_overrides)`` -> path of a saved tiny checkpoint (cached per session)."""
    cache: dict = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt_{arch}")
            cache[key] = save_tiny_checkpoint(path, arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch):
    """Tests start without dump directory / log level settings from the caller's shell, and ``backend:
    auto`` serves the graph uncompiled (compiling every model a test builds would take the suite hours; the
    tests of the torch-compile backend name it)."""
    from autodeploy.compile import AUTO_BACKEND_ENV
    from autodeploy.utils.graph_writer import graph_writer

    monkeypatch.delenv("AD_DUMP_GRAPHS_DIR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(AUTO_BACKEND_ENV, "torch-simple")
    graph_writer.reset()
    yield
    graph_writer.reset()
