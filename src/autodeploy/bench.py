"""``autodeploy bench``: throughput of the built model, optionally against HF transformers in the same run.

    autodeploy bench --model PATH --batch-size B --isl I --osl O [--compare hf|llama.cpp] [--json] [--runs N]
                     [--gguf-type F32|F16|Q8_0|Q4_0] [--warm-page-cache] [--set k=v]...

``--runs`` measured runs (default 3) per side: B synthetic prompts of I random token ids (seeded), O output
tokens each with ``ignore_eos`` and greedy sampling, after one warm-up run of the same shape
(``--warmup-osl`` tokens). Every run, the warm-up too, has prompts of its own (the same on every side), so no
run finds its prompts in autodeploy's prefix cache: with one set of prompts for every run, each measured run
prefilled only the tokens past the pages the warm-up had cached, while HF and llama.cpp recompute every
prompt. With a comparison, the other side is built once autodeploy's build is done, and the two sides' runs
alternate (autodeploy, other; other, autodeploy; ...), so that both see the same machine: a shared machine's
speed drifts from second to second, and runs measured one side after the other carried that drift into the
ratios. The figures are those of each side's median run by total time (one run
is not representative; every run's total is listed in ``run_totals_s``). Figures (per side):

- ``build_s``: building the LLM (pipeline, weight load, cache, compile) / HF ``from_pretrained``;
- ``ttft_s``: time to first token (prefill of the whole batch: the last prompt's first token);
- ``prefill_tok_s``: B * I / ttft; ``decode_tok_s``: B * (O - 1) / (total - ttft);
- ``output_tok_s``: B * O / total;
- ``peak_rss_bytes``: peak resident memory of the process that ran that side (HF runs in a child process
  so that each side's peak is its own). Each side builds from a cold page cache: the checkpoint's files (the
  GGUF file for llama.cpp) are dropped from it just before (``--warm-page-cache``: left as found), since
  what a process maps on a fault depends on what the page cache holds, and one side's leftovers moved the
  other's peak by up to 90 MiB. Where autodeploy built in a child process and serves its package (the
  ``aoti`` backend), that process's peak is ``build_process_peak_rss_bytes``, reported beside it;
- ``weight_bytes`` and ``weight_bw_gb_s``: model bytes x decode steps per second (every decode step reads
  every weight once), in GB/s (1e9).
- ``prefix_cache_hit_tokens`` (autodeploy): prompt tokens the runs took from the prefix cache (0: every run
  prefilled its whole prompts).

With ``--compare hf`` the same figures for ``AutoModelForCausalLM.from_pretrained(...).generate(
do_sample=False, min_new_tokens=O, max_new_tokens=O)`` on the same prompts, plus ``ratios`` (autodeploy /
HF; for ``ttft_s``, ``build_s`` and ``peak_rss_bytes`` lower is better, so the ratio is HF / autodeploy,
>1 meaning autodeploy is better everywhere) and ``greedy_tokens_identical`` (over every measured run).

With ``--compare llama.cpp`` (needs ``llama-cpp-python`` and ``gguf``: ``pip install 'autodeploy[llamacpp]'``)
the checkpoint is written once as GGUF (:mod:`autodeploy.gguf_export`, in a child process, cached under
``$XDG_CACHE_HOME/autodeploy/gguf``) in the precision class of the run (fp32 -> F32, bf16/fp16 weights or
dtype -> F16, int8 -> Q8_0, int4 -> Q4_0; ``--gguf-type`` overrides) and run by ``llama_cpp.Llama`` (the
bench's threads, in a child process) on the same prompt token ids, greedy (argmax of the logits), the same
number of runs. llama-cpp-python serves one sequence at a time, so at batch > 1 the sequences run one after
another: its ``ttft_s`` is then the sum of the B prompt evaluations and ``total_s`` the sum of the B
sequences (``"sequential": true``), i.e. the throughput of serving the batch one by one. ``build_s`` is the
model load (the GGUF write, when not cached, is ``gguf_write_s``); ``weight_bytes`` the GGUF file's size.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .errors import AutoDeployError
from .utils.fx import text_config
from .utils.memory import drop_cached_pages, peak_rss_bytes

#: figures where lower is better (ratio reported as hf / autodeploy)
_LOWER_IS_BETTER = ("ttft_s", "build_s", "peak_rss_bytes")
_RATIO_KEYS = ("prefill_tok_s", "decode_tok_s", "output_tok_s", "ttft_s", "build_s", "peak_rss_bytes")


@dataclass
class BenchArgs:
    model: str
    batch_size: int
    isl: int
    osl: int
    seed: int = 0
    warmup_osl: int = 4
    runs: int = 3
    yaml_extra: Sequence[str] = ()
    overrides: Mapping[str, Any] | None = None
    cold_page_cache: bool = True  # each side builds from a cold page cache (see drop_cached_pages)

    def validate(self) -> None:
        for name in ("batch_size", "isl", "osl", "runs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise AutoDeployError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.warmup_osl < 0:
            raise AutoDeployError(f"--warmup-osl must be >= 0, got {self.warmup_osl}")
        if not self.model:
            raise AutoDeployError("no model given: pass --model PATH (a checkpoint folder)")
        if not (Path(self.model) / "config.json").is_file():
            raise AutoDeployError(f"--model {self.model}: not a checkpoint folder (no config.json)")


def checkpoint_files(model: str) -> list[Path]:
    """The weight files of the checkpoint folder ``model`` (its safetensors shards)."""
    from .models.hf import HFCheckpointFactory

    return HFCheckpointFactory(model).checkpoint_files()


def _vocab_size(model: str) -> int:
    from transformers import AutoConfig

    return int(text_config(AutoConfig.from_pretrained(model)).vocab_size)


def synthetic_prompts(batch_size: int, isl: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, isl), generator=gen).tolist()


def run_prompts(batch_size: int, isl: int, vocab_size: int, seed: int, runs: int) -> list[list[list[int]]]:
    """The prompts of the warm-up run (first) and of each measured run: a set of its own for each, so that no
    run is served from the prefix cache another run filled."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (runs + 1, batch_size, isl), generator=gen).tolist()


