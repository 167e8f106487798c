"""The served package (runtime/package.py) and the build in a child process (build_process.py): the aoti
backend's module written as files, loaded by a process that never imports the exporter or the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.custom_ops import native
from autodeploy.errors import AutoDeployError, CheckpointError, PackageError
from autodeploy.runtime.kv_cache import CacheLayer, KVCacheSpec
from autodeploy.runtime.package import MANIFEST_FILE, _spec_from_json, _spec_json, read_manifest
from autodeploy.runtime.scheduler import Interrupt
from autodeploy.utils.fx import graph_tensors
from autodeploy.utils.memory import file_mapped_ranges

PROMPTS = [[1, 5, 9, 3, 7], [2, 4, 6], [11, 12, 13, 14, 15, 16, 17]]
#: what only a build needs: none of it may be loaded in a process that serves a package
BUILD_ONLY = ("torch._inductor", "torch._dynamo", "sympy", "networkx", "transformers.models",
              "autodeploy.transform", "autodeploy.export")


def _run_python(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def test_kv_cache_spec_round_trips_through_json():
    spec = KVCacheSpec("torch", 16, 4, 64, [CacheLayer("k0", "v0", 2, 16, 8, torch.bfloat16)], num_pages=9,
                       device="cpu")
    assert _spec_from_json(json.loads(json.dumps(_spec_json(spec)))) == spec


def test_a_manifest_of_another_format_or_torch_is_refused(tmp_path):
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": 99, "torch": torch.__version__}))
    with pytest.raises(AutoDeployError, match=r"manifest.json: package format 99"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(AutoDeployError, match="not a readable package manifest"):
        read_manifest(tmp_path)


def test_the_weights_file_is_mapped_from_its_header(tmp_path):
    """The loader maps the package's safetensors file itself (no page read before the huge-page hint): every
    dtype a package holds comes back equal, and a file that is not safetensors gets one message naming it."""
    from safetensors.torch import save_file

    from autodeploy.runtime.package import _map_tensors, _safetensors_references

    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "f16": torch.randn(2, 2).half(),
               "i8": torch.randint(-128, 127, (9,), dtype=torch.int8),
               "u8": torch.randint(0, 255, (4, 3), dtype=torch.uint8), "i64": torch.arange(5),
               "i32": torch.arange(6, dtype=torch.int32), "flag": torch.tensor([True, False]),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "weights.safetensors"), metadata={"note": "metadata is skipped"})
    mapped = _map_tensors(_safetensors_references(tmp_path / "weights.safetensors"))
    assert mapped.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(AutoDeployError, match="bad.safetensors: not a readable safetensors file"):
        _safetensors_references(tmp_path / "bad.safetensors")
    header = json.dumps({"x": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "odd.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(AutoDeployError, match="odd.safetensors: holds tensors of dtype U16"):
        _safetensors_references(tmp_path / "odd.safetensors")


def test_canonical_ops_run_without_importing_dynamo():
    """torch.library.custom_op's kernels import Dynamo at their first call unless the package loader says
    they need not; the control run (without it) shows the test can fail."""
    code = """
        import sys, torch
        import autodeploy.custom_ops
        from autodeploy.runtime.package import _run_custom_ops_without_dynamo
        if {skip}:
            assert _run_custom_ops_without_dynamo() > 0
        x = torch.randn(2, 8)
        out = torch.ops.auto_deploy.torch_rmsnorm(x, torch.ones(8), 1e-6)
        assert torch.allclose(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)
        print("torch._dynamo" in sys.modules, "sympy" in sys.modules)
    """
    assert _run_python(code.format(skip=True)).stdout.split() == ["False", "False"]
    assert _run_python(code.format(skip=False)).stdout.split() == ["True", "True"]


def test_a_failed_build_in_the_child_raises_its_error_here(tmp_path, monkeypatch):
    """The child's error class and message reach the caller (no traceback of the child's, no fallback)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setenv("AUTODEPLOY_COMPILE_BACKEND", "aoti")
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(str(tmp_path), max_batch_size=2, max_seq_len=32)


