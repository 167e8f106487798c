"""The README's performance table in one command: ``autodeploy bench`` against HF (and llama.cpp) for each
weight precision, on this CPU's instruction set and on its AVX2 subset, one row per run.

Each row is one ``autodeploy bench --json --compare hf`` in a child process (isl 128, osl 64, median of
``--runs``), with the default configuration plus the row's ``quantize_weights`` settings. The AVX2 rows
set ``ATEN_CPU_CAPABILITY=avx2`` (torch's kernels, Inductor's generated code and the native kernels take
their AVX2 builds), ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (oneDNN's and MKL's
kernels), for both sides of the comparison: what an AVX2-only machine runs. ``--llamacpp`` adds a
``--compare llama.cpp`` run per row on each instruction set (needs ``llama-cpp-python``): on this CPU's with
the installed build, on the AVX2 subset with a build of llama-cpp-python for AVX2 only, installed into a
folder of its own and named by ``--llamacpp-avx2`` (it goes first on the child's ``PYTHONPATH``):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
                -DGGML_AVX512=OFF" pip install --no-deps --target /tmp/llamacpp-avx2 llama-cpp-python

    python benchmarks/cpu_matrix.py --model /tmp/llama-125m [--isa native avx2] [--rows fp32 fp32-b16 bf16
                                    int8 int4] [--runs 3] [--llamacpp [--llamacpp-avx2 DIR]]

Prints a Markdown table (and each run's JSON to stderr), naming the CPU and its instruction sets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

#: row name -> (batch size, extra --set arguments)
ROWS = {
    "fp32": (1, []),
    "fp32-b16": (16, []),
    "bf16": (1, ["transforms.quantize_weights.enabled=true", "transforms.quantize_weights.dtype=bf16"]),
    "int8": (1, ["transforms.quantize_weights.enabled=true"]),
    "int4": (1, ["transforms.quantize_weights.enabled=true", "transforms.quantize_weights.dtype=int4"]),
}
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def cpu_description() -> str:
    """The CPU model and the vector instruction sets it has (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith(("flags", "Features"))), []))
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "asimddp", "sve"]
    return f"{model} ({', '.join(f for f in wanted if f in flags)}; {os.cpu_count()} cores)"


def bench(model: str, batch: int, sets: list[str], compare: str, runs: int, env: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "autodeploy", "bench", "--model", model, "--batch-size", str(batch),
               "--isl", "128", "--osl", "64", "--runs", str(runs), "--num-threads", "2", "--compare", compare,
               "--json"]
    for item in sets:
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
    if result.returncode != 0:
        raise SystemExit(f"bench failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    figures = json.loads(result.stdout)
    print(json.dumps(figures), file=sys.stderr)
    return figures


def row_cells(name: str, isa: str, figures: dict, reference: str) -> str:
    ours, theirs, ratios = figures["autodeploy"], figures[reference], figures["ratios"]
    identical = figures.get("greedy_tokens_identical")
    return (f"| {isa} | {name} | {ours['output_tok_s']:.1f} / {theirs['output_tok_s']:.1f} | "
            f"**{ratios['output_tok_s']:.2f}x** | {ratios['decode_tok_s']:.2f}x | {ratios['ttft_s']:.2f}x | "
            f"{ours['peak_rss_bytes'] / 2**20:.0f} / {theirs['peak_rss_bytes'] / 2**20:.0f} MiB | "
            f"{ours['build_s']:.1f} s | {'yes' if identical else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--isa", nargs="*", default=["native", "avx2"], choices=["native", "avx2"],
                        help="the HF rows to run (none: only --llamacpp)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llamacpp", action="store_true", help="also compare with llama.cpp")
    parser.add_argument("--llamacpp-avx2", metavar="DIR",
                        help="a folder holding llama-cpp-python built for AVX2 only (for the AVX2 llama.cpp rows)")
    args = parser.parse_args()
    if args.llamacpp_avx2 and not (Path(args.llamacpp_avx2) / "llama_cpp").is_dir():
        raise SystemExit(f"--llamacpp-avx2 {args.llamacpp_avx2}: no llama_cpp package in that folder")
    print(f"CPU: {cpu_description()}\n")
    header = ("| instruction set | weights | output tok/s autodeploy / {ref} | output ratio | decode ratio | "
              "TTFT ratio | peak RSS autodeploy / {ref} | build | greedy tokens identical |")
    print(header.format(ref="HF") + "\n|---|---|---|---|---|---|---|---|---|")
    for isa in args.isa:
        env = AVX2_ENV if isa == "avx2" else {}
        label = "AVX2 builds" if isa == "avx2" else "this CPU's"
        for name in args.rows:
            batch, sets = ROWS[name]
            print(row_cells(name, label, bench(args.model, batch, sets, "hf", args.runs, env), "hf"), flush=True)
    if args.llamacpp:
        print("\n" + header.format(ref="llama.cpp") + "\n|---|---|---|---|---|---|---|---|---|")
        for isa in args.isa or ["native"]:
            if isa == "avx2" and not args.llamacpp_avx2:
                print("| AVX2 builds | (no --llamacpp-avx2: llama.cpp's AVX2 rows skipped) |||||||", flush=True)
                continue
            env = {} if isa == "native" else {
                **AVX2_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [args.llamacpp_avx2,
                                                                         os.environ.get("PYTHONPATH")]))}
            label = "AVX2 builds" if isa == "avx2" else "this CPU's"
            for name in args.rows:
                batch, sets = ROWS[name]
                figures = bench(args.model, batch, sets, "llama.cpp", args.runs, env)
                print(row_cells(f"{name} ({figures['llama.cpp']['gguf_type']})", label, figures, "llama.cpp"),
                      flush=True)


if __name__ == "__main__":
    main()