def _figures(batch: int, isl: int, osl: int, ttft: float, total: float, build_s: float, weight_bytes: int,
             peak_rss: int, run_totals: list[float]) -> dict[str, Any]:
    decode_s = max(total - ttft, 1e-9)
    steps_per_s = (osl - 1) / decode_s if osl > 1 else 0.0
    return {
        "build_s": build_s,
        "ttft_s": ttft,
        "prefill_tok_s": batch * isl / ttft,
        "decode_tok_s": batch * (osl - 1) / decode_s if osl > 1 else None,
        "output_tok_s": batch * osl / total,
        "total_s": total,
        "peak_rss_bytes": peak_rss,
        "weight_bytes": weight_bytes,
        "weight_bw_gb_s": weight_bytes * steps_per_s / 1e9 if osl > 1 else None,
        "run_totals_s": run_totals,
    }


def _module_weight_bytes(mod: torch.nn.Module, skip_prefix: str | None = None) -> int:
    """Bytes of the distinct parameters and buffers (KV caches excluded by name)."""
    seen, total = set(), 0
    for name, t in list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False)):
        if "kv_cache" in name or t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# -- the sides: each builds its model, then runs the prompts on command ------------------------------------
# A side has ``build_s``, ``run(osl) -> (ttft, total, tokens)`` and ``finish() -> dict`` (``weight_bytes``,
# ``peak_rss_bytes`` and its own extras), and frees its model in ``finish`` (or in ``abort``, after an error).
class _AutodeploySide:
    def __init__(self, args: BenchArgs):
        from .llm import LLM

        overrides = dict(args.overrides or {})
        overrides.setdefault("max_batch_size", max(args.batch_size, 1))
        overrides.setdefault("max_seq_len", args.isl + args.osl)
        if args.cold_page_cache:
            drop_cached_pages(checkpoint_files(args.model))
        start = time.perf_counter()
        try:
            self.llm = LLM(args.model, yaml_extra=list(args.yaml_extra), overrides=overrides)
        except ValueError as exc:
            raise AutoDeployError(str(exc)) from None
        self.build_s = time.perf_counter() - start
        self.prefix_cache_hit_tokens = 0

    def run(self, osl: int, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
        from .runtime.sampler import SamplingParams

        params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
        tokens: list[list[int]] = [[] for _ in prompts]
        first: dict[int, float] = {}
        pool = self.llm.engine.scheduler.pool
        hits_before = getattr(pool, "hit_tokens", 0)
        t0 = time.perf_counter()
        for i, token, _ in self.llm.generate_stream(prompts, params):
            if i not in first:
                first[i] = time.perf_counter() - t0
            tokens[i].append(token)
        elapsed = time.perf_counter() - t0
        self.prefix_cache_hit_tokens += getattr(pool, "hit_tokens", 0) - hits_before
        return max(first.values()), elapsed, tokens

    def finish(self) -> dict[str, Any]:
        info = {"weight_bytes": _module_weight_bytes(self.llm.module), "peak_rss_bytes": peak_rss_bytes(),
                "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens}
        if self.llm.build_peak_rss_bytes is not None:  # built in a child process, served from its package
            info["build_process_peak_rss_bytes"] = self.llm.build_peak_rss_bytes
        self.llm.close()
        if len(self.llm.rank_peak_rss_bytes) > 1:  # world_size > 1: every rank's peak, rank 0 first
            ranks = self.llm.rank_peak_rss_bytes
            info["peak_rss_bytes_per_rank"] = [ranks[r] for r in sorted(ranks)]
        return info

    def abort(self) -> None:
        self.llm.close()


class _ChildSide:
    """A side built and run in a child process (so that its peak memory is its own), one command at a time:
    ``factory(*factory_args)`` makes the side there."""

    def __init__(self, name: str, factory: Callable[..., Any], *factory_args: Any):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve_side, args=(child_conn, factory, factory_args), daemon=True)
        self._process.start()
        child_conn.close()
        self.build_s = self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._process.join()
            raise AutoDeployError(f"the {self.name} side's process ended unexpectedly "
                                  f"(exit code {self._process.exitcode})") from None
        if status != "ok":
            self._process.join()
            raise AutoDeployError(f"the {self.name} side failed: {value}")
        return value

    def run(self, osl: int, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
        self._conn.send(("run", (osl, prompts)))
        return self._reply()

    def finish(self) -> dict[str, Any]:
        self._conn.send(("finish", None))
        info = self._reply()
        self._process.join()
        return info

    def abort(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join()


def _serve_side(conn, factory: Callable[..., Any], factory_args: tuple) -> None:
    """The child process of a :class:`_ChildSide`: build the side, then answer ``run`` and ``finish``."""
    try:
        side = factory(*factory_args)
        conn.send(("ok", side.build_s))
        while True:
            command, value = conn.recv()
            if command == "run":
                conn.send(("ok", side.run(*value)))
            else:
                conn.send(("ok", side.finish()))
                return
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it with the side's name
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


#: a run's (time to first token, total time, tokens per prompt)
Run = tuple[float, float, list[list[int]]]


def _measure(sides: list[Any], osl: int, warmup_osl: int, prompts: list[list[list[int]]]) -> list[list[Run]]:
    """One warm-up run per side on ``prompts[0]``, then a run of each on each later set of prompts, the sides
    alternating (A B, B A, A B, ...) so that every side sees the same machine: a shared machine's speed drifts
    over seconds, and runs measured one side after the other would carry that drift into the ratios. Every
    measured run of every side, in order."""
    if warmup_osl:
        for side in sides:
            side.run(min(warmup_osl, osl), prompts[0])
    results: list[list[Run]] = [[] for _ in sides]
    for i, run_prompts_ in enumerate(prompts[1:]):
        order = range(len(sides)) if i % 2 == 0 else reversed(range(len(sides)))
        for k in order:
            results[k].append(sides[k].run(osl, run_prompts_))
    return results


def _side_figures(batch: int, isl: int, osl: int, side: Any, runs: list[Run], info: dict[str, Any]) -> dict[str, Any]:
    """A side's figures from its median run (by total; the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r[1])
    ttft, total, _ = ordered[(len(ordered) - 1) // 2]
    figures = _figures(batch, isl, osl, ttft, total, side.build_s, info["weight_bytes"], info["peak_rss_bytes"],
                       [r[1] for r in ordered])
    figures.update(info)  # the side's extras (peak per rank, prefix-cache hits)
    return figures


# -- HF transformers (run in a child process) ----------------------------------------------------------
class _TimingStreamer:
    """HF streamer: ``put`` gets the prompt first, then each step's new tokens."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        self.times.append(time.perf_counter())


class _HFSide:
    def __init__(self, model: str, dtype: str | None, num_threads: int, device: str = "cpu",
                 cold_page_cache: bool = True):
        torch.set_num_threads(num_threads)
        from transformers import AutoModelForCausalLM

        if cold_page_cache:
            drop_cached_pages(checkpoint_files(model))

        torch_dtype = getattr(torch, dtype) if dtype and dtype != "auto" else "auto"
        start = time.perf_counter()
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval().to(device)
        self.build_s = time.perf_counter() - start
        self.device = device
        pad = self.hf.generation_config.pad_token_id
        if pad is None:
            eos = self.hf.generation_config.eos_token_id
            pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        self.pad = pad

    def run(self, osl: int, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
        input_ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        streamer = _TimingStreamer()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   min_new_tokens=osl, max_new_tokens=osl, pad_token_id=self.pad, streamer=streamer)
        total = time.perf_counter() - t0
        ttft = streamer.times[1] - t0 if len(streamer.times) > 1 else total
        return ttft, total, out[:, input_ids.shape[1]:].tolist()

    def finish(self) -> dict[str, Any]:
        return {"weight_bytes": _module_weight_bytes(self.hf), "peak_rss_bytes": peak_rss_bytes()}


# -- llama.cpp (llama-cpp-python, run in a child process) -----------------------------------------------
LLAMACPP = "llama.cpp"
LLAMACPP_INSTALL = ("pip install llama-cpp-python gguf  (or: pip install 'autodeploy[llamacpp]'; llama-cpp-python "
                    "builds llama.cpp from source, which needs cmake and a C++ compiler)")


def check_llamacpp() -> None:
    """Raise a clear error when ``--compare llama.cpp``'s optional packages are missing."""
    import importlib.util

    missing = [pkg for mod, pkg in (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise AutoDeployError(f"--compare llama.cpp needs the {' and '.join(repr(m) for m in missing)} "
                              f"package{'s' if len(missing) > 1 else ''}, not installed: {LLAMACPP_INSTALL}")


def gguf_type_for(args: BenchArgs, override: str | None = None) -> str:
    """The GGUF type of the run's precision class: int8 weights -> Q8_0, int4 -> Q4_0, bf16/fp16 weights or
    dtype (or a 16-bit checkpoint under dtype auto) -> F16, fp32 -> F32; ``override`` (``--gguf-type``) wins."""
    from .gguf_export import GGUF_TYPES

    if override:
        if override.upper() not in GGUF_TYPES:
            raise AutoDeployError(f"--gguf-type {override!r}: expected one of {', '.join(GGUF_TYPES)}")
        return override.upper()
    from .config import load_config

    try:
        config = load_config(list(args.yaml_extra), dict(args.overrides or {}), base={"model": args.model})
    except ValueError as exc:
        raise AutoDeployError(str(exc)) from None
    quant = config.transforms.get("quantize_weights") or {}
    if quant.get("enabled"):
        dtype = str(quant.get("dtype", "int8")).lower()
        by_dtype = {"int8": "Q8_0", "int4": "Q4_0", "bf16": "F16", "bfloat16": "F16", "fp16": "F16",
                    "float16": "F16"}
        if dtype not in by_dtype:
            raise AutoDeployError(f"quantize_weights.dtype {dtype!r} has no GGUF counterpart: pass --gguf-type")
        return by_dtype[dtype]
    dtype = config.dtype
    if dtype == "auto":
        raw = json.loads((Path(args.model) / "config.json").read_text())
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    return "F16" if dtype in ("bfloat16", "float16") else "F32"


def llamacpp_last_logits(llm):
    """The logits of the last position a ``llama_cpp.Llama`` evaluated, read from llama.cpp's context (a
    numpy view; with ``logits_all=False`` llama-cpp-python keeps no copy in ``Llama.scores``)."""
    import llama_cpp
    import numpy as np

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def _cached_gguf_in_child(model: str, gguf_type: str, gguf_dir: str | None) -> tuple[Path, float | None]:
    """:func:`~autodeploy.gguf_export.cached_gguf`, its writing in a child process: the writer maps the whole
    checkpoint, and in this process those pages would count in the autodeploy side's peak RSS (the fp32 125M
    Llama's: 803 MiB with the file written here, 766 with it written by a child, 721 with it cached)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from .gguf_export import cached_gguf, gguf_cache_path

    path = gguf_cache_path(model, gguf_type, gguf_dir)
    if path.is_file():
        return path, None
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(cached_gguf, model, gguf_type, gguf_dir).result()
        except BrokenProcessPool:
            raise AutoDeployError(f"writing {path} as GGUF {gguf_type}: the writer's process ended unexpectedly "
                                  f"(out of memory?)") from None


class _LlamaCppSide:
    def __init__(self, gguf_path: str, isl: int, osl: int, num_threads: int):
        from llama_cpp import Llama

        n_batch = max(512, isl)  # the whole prompt in one batch
        start = time.perf_counter()
        self.llm = Llama(model_path=gguf_path, n_threads=num_threads, n_threads_batch=num_threads,
                         n_ctx=isl + osl + 1, n_batch=n_batch, n_ubatch=n_batch, n_gpu_layers=0, logits_all=False,
                         verbose=False)
        self.build_s = time.perf_counter() - start
        self.gguf_path = gguf_path

    def _next_token(self) -> int:  # greedy: the argmax of the last evaluated position's logits
        import numpy as np

        return int(np.argmax(llamacpp_last_logits(self.llm)))

    def _one_sequence(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        tokens = [self._next_token()]
        ttft = time.perf_counter() - t0
        while len(tokens) < n:
            self.llm.eval([tokens[-1]])
            tokens.append(self._next_token())
        return ttft, time.perf_counter() - t0, tokens

    def run(self, osl: int, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
        results = [self._one_sequence(p, osl) for p in prompts]  # the sequences one after another
        return sum(r[0] for r in results), sum(r[1] for r in results), [r[2] for r in results]

    def finish(self) -> dict[str, Any]:
        info = {"weight_bytes": Path(self.gguf_path).stat().st_size, "peak_rss_bytes": peak_rss_bytes()}
        if hasattr(self.llm, "close"):  # frees the model and context now (older llama-cpp-python: at exit)
            self.llm.close()
        return info


# -- the command ---------------------------------------------------------------------------------------
def run_bench(args: BenchArgs, compare: str | None = None, gguf_type: str | None = None,
              gguf_dir: str | None = None) -> dict[str, Any]:
    """All figures as one dict: ``config``, ``autodeploy``, and with ``compare='hf'``: ``hf``, ``ratios``,
    ``greedy_tokens_identical``; with ``compare='llama.cpp'``: ``llama.cpp`` (and its ``gguf_type``,
    ``gguf_path``, ``sequential``), ``ratios``, ``greedy_tokens_identical``."""
    args.validate()
    if compare not in (None, "hf", LLAMACPP):
        raise AutoDeployError(f"--compare {compare!r}: expected 'hf' or 'llama.cpp'")
    if compare == LLAMACPP:  # before the autodeploy side runs: a missing package fails at once
        from .gguf_export import read_config

        check_llamacpp()
        read_config(args.model)  # an architecture the GGUF writer does not support fails here too
        gguf_type = gguf_type_for(args, gguf_type)
    prompts = run_prompts(args.batch_size, args.isl, _vocab_size(args.model), args.seed, args.runs)
    result: dict[str, Any] = {
        "config": {"model": args.model, "batch_size": args.batch_size, "isl": args.isl, "osl": args.osl,
                   "runs": args.runs, "seed": args.seed, "num_threads": torch.get_num_threads(),
                   "overrides": dict(args.overrides or {}), "yaml_extra": list(args.yaml_extra),
                   "page_cache": "cold" if args.cold_page_cache else "as found"},
    }
    sides: list[Any] = [_AutodeploySide(args)]
    try:
        if compare == "hf":
            overrides = args.overrides or {}
            sides.append(_ChildSide("HF", _HFSide, args.model, overrides.get("dtype"), torch.get_num_threads(),
                                    str(overrides.get("device", "cpu")), args.cold_page_cache))
        elif compare == LLAMACPP:
            path, write_s = _cached_gguf_in_child(args.model, gguf_type, gguf_dir)
            if args.cold_page_cache:
                drop_cached_pages([path])
            sides.append(_ChildSide("llama.cpp", _LlamaCppSide, str(path), args.isl, args.osl,
                                    torch.get_num_threads()))
        runs = _measure(sides, args.osl, args.warmup_osl, prompts)
    except BaseException:
        for side in sides:
            side.abort()
        raise
    infos = [side.finish() for side in sides]
    ad = _side_figures(args.batch_size, args.isl, args.osl, sides[0], runs[0], infos[0])
    result["autodeploy"] = ad
    if compare is None:
        return result
    ref = _side_figures(args.batch_size, args.isl, args.osl, sides[1], runs[1], infos[1])
    if compare == LLAMACPP:
        ref.update(gguf_type=gguf_type, gguf_path=str(path), gguf_write_s=write_s, sequential=args.batch_size > 1)
    result["hf" if compare == "hf" else LLAMACPP] = ref
    result["ratios"] = _ratios(ad, ref)
    # every measured run's sequences, in order (each run has prompts of its own)
    ad_tokens = [seq for run in runs[0] for seq in run[2]]
    ref_tokens = [seq for run in runs[1] for seq in run[2]]
    result["greedy_tokens_identical"] = ad_tokens == ref_tokens
    if compare == LLAMACPP:
        result["greedy_matching_prefix"] = _matching_prefix(ad_tokens, ref_tokens)
    return result


def _ratios(ad: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    return {k: (ref[k] / ad[k] if k in _LOWER_IS_BETTER else ad[k] / ref[k])
            for k in _RATIO_KEYS if ad.get(k) and ref.get(k)}


def _matching_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over sequences of the fraction of output tokens before the first difference (1.0: identical)."""
    fractions = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fractions.append(n / max(len(x), len(y), 1))
    return sum(fractions) / max(len(fractions), 1)


def _fmt(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key.endswith("bytes"):
        return f"{value / 2**20:.1f} MiB"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"model {cfg['model']}  batch {cfg['batch_size']}  isl {cfg['isl']}  osl {cfg['osl']}  "
             f"threads {cfg['num_threads']}  median of {cfg['runs']} run(s)"]
    sides = [s for s in ("autodeploy", "hf", LLAMACPP) if s in result]
    ref = sides[-1] if len(sides) > 1 else None
    header = f"{'figure':<16}" + "".join(f"{s:>14}" for s in sides) + (f"{'ratio':>10}" if "ratios" in result else "")
    lines.append(header)
    for key in ("build_s", "ttft_s", "prefill_tok_s", "decode_tok_s", "output_tok_s", "total_s",
                "peak_rss_bytes", "weight_bytes", "weight_bw_gb_s"):
        row = f"{key:<16}" + "".join(f"{_fmt(result[s].get(key), key):>14}" for s in sides)
        if "ratios" in result:
            ratio = result["ratios"].get(key)
            row += f"{ratio:>9.2f}x" if ratio is not None else f"{'':>10}"
        lines.append(row)
    build_peak = result.get("autodeploy", {}).get("build_process_peak_rss_bytes")
    if build_peak:
        lines.append(f"autodeploy built in a child process (peak RSS {_fmt(build_peak, 'peak_rss_bytes').strip()}, "
                     "not in the figure above) and serves its package")
    per_rank = result.get("autodeploy", {}).get("peak_rss_bytes_per_rank")
    if per_rank:
        lines.append("peak RSS per rank: " + ", ".join(_fmt(b, "peak_rss_bytes").strip() for b in per_rank))
    if ref == LLAMACPP:
        info = result[LLAMACPP]
        lines.append(f"llama.cpp: GGUF {info['gguf_type']} {info['gguf_path']}"
                     + (f" (written in {info['gguf_write_s']:.1f} s)" if info.get("gguf_write_s") else " (cached)"))
        if info.get("sequential"):
            lines.append(f"llama.cpp: llama-cpp-python serves one sequence at a time: the {cfg['batch_size']} "
                         "sequences ran one after another (its ttft_s and total_s are sums over them)")
    if "ratios" in result:
        lines.append(f"ratios: autodeploy/{ref} for throughput, {ref}/autodeploy for times and memory "
                     "(>1: autodeploy better)")
        lines.append(f"greedy tokens identical: {result['greedy_tokens_identical']}")
        if "greedy_matching_prefix" in result:
            lines.append(f"greedy tokens matching before the first difference: {result['greedy_matching_prefix']:.0%}")
    return "\n".join(lines)


def main_bench(args, overrides: Mapping[str, Any]) -> int:
    bargs = BenchArgs(model=args.model, batch_size=args.batch_size, isl=args.isl, osl=args.osl, seed=args.seed,
                      warmup_osl=args.warmup_osl, runs=args.runs, yaml_extra=args.yaml_extra, overrides=overrides,
                      cold_page_cache=not args.warm_page_cache)
    result = run_bench(bargs, args.compare, getattr(args, "gguf_type", None), getattr(args, "gguf_dir", None))
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return 0