def test_a_graph_that_cannot_be_packaged_is_reported_not_raised(tiny_checkpoint, tmp_path, monkeypatch):
    """run_build (the child's entry point) tells the parent to build in-process when only packaging failed."""
    from autodeploy import build_process
    from autodeploy.compile import aoti
    from autodeploy.llm import llm_config

    def refuse(gm):
        raise PackageError("aoti: exporting the decode graph failed: for this test")

    monkeypatch.setattr(aoti, "compile_decode_package", refuse)
    config = llm_config(tiny_checkpoint("llama"), 2, 32, overrides={"transforms.compile_model.backend": "aoti"})
    (tmp_path / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    out = tmp_path / "package"
    out.mkdir()
    assert build_process.run_build(str(tmp_path / "config.json"), str(out)) == 0
    result = json.loads((out / build_process.RESULT_FILE).read_text())
    assert result == {"packaged": False, "reason": "aoti: exporting the decode graph failed: for this test"}


def test_the_child_is_asked_for_aoti_and_its_refusal_comes_back(tiny_checkpoint, monkeypatch):
    """build_package names the aoti backend for the child (so that a graph it cannot package is reported,
    not compiled there with torch-compile's fallback) and hands back the child's reason."""
    from autodeploy import build_process
    from autodeploy.llm import llm_config

    def fake_child(argv):
        config_file, package = argv[-2:]
        assert json.loads(open(config_file).read())["transforms"]["compile_model"]["backend"] == "aoti"
        with open(os.path.join(package, build_process.RESULT_FILE), "w") as f:
            json.dump({"packaged": False, "reason": "aoti: for this test"}, f)
        return 0

    monkeypatch.setattr(build_process.subprocess, "call", fake_child)
    package, result = build_process.build_package(llm_config(tiny_checkpoint("llama"), 2, 32))
    assert package is None and result["reason"] == "aoti: for this test"


def test_an_llm_whose_graph_cannot_be_packaged_builds_here_with_torch_compile(tiny_checkpoint, monkeypatch,
                                                                              caplog):
    """Where the child reports that only the packaging failed, the LLM warns with its reason, runs the
    pipeline in this process with the torch-compile backend, and serves what that built. (The backend is
    recorded and stood in for by torch-simple, so the test needs no Inductor compile.)"""
    from autodeploy import build_process
    from autodeploy.compile import backends

    path = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = LLM(str(path), max_batch_size=4, max_seq_len=64)  # torch-simple (the suite's default)
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params)]

    compiled = []

    def torch_compile_stand_in(gm, config):
        compiled.append(config.backend)
        return backends.get_compile_backend("torch-simple")(gm, config)

    monkeypatch.setitem(backends._BACKENDS, "torch-compile", torch_compile_stand_in)
    monkeypatch.setattr(build_process, "build_package",
                        lambda config, key=None: (None, {"packaged": False, "reason": "aoti: for this test"}))
    monkeypatch.setenv("AUTODEPLOY_COMPILE_BACKEND", "aoti")
    llm = LLM(str(path), max_batch_size=4, max_seq_len=64)
    assert compiled == ["torch-compile"]
    assert "serving from this process with torch-compile instead: aoti: for this test" in caplog.text
    assert type(llm.module).__name__ != "PackagedModel"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected


