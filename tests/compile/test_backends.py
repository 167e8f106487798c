"""The compile-backend registry: compile_model serves what the named backend returns; an unknown name is a
config error that lists the known ones."""

import pytest
from torch import nn

from autodeploy import LLM, SamplingParams
from autodeploy.compile import compile_backend_names, get_compile_backend, register_compile_backend
from autodeploy.errors import ConfigError
from autodeploy.runtime.kv_cache import KV_CACHE_META_KEY


def test_the_builtin_backends():
    assert {"torch-simple", "torch-compile"} <= set(compile_backend_names())
    with pytest.raises(ConfigError, match="unknown compile backend 'nope'; known: .*torch-simple"):
        get_compile_backend("nope")


def test_a_registered_backend_serves_the_cached_graph(tiny_checkpoint):
    seen = []

    class Counting(nn.Module):
        def __init__(self, gm):
            super().__init__()
            self.gm, self.calls = gm, 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.gm(*args, **kwargs)

    @register_compile_backend("test-counting")
    def counting(gm, config):
        seen.append((KV_CACHE_META_KEY in gm.meta, config.capture_batch_sizes))
        return Counting(gm)

    path = tiny_checkpoint("llama")
    llm = LLM(path, max_batch_size=2, max_seq_len=32, overrides={"transforms.compile_model.backend": "test-counting"})
    assert seen == [(True, [1, 2, 4, 8])]
    base = LLM(path, max_batch_size=2, max_seq_len=32)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompts = [[1, 2, 3], [4, 5]]
    outs = llm.generate(prompts, params)
    assert isinstance(llm.module, Counting) and llm.module.calls > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    with pytest.raises(ValueError, match="already registered"):
        register_compile_backend("test-counting")(lambda gm, config: gm)


def test_auto_is_aoti_where_inductor_finds_a_compiler_and_avx2_or_avx512(monkeypatch):
    from autodeploy.compile import AUTO_BACKEND_ENV, resolve_compile_backend

    monkeypatch.delenv(AUTO_BACKEND_ENV)
    assert resolve_compile_backend("torch-simple") == "torch-simple"  # a named backend is itself
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX512")
    assert resolve_compile_backend("auto") == "aoti"
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX2")
    assert resolve_compile_backend("auto") == "aoti"
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "DEFAULT")  # ARM: not validated yet
    assert resolve_compile_backend("auto") == "torch-simple"
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr("shutil.which", lambda name: None)  # no C++ compiler: Inductor cannot build
    assert resolve_compile_backend("auto") == "torch-simple"
    monkeypatch.setenv(AUTO_BACKEND_ENV, "torch-simple")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    assert resolve_compile_backend("auto") == "torch-simple"
    monkeypatch.setenv(AUTO_BACKEND_ENV, "nope")
    with pytest.raises(ConfigError, match="AUTODEPLOY_COMPILE_BACKEND='nope' names no compile backend"):
        resolve_compile_backend("auto")


def test_the_default_backend_is_auto():
    from autodeploy.config import load_config
    from autodeploy.transform.library.compile import CompileModelConfig

    assert load_config().transforms["compile_model"]["backend"] == "auto"
    assert CompileModelConfig(stage="compile").backend == "auto"
    with pytest.raises(ValueError, match="known: auto, "):
        CompileModelConfig(stage="compile", backend="nope")


def test_auto_serves_a_graph_without_kv_cache_uncompiled(monkeypatch):
    """``auto`` compiles only a cached graph; without one (no attention matched) the graph is served as it
    is, so the runtime names what is missing. A named torch-compile still says it needs the cached graph."""
    import torch

    from autodeploy.compile import AUTO_BACKEND_ENV
    from autodeploy.errors import AutoDeployError
    from helpers import export_gm, run_transform

    monkeypatch.delenv(AUTO_BACKEND_ENV)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX512")
    gm = export_gm(torch.nn.Linear(8, 8), torch.randn(2, 8))
    assert run_transform("compile_model", gm, "compile", backend="auto") is gm
    with pytest.raises(AutoDeployError, match="needs the cached graph"):
        run_transform("compile_model", gm, "compile", backend="torch-compile")
