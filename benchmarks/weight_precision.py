"""Accuracy and speed of weight-only int8 (``quantize_weights``) against the fp32 model, in one run.

Builds the model twice from the same checkpoint (fp32, and with ``quantize_weights`` enabled), then:

- logits of ``--batch`` seeded random prompts of ``--isl`` tokens (every position): max and mean absolute
  error against fp32, the error relative to the fp32 logits' standard deviation, and top-1 agreement;
- greedy generation of ``--osl`` tokens from the same prompts: the fraction of sequences whose tokens are
  identical and the mean number of leading tokens that agree;
- decode speed: median time of one batch-1 decode step of each (alternating, ``--reps`` rounds), and the
  ratio;
- weight bytes of each.

    python benchmarks/weight_precision.py --model PATH [--batch 4] [--isl 128] [--osl 32] [--threads N]

A random-weight checkpoint has nearly flat logits, so its top-1 agreement understates what a trained model
keeps; the error relative to the logits' spread is the comparable figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from autodeploy import LLM, SamplingParams  # noqa: E402
from autodeploy.bench import _module_weight_bytes, _vocab_size, synthetic_prompts  # noqa: E402
from autodeploy.runtime.sequence_info import SequenceRequest  # noqa: E402

QUANTIZE = {"transforms.quantize_weights.enabled": True}


def _pages(engine, prompt_len: int, index: int) -> list[int]:
    per_seq = engine.info.pages_needed(engine.max_seq_len)
    return list(range(index * per_seq, (index + 1) * per_seq))


def prompt_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    engine = llm.engine
    seqs = [SequenceRequest(p, 0, _pages(engine, len(p), i)) for i, p in enumerate(prompts)]
    batch = engine.info.build(seqs, gather="all")
    with torch.inference_mode():
        return llm.module(*batch.as_args())[0][0].float()


def decode_step_s(llm: LLM, context: int, reps: int = 20) -> float:
    engine = llm.engine
    args = engine.info.build([SequenceRequest([1], context, _pages(engine, context + 1, 0))], gather="last").as_args()
    with torch.inference_mode():
        for _ in range(3):
            llm.module(*args)
        start = time.perf_counter()
        for _ in range(reps):
            llm.module(*args)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = synthetic_prompts(args.batch, args.isl, _vocab_size(args.model))
    limits = {"max_batch_size": args.batch, "max_seq_len": args.isl + args.osl}
    models = {"fp32": LLM(args.model, overrides=limits), "int8": LLM(args.model, overrides={**limits, **QUANTIZE})}

    ref, quant = (prompt_logits(models[k], prompts) for k in ("fp32", "int8"))
    err = (quant - ref).abs()
    print(f"logits over {ref.shape[0]} positions: max abs err {err.max():.4g}, mean abs err {err.mean():.4g}, "
          f"mean err / fp32 logit std {err.mean() / ref.std():.4g}, "
          f"top-1 agreement {(quant.argmax(-1) == ref.argmax(-1)).float().mean():.4f}")

    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    ref_tokens, quant_tokens = ([o.outputs[0].token_ids for o in models[k].generate(prompts, params)]
                                for k in ("fp32", "int8"))
    same = sum(a == b for a, b in zip(ref_tokens, quant_tokens))
    lead = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref_tokens, quant_tokens)]
    print(f"greedy {args.osl} tokens: {same}/{len(prompts)} sequences identical, "
          f"mean agreeing prefix {statistics.mean(lead):.1f} tokens")

    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.reps):
        for name, llm in models.items():
            times[name].append(decode_step_s(llm, args.isl))
    step = {k: statistics.median(v) for k, v in times.items()}
    weight = {k: _module_weight_bytes(m.module) for k, m in models.items()}
    for name in models:
        print(f"{name}: decode step (batch 1) {step[name] * 1e3:.2f} ms, weights {weight[name] / 2**20:.1f} MiB")
    print(f"int8 / fp32: decode step {step['fp32'] / step['int8']:.2f}x faster, "
          f"weights {weight['fp32'] / weight['int8']:.2f}x smaller")


if __name__ == "__main__":
    main()
