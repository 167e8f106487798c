"""Load on `autodeploy serve` over loopback: throughput and latency, in one run.

Starts `autodeploy serve` in a child process (prefix caching on), then streams completions from asyncio
clients (random token-id prompts, greedy, ``ignore_eos``: every request makes exactly ``--osl`` tokens):

1. ``--requests`` requests, one client at a time (the baseline);
2. as many requests from ``--concurrency`` concurrent clients (continuous batching);
3. the time to first token of a request whose prompt shares a ``--prefix-len``-token prefix with the
   request before it, against a second server started with ``--no-prefix-caching``.

Prints requests/s, output tok/s, TTFT and inter-token latency p50/p99 for 1 and 2, the throughput ratio
2 / 1, and the TTFT ratio (caching off / on), with the CPU's name. The warm-up, 1 and 2 have prompts of their
own: a prompt sent again would be served from the prefix cache (its pages computed before) and flatter
the figures of 2.

    python benchmarks/serve_load.py --model /tmp/llama-125m [--requests 32] [--concurrency 16]
        [--isl 128] [--osl 32] [--prefix-len 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown CPU"


def start_server(args, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "autodeploy.cli", "serve", "--port", "0", "--max-batch-size",
           str(args.concurrency), "--max-seq-len", str(args.max_seq_len), *extra]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "AUTO_DEPLOY_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if " on " not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split(" on ")[1].split()[0]


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of each token (seconds since the request was sent)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    start, times = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:  # a checkpoint without a tokenizer streams a chunk per token, text ""
                    times.append(time.perf_counter() - start)
    return times


async def run_load(url: str, prompts: list[list[int]], osl: int, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p):
            async with gate:
                return await stream_one(client, url, p, osl)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
    ttft = [t[0] for t in results]
    itl = [b - a for t in results for a, b in zip(t, t[1:])]
    tokens = sum(len(t) for t in results)

    def pct(xs, q):
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]

    return {"requests_per_s": len(prompts) / elapsed, "output_tok_s": tokens / elapsed, "total_s": elapsed,
            "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3}


async def prefix_ttft(url: str, prefixes: list[list[int]], vocab: int, rng: random.Random) -> list[float]:
    """TTFT of a request right after another with the same prefix (different 16-token suffixes)."""
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for prefix in prefixes:
            await stream_one(client, url, prefix + [rng.randrange(vocab) for _ in range(16)], 1)
            out.append((await stream_one(client, url, prefix + [rng.randrange(vocab) for _ in range(16)], 1))[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--prefix-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.max_seq_len = max(args.isl + args.osl, args.prefix_len + 32)
    from autodeploy.models.demo import demo_model_path

    with open(os.path.join(args.model or demo_model_path(), "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    warmup, prompts, concurrent = ([[rng.randrange(vocab) for _ in range(args.isl)] for _ in range(count)]
                                   for count in (2, args.requests, args.requests))
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.prefix_reps)]

    print(f"CPU: {cpu_name()}; model: {args.model or 'demo'}; isl {args.isl}, osl {args.osl}, "
          f"{args.requests} requests, threads {args.threads}")
    proc, url = start_server(args)
    try:
        asyncio.run(run_load(url, warmup, 2, 1))
        one = asyncio.run(run_load(url, prompts, args.osl, 1))
        many = asyncio.run(run_load(url, concurrent, args.osl, args.concurrency))
        ttft_on = asyncio.run(prefix_ttft(url, prefixes, vocab, rng))
    finally:
        stop_server(proc)
    proc, url = start_server(args, "--no-prefix-caching")
    try:
        asyncio.run(run_load(url, warmup, 2, 1))
        ttft_off = asyncio.run(prefix_ttft(url, prefixes, vocab, random.Random(1)))
    finally:
        stop_server(proc)

    keys = list(one)
    print(f"{'clients':>8} " + " ".join(f"{k:>15}" for k in keys))
    for name, row in (("1", one), (str(args.concurrency), many)):
        print(f"{name:>8} " + " ".join(f"{row[k]:>15.2f}" for k in keys))
    print(f"throughput ratio {args.concurrency} clients / 1 client: "
          f"{many['output_tok_s'] / one['output_tok_s']:.2f}x output tok/s")
    on, off = statistics.median(ttft_on), statistics.median(ttft_off)
    print(f"TTFT with a shared {args.prefix_len}-token prefix: prefix caching on {on * 1e3:.1f} ms, off "
          f"{off * 1e3:.1f} ms (median of {args.prefix_reps}): {off / on:.2f}x lower with caching")


if __name__ == "__main__":
    main()
