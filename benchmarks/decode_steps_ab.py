"""Multi-step decode against one forward a step, on one ``LLM`` (the same package and weights, so no build or load
order between the two sides): A runs every engine step as one forward (``decode_steps=1``), B as many decode
forwards as the engine's setting allows (default ``AUTODEPLOY_DECODE_STEPS``, 32, within 50 ms). Their
generations alternate (``alternating_runs.py``); each figure is the median, with B's speed-up over A. Whether the
two give the same greedy tokens is checked on one batch first.

    python benchmarks/decode_steps_ab.py --model /tmp/llama-125m [--weights int8] [--batch 1] [--steps 32]
                                         [--reps 15]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

from alternating_runs import add_run_arguments, alternate_generations, llm_overrides, print_figures  # noqa: E402

from autodeploy import LLM, SamplingParams  # noqa: E402
from autodeploy.bench import _vocab_size, synthetic_prompts  # noqa: E402


class WithDecodeSteps:
    """``llm``'s generations with its engine's ``decode_steps`` set to ``steps``."""

    def __init__(self, llm: LLM, steps: int):
        self.llm, self.steps = llm, steps

    def generate_stream(self, prompts, params):
        self.llm.engine.scheduler.decode_steps = self.steps
        yield from self.llm.generate_stream(prompts, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, reps=15)
    parser.add_argument("--steps", type=int, default=None, help="B's decode_steps (default: the engine's)")
    args = parser.parse_args()
    overrides = llm_overrides(args)
    llm = LLM(args.model, overrides=overrides)
    steps = args.steps or llm.engine.scheduler.decode_steps
    engines = {"A": WithDecodeSteps(llm, 1), "B": WithDecodeSteps(llm, steps)}
    vocab = _vocab_size(args.model)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    check = synthetic_prompts(args.batch, args.isl, vocab, seed=999)
    tokens = {name: [list(t) for t in _tokens(engine, check, params)] for name, engine in engines.items()}
    runs = alternate_generations(engines, params, args.batch, args.isl, vocab, args.reps)
    llm.close()
    label = f"batch {args.batch}, {args.weights}, isl {args.isl}, osl {args.osl}"
    print(f"A: decode_steps=1; B: decode_steps={steps}. {args.reps} runs each; greedy tokens identical: "
          f"{tokens['A'] == tokens['B']}")
    print_figures(label, runs)


def _tokens(engine: WithDecodeSteps, prompts, params) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]
    for i, token, _ in engine.generate_stream(prompts, params):
        out[i].append(token)
    return out


if __name__ == "__main__":
    main()