@pytest.mark.slow
def test_llm_builds_in_a_child_and_serves_the_package_without_the_compiler(tiny_checkpoint):
    """The default route where the aoti backend is chosen: greedy tokens and their log-probabilities as the
    uncompiled in-process graph gives them (batch 3 and batch 1, prefill and decode), in a serving process
    that loaded none of the build's modules, its weights hinted for huge pages (a 4096-wide MLP: 6 MiB of them)."""
    path = tiny_checkpoint("llama", intermediate_size=4096)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    reference = LLM(str(path), max_batch_size=4, max_seq_len=64)  # torch-simple (the suite's default)
    expected = [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs]
                for prompts in (PROMPTS, PROMPTS[:1]) for o in reference.generate(prompts, params)]
    served = _run_python(f"""
        import json, sys
        from autodeploy import LLM, SamplingParams
        from autodeploy.utils.fx import graph_tensors
        from autodeploy.utils.memory import file_mapped_ranges
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from proc_maps import vm_flags
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
        for attempt in ("built", "cached"):
            llm = LLM({str(path)!r}, max_batch_size=4, max_seq_len=64)
            got = [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs]
                   for prompts in ({PROMPTS!r}, {PROMPTS[:1]!r}) for o in llm.generate(prompts, params)]
            tensors = graph_tensors(llm.module.general)
            table = tensors["model.embed_tokens.weight"].data_ptr()
            weight = max((t for n, t in tensors.items() if "embed" not in n), key=lambda t: t.numel()).data_ptr()
            print(json.dumps({{"got": got, "module": type(llm.module).__name__, "build_peak": llm.build_peak_rss_bytes,
                              "loaded": sorted(m for m in sys.modules if m.startswith({BUILD_ONLY!r})),
                              "decode_package": llm.module.decode.package_path,
                              "table_mapped": any(a <= table < b for a, b in file_mapped_ranges()),
                              "flags": {{"weight": vm_flags(weight), "table": vm_flags(table)}}}}))
    """, env={"AUTODEPLOY_COMPILE_BACKEND": "aoti"})
    assert served.returncode == 0, served.stderr[-3000:]
    built, cached = (json.loads(line) for line in served.stdout.strip().splitlines()[-2:])
    assert built["build_peak"] > 0 and cached["build_peak"] is None  # the second LLM found the package
    assert "serving the package built earlier" in served.stderr
    for found in (built, cached):
        assert found["module"] == "PackagedModel"
        assert found["loaded"] == []
        assert found["table_mapped"]  # float32 products: the embedding table is read a row at a time from the file
        # the weights a decode step reads whole in huge pages; the table's rows in pages of their own
        assert "hg" in found["flags"]["weight"] and "rr" not in found["flags"]["weight"]
        assert "rr" in found["flags"]["table"] and "hg" not in found["flags"]["table"]
        for want, got in zip(expected, found["got"], strict=True):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4
    # the pointwise kernels of a decode step run on one thread: the MLP's SiLU x up, 4096 values a thread in the
    # package's two-sequence example, would be split over the threads with Inductor's default chunk (512)
    assert "#pragma omp parallel" not in _package_source(built["decode_package"], "kernel")
    if native.library() is not None:
        _check_calls_native_kernels_directly(built["decode_package"])


def _package_source(package: str, part: str = "wrapper") -> str:
    """The C++ an AOTInductor package's decode step was compiled from: its wrapper, which calls the kernels, or
    (``part="kernel"``) Inductor's own kernels."""
    with zipfile.ZipFile(package) as archive:
        return next(archive.read(n).decode() for n in archive.namelist() if n.endswith(f"{part}.cpp"))


