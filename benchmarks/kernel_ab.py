"""Two builds of the native kernels against each other in one process: a baseline ``kernels.cpp`` (another
commit's) as A, the working tree's as B.

The op library calls the kernels through a table that ``autodeploy_use_kernels`` switches, so both builds run the
same ops, the same graphs and the same served package, on the same machine at the same minute: the runs alternate
(A B, B A, ...), and each figure is the median, printed with B's speed-up over A and whether the two builds'
results are bitwise equal (``products``, ``attention``). The baseline must share the working tree's kernel table
(``kernels.h``): builds of commits whose table differs cannot be switched.

    git show HEAD~1:src/autodeploy/custom_ops/native/kernels.cpp > /tmp/base.cpp
    python benchmarks/kernel_ab.py --baseline /tmp/base.cpp products [--rows 1 16] [--dtype bfloat16|int8|int4]
    python benchmarks/kernel_ab.py --baseline /tmp/base.cpp attention [--seqs 16] [--context 160 1000]
    python benchmarks/kernel_ab.py --baseline /tmp/base.cpp engine --model /tmp/llama-125m [--batch 16]
                                   [--weights bf16]

``--isa AVX2`` runs the AVX2 builds (default: this CPU's best); to make torch's own kernels run as on an AVX2-only
machine too, set ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``.
``products``: the decode step's 49 products of the 125M Llama (``decode_products.py``'s shapes) on weights packed
in panels (``--dtype int8``: on int8 weights, ``int8_gemv``; ``--dtype int4``: on 4-bit weights in tiles,
``int4_packed_linear``); ``attention``: ``decode_attention`` over 12 layers' caches; ``engine``: one ``LLM``
(the default configuration), fresh random prompts every run, TTFT, total and the mean decode step.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

import torch  # noqa: E402
from decode_products import layer_shapes  # noqa: E402

from autodeploy.custom_ops import native  # noqa: E402
from autodeploy.custom_ops.int4_linear import pack_int4_tiles, quantize_int4  # noqa: E402
from autodeploy.custom_ops.linear import pack_f32_panels  # noqa: E402
from autodeploy.custom_ops.quant_linear import quantize_per_channel_int8  # noqa: E402


def baseline_table(source: Path, isa: str, keep: list) -> int:
    """The kernel table of ``source`` built for ``isa``, loaded from a copy of its own so that the two builds are
    two libraries."""
    # beside the working tree's kernels.h, which the source includes
    copy = native._KERNEL_SOURCE.with_name(f".kernel_ab_{os.getpid()}.cpp")
    copy.write_bytes(source.read_bytes())
    try:
        built = native.build_kernels(isa, copy, name=f"kernels-ab-{isa}")
    finally:
        copy.unlink()
    with tempfile.TemporaryDirectory() as scratch:
        loaded = Path(scratch) / "baseline.so"
        shutil.copy(built, loaded)
        library = ctypes.CDLL(str(loaded))
    keep.append(library)
    return native.kernel_table_address(library, isa)


def alternate(tables: dict[str, int], run, reps: int) -> dict[str, list]:
    """run() under each build's kernels, the builds alternating; every result by build."""
    lib = native.library()
    results: dict[str, list] = {name: [] for name in tables}
    names = list(tables)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            lib.autodeploy_use_kernels(tables[name])
            results[name].append(run())
    lib.autodeploy_use_kernels(tables["B"])
    return results


def timed(step):
    def run():
        start = time.perf_counter()
        step(keep=False)
        return time.perf_counter() - start
    return run


def kept_if(keep: bool, outputs) -> list:
    """Run a generator of outputs to its end, keeping them only when asked (each freed as it comes otherwise)."""
    return [y for y in outputs if keep]


def report(label: str, tables: dict[str, int], step, reps: int, skip: int = 2) -> None:
    """step(keep=False) timed under each build, alternating, then step(keep=True)'s results compared. The timed
    runs keep no results: 49 products' outputs alive at once (236 MB at 512 rows) made every run fault its
    memory in afresh, 1.6x slower than a decode step's products at 512 rows."""
    results = alternate(tables, timed(step), reps)
    a = statistics.median(results["A"][skip:])
    b = statistics.median(results["B"][skip:])
    kept = alternate(tables, lambda: step(keep=True), 1)
    equal = all(torch.equal(x, y) for x, y in zip(kept["A"][0], kept["B"][0]))
    print(f"{label}: A {a * 1e3:.2f} ms | B {b * 1e3:.2f} ms | B speed-up {a / b:.3f}x | "
          f"bitwise equal: {equal}", flush=True)


