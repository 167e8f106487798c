"""Two engines' generations alternating in one process (A B, B A, ...), for the A/B benchmarks that compare two
builds or loads of one model (``env_ab.py``, ``huge_pages_ab.py``): fresh random prompts of one shape every run,
a first pair that warms up, and each figure's median with B's speed-up over A."""

from __future__ import annotations

import argparse
import statistics
import time

from autodeploy.bench import synthetic_prompts


def add_run_arguments(parser: argparse.ArgumentParser, reps: int) -> None:
    """The options every A/B of generations takes: the checkpoint, its weights, the batch and prompt shape, runs."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--weights", choices=["fp32", "bf16", "fp16", "int8", "int4"], default="fp32")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--reps", type=int, default=reps)


def llm_overrides(args: argparse.Namespace) -> dict:
    """The ``LLM`` overrides of those options: the batch and sequence limits, the weights' quantization."""
    overrides = {"max_batch_size": args.batch, "max_seq_len": args.isl + args.osl}
    if args.weights != "fp32":
        overrides.update({"transforms.quantize_weights.enabled": True,
                          "transforms.quantize_weights.dtype": args.weights})
    return overrides


def alternate_generations(engines: dict, params, batch: int, isl: int, vocab: int,
                          reps: int) -> dict[str, list[tuple[float, float, float]]]:
    """(TTFT, total, mean decode step) of ``reps`` generations of each of ``engines['A']`` and ``engines['B']``
    (anything with ``generate_stream``), the two alternating."""
    osl = params.max_tokens
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
    for rep in range(reps + 1):  # the first pair warms up
        for name in ("A", "B") if rep % 2 else ("B", "A"):
            prompts = synthetic_prompts(batch, isl, vocab, seed=1000 + 2 * rep + (name == "B"))
            start, first = time.perf_counter(), None
            for _ in engines[name].generate_stream(prompts, params):
                if first is None:
                    first = time.perf_counter() - start
            total = time.perf_counter() - start
            if rep:
                runs[name].append((first, total, (total - first) / max(osl - 1, 1)))
    return runs


def print_figures(label: str, runs: dict[str, list[tuple[float, float, float]]]) -> None:
    """Each figure's median for A and B, with B's speed-up over A."""
    for i, figure in enumerate(("TTFT", "total", "decode step")):
        a = statistics.median(r[i] for r in runs["A"])
        b = statistics.median(r[i] for r in runs["B"])
        print(f"{label}, {figure}: A {a * 1e3:.2f} ms | B {b * 1e3:.2f} ms | B speed-up {a / b:.3f}x")