def _check_calls_native_kernels_directly(package: str) -> None:
    """With the native kernels, the decode package calls their C shims, not the proxy executor (a layer's RoPE,
    cache write and attention in one of them); a process without them refuses the package with a message that says
    so."""
    wrapper = _package_source(package)
    linear = "f32_packed_linear" if native.f32_pack_width() else "f32_linear"  # panels where the build reads them
    for op in (linear, "decode_attention_rope"):  # the Llama's RoPE, cache write and attention: one call
        assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{op}(" in wrapper, op
    assert "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_decode_attention(" not in wrapper  # every layer's fused
    assert "aoti_torch_proxy_executor_call_function(proxy_executor" not in wrapper
    refused = _run_python(f"""
        from autodeploy.errors import AutoDeployError
        from autodeploy.runtime.package import AOTIDecode
        try:
            AOTIDecode({package!r}, {{}})
        except AutoDeployError as exc:
            print(exc)
    """, env={native.DISABLE_ENV: "0"})
    assert refused.returncode == 0, refused.stderr[-3000:]
    assert "calls autodeploy's native kernels, which this process does not run" in refused.stdout


@pytest.mark.slow
@pytest.mark.parametrize("dtype, op", [("bf16", "half_linear"), ("int8", "int8_gemv"), ("int4", "int4_linear")])
def test_a_package_of_quantized_weights_decodes_as_the_uncompiled_graph(tiny_checkpoint, dtype, op):
    """16-bit, int8 and 4-bit weights through the aoti package (whose decode step calls the kernels' C shims where
    they run) give the greedy tokens and log-probabilities of the same configuration served uncompiled."""
    path = tiny_checkpoint("llama")
    quant = {"transforms.quantize_weights.enabled": True, "transforms.quantize_weights.dtype": dtype}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)

    def generate(overrides):
        llm = LLM(str(path), max_batch_size=4, max_seq_len=64, overrides=overrides)
        return llm, [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs]
                     for prompts in (PROMPTS, PROMPTS[:1]) for o in llm.generate(prompts, params)]

    _, expected = generate(quant)
    served, got = generate({**quant, "transforms.compile_model.backend": "aoti"})
    assert type(served.module).__name__ == "PackagedModel"
    for want, have in zip(expected, got, strict=True):
        assert [t for t, _ in have] == [t for t, _ in want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(have, want)) < 1e-4
    # the embedding table was read into memory at load (no product reads a float32 weight), not mapped
    table = graph_tensors(served.module.general)["model.embed_tokens.weight"]
    assert not any(a <= table.data_ptr() < b for a, b in file_mapped_ranges())
    if native.library() is not None:
        if op == "int4_linear" and native.int4_pack_rows():
            op = "int4_packed_linear"  # pack_int4_weights: the layout this build's kernels read
        if op == "half_linear" and native.half_pack_width():
            op = "half_packed_linear"  # pack_half_weights, likewise
        wrapper = _package_source(served.module.decode.package_path)
        assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{op}(" in wrapper


@pytest.mark.slow
def test_a_package_runs_an_engine_steps_greedy_decode_forwards_in_one_call(tiny_checkpoint):
    """Where the native op library runs, a package is loaded by its DecodeLoop (decode_loop.h), which runs the
    greedy decode forwards of a multi-step engine step in one call: the tokens and finish reasons of one forward a
    step, across page boundaries (pages of 8 positions), with a stop token mid-way, a request that ends before the
    others, batch 3 and batch 1, and a time limit that ends each call after one forward."""
    if native.library() is None:
        pytest.skip("the native op library does not run here: packages are run one step a call by torch's loader")
    path = tiny_checkpoint("llama")
    llm = LLM(str(path), max_batch_size=4, max_seq_len=64, kv_cache_config={"page_size": 8},
              overrides={"transforms.compile_model.backend": "aoti"})
    module, scheduler = llm.module, llm.engine.scheduler
    assert type(module).__name__ == "PackagedModel" and module.greedy_steps is not None
    calls, greedy_steps = [], module.greedy_steps

    def counted(*args):
        rows = greedy_steps(*args)
        calls.append(rows.shape[0])
        return rows

    module.greedy_steps = counted

    def run(prompts, params, decode_steps, seconds=10.0):
        scheduler.decode_steps, scheduler.decode_seconds = decode_steps, seconds
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]

    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    tokens = run(PROMPTS, free, 1)[0][0]
    at = next(i for i in range(8, 30) if tokens[i] not in tokens[:i])  # the first time it samples this token
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[tokens[at]]), free,
              SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)]
    expected = run(PROMPTS, params, 1)
    expected_alone = run(PROMPTS[:1], free, 1)
    assert expected[0] == (tokens[: at + 1], "stop") and not calls
    for decode_steps, seconds in ((32, 10.0), (4, 10.0), (32, 0.0)):
        calls.clear()
        assert run(PROMPTS, params, decode_steps, seconds) == expected
        assert run(PROMPTS[:1], free, decode_steps, seconds) == expected_alone
        assert max(calls) == 1 if seconds == 0 else 1 < max(calls) <= decode_steps
    scheduler.interrupt = Interrupt()  # raised by another thread (a server): the C++ loop runs no forward
    scheduler.interrupt.set()
    calls.clear()
    assert run(PROMPTS, params, 32) == expected and calls and max(calls) == 0
