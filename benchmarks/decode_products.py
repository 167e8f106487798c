"""The products of one decode step at 1-16 rows: the native kernels against torch's, in one run.

Makes random weights of a Llama's linear layers (default: the 125M model of docs/performance.md, hidden 768,
intermediate 2048, 12 layers, 12 / 4 heads, vocab 32000: 49 products with q/k/v and gate/up fused, 400 MB
in float32), then for each row count times all of them in turn, as a decode step does (so the weights come
from memory, not the cache), with:

- ``F.linear`` on the float32 weights (the baseline);
- oneDNN with weights prepacked for that row count (what Inductor's freezing uses);
- ``auto_deploy::f32_linear`` (``native_linear``'s operator);
- ``auto_deploy::int8_gemv`` on int8 copies of the weights (``quantize_weights``' decode kernel);
- ``auto_deploy::f32_packed_linear`` on the weights packed in panels where the build reads them
  (``pack_f32_weights``: the default there);
- ``auto_deploy::half_linear`` on bfloat16 copies (and ``auto_deploy::half_packed_linear`` on those packed in
  panels where the build reads them) and ``auto_deploy::int4_linear`` on 4-bit copies (group 32), and
  ``auto_deploy::int4_packed_linear`` on those packed in tiles where the build reads them.

``--kernels AVX2`` runs another native build than this CPU's best (e.g. the AVX2 kernels on an AVX-512
machine); to make torch's own kernels (the baseline) run as on an AVX2-only machine too, set
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``.

The methods alternate repetition by repetition and each figure is the median, printed in ms per step and
as a speed-up over ``F.linear`` measured in the same run. Rows whose kernel does not run here are skipped.

    python benchmarks/decode_products.py [--rows 1 2 4 8 16] [--reps 7] [--threads 2] [--hidden 768]
                                         [--kernels AVX2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autodeploy.custom_ops import native  # noqa: E402
from autodeploy.custom_ops.int4_linear import pack_int4_tiles, quantize_int4  # noqa: E402
from autodeploy.custom_ops.linear import pack_f32_panels  # noqa: E402
from autodeploy.custom_ops.quant_linear import quantize_per_channel_int8  # noqa: E402


def layer_shapes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int):
    """[N, K] of a decode step's products: fused q/k/v, o, fused gate/up, down per layer; the LM head."""
    head_dim = hidden // heads
    per_layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
                 (2 * intermediate, hidden), (hidden, intermediate)]
    return per_layer * layers + [(vocab, hidden)]


def time_step(products, x_for) -> float:
    start = time.perf_counter()
    for product, k in products:
        product(x_for[k])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--kernels", default=None, help="the native build to run (default: this CPU's best)")
    args = parser.parse_args()
    with native.use_kernels(args.kernels) if args.kernels else contextlib.nullcontext():
        run(args)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = layer_shapes(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    quantized = [quantize_per_channel_int8(w) for w in weights]
    halves = [w.bfloat16() for w in weights]
    nibbles = [quantize_int4(w, 32) for w in weights]
    f32_panels = [(pack_f32_panels(w), w.shape[0]) for w in weights] if native.f32_pack_width() else []
    half_panels = [(pack_f32_panels(h), h.shape[0]) for h in halves] if native.half_pack_width() else []
    size = sum(w.numel() * w.element_size() for w in weights)
    print(f"{len(weights)} products, {size / 1e6:.0f} MB float32, {args.threads} threads, median of {args.reps}, "
          f"native kernels: {native.capability()}")

    has_f32, has_int8 = native.f32_linear_available(), native.int8_gemv_available()
    for rows in args.rows:
        x_for = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        methods = {
            "F.linear": [(lambda x, w=w: F.linear(x, w), w.shape[1]) for w in weights],
            "oneDNN prepacked": [(lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], ""),
                                  w.shape[1]) for w, p in zip(weights, packed)],
        }
        if has_f32:
            methods["f32_linear"] = [(lambda x, w=w: torch.ops.auto_deploy.f32_linear(x, w), w.shape[1])
                                     for w in weights]
            if native.f32_pack_width():  # the layout pack_f32_weights gives the kernels that read it
                methods["f32_packed_linear (panels)"] = [
                    (lambda x, p=p, n=n: torch.ops.auto_deploy.f32_packed_linear(x, p, n), p.shape[1])
                    for p, n in f32_panels]
        if has_int8:
            methods["int8_gemv (int8)"] = [(lambda x, q=q, s=s: torch.ops.auto_deploy.int8_gemv(x, q, s), q.shape[1])
                                           for q, s in quantized]
        if native.half_linear_available():
            methods["half_linear (bf16)"] = [(lambda x, w=w: torch.ops.auto_deploy.half_linear(x, w), w.shape[1])
                                             for w in halves]
            if native.half_pack_width():  # the layout pack_half_weights gives the kernels that read it
                methods["half_packed_linear (bf16, panels)"] = [
                    (lambda x, p=p, n=n: torch.ops.auto_deploy.half_packed_linear(x, p, n), p.shape[1])
                    for p, n in half_panels]
        if native.int4_linear_available():
            methods["int4_linear (int4)"] = [
                (lambda x, q=q, s=s: torch.ops.auto_deploy.int4_linear(x, q, s, 32), 2 * q.shape[1])
                for q, s in nibbles]
            if native.int4_pack_rows():  # the layout pack_int4_weights gives the kernels that read it
                tiles = [(*pack_int4_tiles(q, s, native.int4_pack_rows()), q.shape[0]) for q, s in nibbles]
                methods["int4_packed_linear (int4, tiles)"] = [
                    (lambda x, w=w, s=s, n=n: torch.ops.auto_deploy.int4_packed_linear(x, w, s, 32, n), 8 * w.shape[1])
                    for w, s, n in tiles]
        times: dict[str, list[float]] = {name: [] for name in methods}
        for products in methods.values():  # warm-up: first calls allocate and build
            time_step(products, x_for)
        for _ in range(args.reps):
            for name, products in methods.items():
                times[name].append(time_step(products, x_for))
        base = statistics.median(times["F.linear"])
        cells = []
        for name, samples in times.items():
            median = statistics.median(samples)
            cells.append(f"{name} {median * 1e3:.1f} ms ({base / median:.2f}x)")
        print(f"rows {rows:2d}: " + " | ".join(cells))
        del packed


if __name__ == "__main__":
    main()