def products(args, tables) -> None:
    shapes = layer_shapes(768, 2048, 12, 12, 4, 32000)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    if args.dtype == "int8":  # quantize_weights' int8 layout and decode op
        layers = [(*quantize_per_channel_int8(w), w.shape[1]) for w in weights]
        def product(x_for, q, s, k):
            return torch.ops.auto_deploy.int8_gemv(x_for[k], q, s)
    elif args.dtype == "int4":  # group 32 (quantize_weights' default) in tiles, as pack_int4_weights leaves them
        layers = [(*pack_int4_tiles(*quantize_int4(w, 32), native.int4_pack_rows()), w.shape[0], w.shape[1])
                  for w in weights]
        def product(x_for, words, scales, n, k):
            return torch.ops.auto_deploy.int4_packed_linear(x_for[k], words, scales, 32, n)
    else:  # the weights packed in panels, as pack_f32_weights and pack_half_weights leave them
        dtype = getattr(torch, args.dtype)
        layers = [(pack_f32_panels(w.to(dtype)), w.shape[0]) for w in weights]
        op = (torch.ops.auto_deploy.f32_packed_linear if dtype == torch.float32
              else torch.ops.auto_deploy.half_packed_linear)
        def product(x_for, p, n):
            return op(x_for[p.shape[1]], p, n)
    for rows in args.rows:
        x_for = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        def step(keep: bool, x_for=x_for) -> list:
            return kept_if(keep, (product(x_for, *layer) for layer in layers))

        report(f"products, {args.dtype}, {rows} rows", tables, step, args.reps)


def attention(args, tables) -> None:
    gen = torch.Generator().manual_seed(0)
    head_dim, page_size, layers = 64, 64, 12
    for context in args.context:
        pages = -(-context // page_size)
        caches = [(torch.randn(args.seqs * pages, page_size, args.kv_heads, head_dim, generator=gen),
                   torch.randn(args.seqs * pages, page_size, args.kv_heads, head_dim, generator=gen))
                  for _ in range(layers)]
        table = torch.randperm(args.seqs * pages, generator=gen).view(args.seqs, pages)  # pages in no order
        positions = torch.full((args.seqs,), context - 1, dtype=torch.long)
        q = torch.randn(args.seqs, args.heads, head_dim, generator=gen)
        def step(keep: bool, q=q, positions=positions, table=table, caches=caches) -> list:
            return kept_if(keep, (torch.ops.auto_deploy.decode_attention(q, k, v, positions, table, head_dim ** -0.5, 0)
                                  for k, v in caches))

        report(f"decode attention, {args.seqs} sequences, {context} positions, {args.heads} / {args.kv_heads} heads",
               tables, step, args.reps)


def engine(args, tables) -> None:
    from autodeploy import LLM, SamplingParams
    from autodeploy.bench import _vocab_size, synthetic_prompts

    overrides = {"max_batch_size": args.batch, "max_seq_len": args.isl + args.osl}
    if args.weights != "fp32":
        overrides.update({"transforms.quantize_weights.enabled": True,
                          "transforms.quantize_weights.dtype": args.weights})
    llm = LLM(args.model, overrides=overrides)
    vocab = _vocab_size(args.model)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    seeds = iter(range(1, 1 << 30))

    def run():  # fresh prompts every run: the prefix cache serves none of them
        prompts = synthetic_prompts(args.batch, args.isl, vocab, seed=next(seeds))
        first: dict[int, float] = {}
        start = time.perf_counter()
        for i, _, _ in llm.generate_stream(prompts, params):
            first.setdefault(i, time.perf_counter() - start)
        total = time.perf_counter() - start
        ttft = max(first.values())
        return ttft, total, (total - ttft) / max(args.osl - 1, 1)

    results = alternate(tables, run, args.reps + 2)  # the first run of each warms up
    label = f"engine, batch {args.batch}, {args.weights}, isl {args.isl}, osl {args.osl}"
    for i, figure in enumerate(("TTFT", "total", "decode step")):
        a = statistics.median(r[i] for r in results["A"][1:])
        b = statistics.median(r[i] for r in results["B"][1:])
        print(f"{label}, {figure}: A {a * 1e3:.2f} ms | B {b * 1e3:.2f} ms | B speed-up {a / b:.3f}x", flush=True)
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the baseline's kernels.cpp (A)")
    parser.add_argument("--isa", default=None, help="the builds to compare (default: this CPU's best)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("products")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "int8", "int4"], default="float32")
    p = sub.add_parser("attention")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, nargs="+", default=[160])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p = sub.add_parser("engine")
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--weights", choices=["fp32", "bf16", "fp16", "int8", "int4"], default="fp32")
    args = parser.parse_args()
    if not args.baseline.is_file():
        raise SystemExit(f"--baseline {args.baseline}: no such file")
    torch.set_num_threads(args.threads)
    if native.library() is None:
        raise SystemExit("the native kernels do not run here")
    isa = args.isa or native.capability()
    if isa not in native.runnable_capabilities():
        raise SystemExit(f"--isa {isa}: this CPU runs {', '.join(native.runnable_capabilities())}")
    keep: list = []
    tables = {"A": baseline_table(args.baseline, isa, keep), "B": native._kernel_table(isa)}
    print(f"A: {args.baseline}, B: the working tree's kernels.cpp; {isa} builds, {args.threads} threads, "
          f"median of {args.reps}", flush=True)
    {"products": products, "attention": attention, "engine": engine}[args.what](args, tables)


if __name__ == "__main__":
    main()
