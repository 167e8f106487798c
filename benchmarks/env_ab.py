"""Two builds of one model against each other in one process, differing only by environment variables that steer
the build: what a graph-level switch such as ``AUTODEPLOY_FUSED_ATTENTION=0`` is worth.

A is an ``LLM`` built with the ``--a`` variables set (``NAME=VALUE``, repeatable), B one built with the ``--b`` ones
(none: the environment as it is, the default). A is built and loaded first: on the Intel Xeon of docs/performance.md
the engine loaded second decoded 4-bit weights up to 12-17 % slower whatever its settings, so a comparison that
matters is run both ways round (``--a X --b Y``, then ``--a Y --b X``). Variables named ``AUTODEPLOY_*`` are part
of the served-package cache's key, so each side finds or builds its own package. The two engines' generations
alternate (A B, B A, ...) on fresh random prompts of the same shape; each figure is the median, with B's speed-up
over A, after a first pair that warms up. Whether the two give the same greedy tokens is checked on one prompt
first.

    python benchmarks/env_ab.py --model /tmp/llama-125m --a AUTODEPLOY_FUSED_ATTENTION=0 [--b NAME=VALUE]
                                [--weights int8] [--batch 1] [--reps 15]

``kernel_ab.py`` compares two builds of the native kernels (the same graph); this compares two graphs.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

from alternating_runs import add_run_arguments, alternate_generations, llm_overrides, print_figures  # noqa: E402

from autodeploy import LLM, SamplingParams  # noqa: E402
from autodeploy.bench import _vocab_size, synthetic_prompts  # noqa: E402


def build_with(env: dict[str, str], model: str, overrides: dict) -> LLM:
    """An ``LLM`` built with ``env`` set (the variables restored after the build)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return LLM(model, overrides=overrides)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _parse_env(flag: str, items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"{flag} {item!r}: expected NAME=VALUE")
        env[name] = value
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, reps=15)
    parser.add_argument("--a", action="append", required=True, metavar="NAME=VALUE",
                        help="an environment variable of build A (repeatable)")
    parser.add_argument("--b", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of build B (repeatable; default: none)")
    args = parser.parse_args()
    env_a, env_b = _parse_env("--a", args.a), _parse_env("--b", args.b)
    overrides = llm_overrides(args)
    engines = {"A": build_with(env_a, args.model, overrides), "B": build_with(env_b, args.model, overrides)}
    vocab = _vocab_size(args.model)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    check = synthetic_prompts(args.batch, args.isl, vocab, seed=999)
    tokens = {name: [o.outputs[0].token_ids for o in llm.generate(check, params)] for name, llm in engines.items()}
    runs = alternate_generations(engines, params, args.batch, args.isl, vocab, args.reps)
    for llm in engines.values():
        llm.close()
    label = f"batch {args.batch}, {args.weights}, isl {args.isl}, osl {args.osl}"
    print(f"A: {' '.join(args.a)}; B: {' '.join(args.b) or 'the environment as it is'}. {args.reps} runs each; "
          f"greedy tokens identical: {tokens['A'] == tokens['B']}")
    print_figures(label, runs)


if __name__ == "__main__":
    main()
