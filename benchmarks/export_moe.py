"""Export time of a 64-expert MoE model with and without ``num_moe_experts_for_export``.

Builds a tiny random-weight Mixtral checkpoint (2 layers, hidden 64, 64 experts) in a temp dir,
runs the pipeline up to the export stage alternately with ``num_moe_experts_for_export`` unset
(trace every expert) and set to 2 (trace 2, expand the graph to 64 afterwards), and prints the
median ``export_to_gm`` time of each and the speed-up. It then checks that both graphs, once the
weights are loaded, compute the same logits as HF transformers.

    python benchmarks/export_moe.py [--experts 64] [--layers 2] [--reps 3] [--traced 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

import autodeploy  # noqa: E402
from autodeploy.transform import transform_history  # noqa: E402

KEY = "transforms.export_to_gm.num_moe_experts_for_export"


def build_checkpoint(path: Path, experts: int, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        num_local_experts=experts,
        num_experts_per_tok=2,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def export_seconds(path: Path, traced: int | None) -> tuple[float, float, int]:
    """(export_to_gm time from the transform history, wall time of optimize(until=export), nodes)."""
    overrides = {KEY: traced} if traced is not None else {}
    start = time.perf_counter()
    gm = autodeploy.optimize(path, until="export", overrides=overrides)
    wall = time.perf_counter() - start
    return transform_history(gm)["export_to_gm"].time_s, wall, len(gm.graph.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--traced", type=int, default=2)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp), args.experts, args.layers)
        print(
            f"Mixtral, {args.layers} layers, hidden 64, {args.experts} experts; "
            f"{args.reps} repetitions each, alternating; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads"
        )
        export_seconds(path, args.traced)  # warm-up: imports, first-call caches
        times: dict[str, list[tuple[float, float]]] = {"all experts": [], f"{args.traced} traced": []}
        nodes = {}
        for _ in range(args.reps):
            for label, traced in (("all experts", None), (f"{args.traced} traced", args.traced)):
                export_s, wall_s, nodes[label] = export_seconds(path, traced)
                times[label].append((export_s, wall_s))

        medians = {}
        print(f"{'mode':<14} {'export_to_gm median':>20} {'optimize(until=export)':>24} {'graph nodes':>12}")
        for label, samples in times.items():
            export_med = statistics.median(s[0] for s in samples)
            wall_med = statistics.median(s[1] for s in samples)
            medians[label] = export_med
            runs = ", ".join(f"{s[0]:.2f}" for s in samples)
            print(f"{label:<14} {export_med:>18.2f} s {wall_med:>22.2f} s {nodes[label]:>12}   (runs: {runs})")
        full, fast = medians.values()
        print(f"speed-up of export_to_gm: {full / fast:.1f}x")

        # numerics: both graphs (weights loaded) against HF transformers
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        full_gm = autodeploy.optimize(path, until="weight_load")
        fast_gm = autodeploy.optimize(path, until="weight_load", overrides={KEY: args.traced})
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, 128, (3, 9), generator=gen)
        position_ids = torch.arange(9).expand(3, 9)
        with torch.no_grad():
            expected = reference(input_ids=input_ids, position_ids=position_ids).logits
            full_logits = full_gm(input_ids, position_ids)[0]
            fast_logits = fast_gm(input_ids, position_ids)[0]
        diff_full = (full_logits - expected).abs().max().item()
        diff_fast = (fast_logits - expected).abs().max().item()
        diff_between = (fast_logits - full_logits).abs().max().item()
        print(
            f"max |logits - HF|: all experts {diff_full:.2e}, {args.traced} traced {diff_fast:.2e}; "
            f"between the two {diff_between:.2e}"
        )
        ok = diff_full <= 1e-4 and diff_fast <= 1e-4 and diff_between <= 1e-4
        print("logits agree" if ok else "LOGITS DISAGREE")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
