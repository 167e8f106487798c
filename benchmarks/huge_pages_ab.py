"""The served weights in 2 MiB pages against 4 KiB pages, in one process: what ``map_in_huge_pages`` is worth.

Builds (or finds in the cache) the package of the default configuration plus the row's weight precision, copies
it twice into a scratch folder, drops both copies from the page cache and loads each with ``load_package``: B as
it loads (the weights hinted for huge pages and read in), A with ``map_in_huge_pages`` turned off (the pages read
as the steps touch them, as before the twenty-ninth round). The two engines' generations alternate (A B, B A, ...)
on fresh random prompts; each figure is the median, with B's speed-up over A, and how much of each copy's weights
ended up mapped in 2 MiB pages (``FilePmdMapped`` of ``/proc/self/smaps``). Linux only.

    python benchmarks/huge_pages_ab.py --model /tmp/llama-125m [--batch 16] [--weights bf16] [--reps 12]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("AUTO_DEPLOY_LOG_LEVEL", "WARNING")

from alternating_runs import add_run_arguments, alternate_generations, llm_overrides, print_figures  # noqa: E402

from autodeploy import LLM, SamplingParams  # noqa: E402
from autodeploy.bench import _vocab_size  # noqa: E402
from autodeploy.build_process import cached_package, package_cache_key  # noqa: E402
from autodeploy.runtime import package as package_module  # noqa: E402
from autodeploy.runtime.engine import Engine  # noqa: E402
from autodeploy.utils import memory  # noqa: E402


def pmd_mapped_bytes(folder: Path) -> int:
    """Bytes of this process's mappings of files under ``folder`` that are mapped in 2 MiB pages."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[-1].startswith(str(folder))
            elif inside and fields[0] == "FilePmdMapped:":
                total += int(fields[1]) * 1024
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, reps=12)
    args = parser.parse_args()
    overrides = llm_overrides(args)
    key = package_cache_key(LLM(args.model, overrides=overrides).config)  # builds the package, or finds it
    source = cached_package(key) if key is not None else None
    if source is None:
        raise SystemExit("this configuration is not served from a package (see the log): nothing to compare")
    vocab = _vocab_size(args.model)
    engines = {}
    map_in_huge_pages = memory.map_in_huge_pages
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("A", "B"):
            copy = Path(scratch) / name
            shutil.copytree(source, copy)
            memory.drop_cached_pages([copy / package_module.WEIGHTS_FILE])
            memory.map_in_huge_pages = map_in_huge_pages if name == "B" else (lambda tensors: 0)
            try:
                served = package_module.load_package(copy)
            finally:
                memory.map_in_huge_pages = map_in_huge_pages
            engines[name] = Engine(served, None, served.eos_token_ids, vocab_size=vocab)
        params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
        runs = alternate_generations(engines, params, args.batch, args.isl, vocab, args.reps)
        mapped = {name: pmd_mapped_bytes(Path(scratch) / name) for name in engines}
    label = f"batch {args.batch}, {args.weights}, isl {args.isl}, osl {args.osl}"
    print(f"A: 4 KiB pages as the steps read them; B: read in at load in 2 MiB pages. {args.reps} runs each")
    print(f"weights mapped in 2 MiB pages: A {mapped['A'] / 2**20:.0f} MiB | B {mapped['B'] / 2**20:.0f} MiB")
    print_figures(label, runs)


if __name__ == "__main__":
    main()
