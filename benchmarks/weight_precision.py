"""Accuracy and speed of 16-bit, int8 and int4 weights (``quantize_weights``) against the fp32 model, in one run.

Builds the model once per weight format from the same checkpoint (fp32, then ``--dtypes``: bf16, int8 and
int4 by default; int4 with ``--group-size``), then for each format against fp32:

- logits of ``--batch`` seeded random prompts of ``--isl`` tokens (every position): max and mean absolute
  error, the mean error relative to the fp32 logits' standard deviation, and top-1 agreement;
- greedy generation of ``--osl`` tokens from the same prompts: the sequences whose tokens are identical and
  the mean number of leading tokens that agree;
- perplexity of the text this benchmark ships (``benchmarks/precision_text.txt``, written for it, public
  domain), tokenized with the checkpoint's tokenizer, or byte by byte (ids = UTF-8 bytes modulo the
  vocabulary) where it has none; windows of ``--ppl-window`` tokens, each token predicted from the ones
  before it in its window; reported with its change relative to fp32;
- decode speed: median time of one batch-1 decode step (alternating, ``--reps`` rounds), and weight bytes.

``--peak-rss``: additionally writes a bf16 copy of the checkpoint and measures, each in its own process,
the peak resident memory of building it (``optimize(until="post_load_fusion")``) and one forward pass: with
``dtype: float32`` (every weight upcast), with ``dtype: float32`` and ``quantize_weights.dtype: bf16``
(linear weights kept as stored: no fp32 copy), and with ``dtype: bfloat16`` (everything as stored).

    python benchmarks/weight_precision.py --model PATH [--batch 4] [--isl 128] [--osl 32] [--threads N]
        [--dtypes bf16,int8,int4] [--group-size 32] [--peak-rss]

A random-weight checkpoint has nearly flat logits (perplexity near the vocabulary size), so its top-1 and
greedy agreement understate what a trained model keeps; the error relative to the logits' spread and the
relative change of perplexity are the comparable figures.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from autodeploy import LLM, SamplingParams  # noqa: E402
from autodeploy.bench import _module_weight_bytes, _vocab_size, synthetic_prompts  # noqa: E402
from autodeploy.runtime.sequence_info import SequenceRequest  # noqa: E402

TEXT = Path(__file__).with_name("precision_text.txt")


def quantize(dtype: str, group_size: int) -> dict:
    extra = {"transforms.quantize_weights.group_size": group_size} if dtype == "int4" else {}
    return {"transforms.quantize_weights.enabled": True, "transforms.quantize_weights.dtype": dtype, **extra}


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


def text_tokens(model: str, vocab: int) -> tuple[list[int], str]:
    text = TEXT.read_text()
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model).encode(text), "the checkpoint's tokenizer"
    except Exception:  # noqa: BLE001 - a random-weight checkpoint without a tokenizer: bytes
        return [b % vocab for b in text.encode()], "UTF-8 bytes"


def perplexity(llm: LLM, tokens: list[int], window: int, batch: int) -> float:
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    windows = [w for w in windows if len(w) == window]  # equal lengths: one batch shape
    nll, count = 0.0, 0
    for start in range(0, len(windows), batch):
        chunk = windows[start : start + batch]
        logits = prompt_logits(llm, chunk).reshape(len(chunk), window, -1)
        target = torch.tensor(chunk)[:, 1:]
        logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        nll -= float(logp.gather(-1, target[..., None]).sum())
        count += target.numel()
    return math.exp(nll / count)


_RSS_CHILD = """
import os, resource, sys, torch
os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")
import autodeploy
gm = autodeploy.optimize(sys.argv[1], until="post_load_fusion", overrides=eval(sys.argv[2]))
ids = torch.randint(0, 100, (1, 16))
with torch.no_grad():
    gm(ids, torch.arange(16)[None])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(model: str) -> None:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(tmp)
        weights = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        print(f"peak RSS, bf16 copy of the checkpoint ({weights / 2**20:.0f} MiB of weights), build + one forward:")
        for label, overrides in [
            ("dtype float32 (all weights upcast)", {"dtype": "float32"}),
            ("dtype float32 + quantize_weights bf16", {"dtype": "float32", **quantize("bf16", 32)}),
            ("dtype bfloat16 (as stored)", {"dtype": "bfloat16"}),
        ]:
            out = subprocess.run([sys.executable, "-c", _RSS_CHILD, tmp, repr(overrides)], capture_output=True,
                                 text=True, check=True)
            print(f"  {label}: {int(out.stdout.split()[-1]) / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtypes", default="bf16,int8,int4", help="comma-separated quantize_weights dtypes")
    parser.add_argument("--group-size", type=int, default=32, help="int4's group size")
    parser.add_argument("--ppl-window", type=int, default=128)
    parser.add_argument("--peak-rss", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    vocab = _vocab_size(args.model)
    prompts = synthetic_prompts(args.batch, args.isl, vocab)
    limits = {"max_batch_size": args.batch, "max_seq_len": max(args.isl + args.osl, args.ppl_window)}
    dtypes = [d for d in args.dtypes.split(",") if d]
    models = {"fp32": LLM(args.model, overrides=limits)}
    for dtype in dtypes:
        models[dtype] = LLM(args.model, overrides={**limits, **quantize(dtype, args.group_size)})
    tokens, how = text_tokens(args.model, vocab)

    ref = prompt_logits(models["fp32"], prompts)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    ref_tokens = [o.outputs[0].token_ids for o in models["fp32"].generate(prompts, params)]
    ppl = {name: perplexity(llm, tokens, args.ppl_window, args.batch) for name, llm in models.items()}
    print(f"perplexity of {TEXT.name} ({len(tokens)} tokens by {how}, windows of {args.ppl_window}): "
          f"fp32 {ppl['fp32']:.2f}")
    for dtype in dtypes:
        name = dtype + (f" (group {args.group_size})" if dtype == "int4" else "")
        out = prompt_logits(models[dtype], prompts)
        err = (out - ref).abs()
        got = [o.outputs[0].token_ids for o in models[dtype].generate(prompts, params)]
        same = sum(a == b for a, b in zip(ref_tokens, got))
        lead = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref_tokens, got)]
        print(f"{name}: logits over {ref.shape[0]} positions: max abs err {err.max():.4g}, mean abs err "
              f"{err.mean():.4g}, mean err / fp32 logit std {err.mean() / ref.std():.4g}, top-1 agreement "
              f"{(out.argmax(-1) == ref.argmax(-1)).float().mean():.4f}; greedy {args.osl} tokens: {same}/"
              f"{len(prompts)} identical, mean agreeing prefix {statistics.mean(lead):.1f}; perplexity "
              f"{ppl[dtype]:.2f} ({(ppl[dtype] / ppl['fp32'] - 1) * 100:+.3f}%)")

    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.reps):
        for name, llm in models.items():
            times[name].append(decode_step_s(llm, args.isl))
    step = {k: statistics.median(v) for k, v in times.items()}
    weight = {k: _module_weight_bytes(m.module) for k, m in models.items()}
    for name in models:
        print(f"{name}: decode step (batch 1) {step[name] * 1e3:.2f} ms ({step['fp32'] / step[name]:.2f}x fp32), "
              f"weights {weight[name] / 2**20:.1f} MiB ({weight['fp32'] / weight[name]:.2f}x smaller)")
    if args.peak_rss:
        del models
        peak_rss(args.model)


if __name__ == "__main__":
    main()
