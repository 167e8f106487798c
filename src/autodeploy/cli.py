"""The ``autodeploy`` console script.

    autodeploy build --model PATH [--until STAGE] [--yaml-extra F]... [--set k=v]... [--verify] [--report DIR]
    autodeploy run --model PATH --prompt TEXT [--prompt TEXT]... [--max-tokens N] [--temperature T] ...
    autodeploy bench --model PATH --batch-size B --isl I --osl O [--compare hf|llama.cpp] [--json]
    autodeploy serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--chat-template FILE] ...
    autodeploy models [--json]
    autodeploy graph diff DIR A B

build/run/bench/serve take ``--use-registry``: ``--model ID`` names a model of ``autodeploy models``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from .errors import AutoDeployError, VerificationError

#: the exit code of ``build --verify`` when a transform breaks the model's numerics (2: any other error)
EXIT_VERIFY_FAILED = 3


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint folder (config.json + *.safetensors) or hub id")
    parser.add_argument("--yaml-extra", action="append", default=[], metavar="FILE",
                        help="extra YAML merged over the default pipeline (repeatable, in order)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="override one config value, e.g. transforms.export_to_gm.strict=true "
                             "(repeatable, applied last)")
    parser.add_argument("--use-registry", action="store_true",
                        help="--model is a model of `autodeploy models`: apply its extras before --yaml-extra/--set")


def apply_registry(args: argparse.Namespace) -> None:
    """``--use-registry``: the registry entry ``--model`` names (hub id, or a checkpoint folder whose
    config.json ``_name_or_path`` is one) puts its extras first in ``args.yaml_extra`` (a YAML file written
    to a temporary folder), so the user's --yaml-extra and --set apply over them."""
    if not getattr(args, "use_registry", False):
        return
    import atexit
    import shutil
    import tempfile

    from .models.registry import find_model

    if not args.model:
        raise AutoDeployError("--use-registry needs --model ID (a model of `autodeploy models`)")
    entry = find_model(args.model)
    if entry.extras:
        folder = Path(tempfile.mkdtemp(prefix="autodeploy-registry-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # read while the config loads, then gone
        path = folder / f"registry-{entry.id.replace('/', '--')}.yaml"
        path.write_text(entry.extras_yaml())
        args.yaml_extra = [str(path), *args.yaml_extra]


def _cmd_models(args: argparse.Namespace) -> int:
    import json

    from .models.registry import list_models, table

    entries = list_models()
    if args.json:
        print(json.dumps([e.as_dict() for e in entries], indent=2))
    else:
        print(table(entries), end="")
    return 0


def _add_world_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="ranks to split the model across (config world_size): N processes on this machine, "
                             "or the ones torchrun started")


def _world_size_override(args: argparse.Namespace) -> list[str]:
    """``--world-size N`` as the ``--set world_size=N`` it stands for (applied after the other --set)."""
    return [f"world_size={args.world_size}"] if getattr(args, "world_size", None) is not None else []


def _build_parser() -> argparse.ArgumentParser:
    from .transform import Stages

    parser = argparse.ArgumentParser(
        prog="autodeploy",
        description="Deploy a Hugging Face causal LM through an observable pipeline of graph transforms.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="run the transform pipeline and print its log")
    _add_config_args(build)
    build.add_argument("--until", choices=[s.value for s in Stages], metavar="STAGE",
                       help="stop after this stage (one of: " + ", ".join(s.value for s in Stages) + ")")
    build.add_argument("--verify", action="store_true",
                       help="after every transform, compare the graph's logits with HF transformers' on seeded "
                            f"samples; exit code {EXIT_VERIFY_FAILED} names the first transform out of tolerance")
    build.add_argument("--verify-atol", type=float, default=None, metavar="X",
                       help="absolute tolerance of --verify (default 1e-4 in float32, looser for bf16/fp16)")
    build.add_argument("--verify-rtol", type=float, default=None, metavar="X",
                       help="relative tolerance of --verify (default 0 in float32)")
    _add_world_size(build)
    build.add_argument("--report", default=None, metavar="DIR",
                       help="write the pipeline's HTML report (DIR/index.html, with the graph dumps) to DIR")

    run = commands.add_parser("run", help="build the pipeline and generate text for each --prompt")
    _add_config_args(run)  # without --model: the embedded demo model (tiny, random weights, built offline)
    run.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    run.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                     help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable; no tokenizer needed)")
    run.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    run.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    run.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    run.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    run.add_argument("--ignore-eos", action="store_true", help="don't stop at the model's EOS token")
    run.add_argument("--max-batch-size", type=int, default=None, help="sequences per forward (config max_batch_size)")
    run.add_argument("--max-seq-len", type=int, default=None, help="tokens per sequence (config max_seq_len)")
    run.add_argument("--max-num-tokens", type=int, default=None, help="tokens per forward (chunked prefill)")
    run.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                     help="KV-cache budget in tokens (transforms.resize_kv_cache.max_tokens)")
    run.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    _add_world_size(run)

    bench = commands.add_parser("bench", help="measure throughput (optionally against HF transformers, same run)")
    _add_config_args(bench)
    bench.add_argument("--batch-size", type=int, default=1, help="prompts per run (default 1)")
    bench.add_argument("--isl", type=int, default=128, help="input (prompt) length in tokens (default 128)")
    bench.add_argument("--osl", type=int, default=32, help="output tokens per prompt (default 32)")
    bench.add_argument("--compare", choices=["hf", "llama.cpp"], default=None,
                       help="also measure HF transformers eager generate, or llama.cpp (llama-cpp-python, the "
                            "checkpoint written as GGUF), on the same prompts and print ratios")
    bench.add_argument("--gguf-type", type=str.upper, choices=["F32", "F16", "Q8_0", "Q4_0"], default=None,
                       help="--compare llama.cpp: the GGUF weight type (default: the run's precision class: "
                            "fp32 F32, bf16/fp16 F16, int8 Q8_0, int4 Q4_0)")
    bench.add_argument("--gguf-dir", default=None, metavar="DIR",
                       help="--compare llama.cpp: where the GGUF file is written and reused "
                            "(default $XDG_CACHE_HOME/autodeploy/gguf)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    bench.add_argument("--num-threads", type=int, default=None,
                       help="torch intra-op threads for both sides (default: torch's default)")
    bench.add_argument("--warmup-osl", type=int, default=4, help="output tokens of the warm-up run (0: none)")
    bench.add_argument("--warm-page-cache", action="store_true",
                       help="keep the checkpoint's page cache as found (default: dropped before each side builds, so "
                            "that neither side's peak memory depends on what the other left there)")
    bench.add_argument("--runs", type=int, default=3,
                       help="measured runs per side; the median run's figures are reported (default 3)")
    _add_world_size(bench)

    _add_serve_parser(commands)

    models = commands.add_parser("models", help="list the registry of well-known models and their extras")
    models.add_argument("--json", action="store_true", help="print a JSON list of objects instead of a table")

    graph = commands.add_parser("graph", help="inspect graph dumps written with AD_DUMP_GRAPHS_DIR")
    graph_commands = graph.add_subparsers(dest="graph_command", required=True)
    diff = graph_commands.add_parser("diff", help="what changed between two dumps of one directory")
    diff.add_argument("dir", help="the dump directory")
    diff.add_argument("a", help="first dump: its number (e.g. 3), file name, or transform key")
    diff.add_argument("b", help="second dump: its number, file name, or transform key")
    return parser


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_config_args(serve)  # without --model: the embedded demo model
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model name clients send (default: the checkpoint folder's name)")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template, for checkpoints whose tokenizer has none")
    serve.add_argument("--max-waiting", type=int, default=256, metavar="N",
                       help="requests waiting to run above which new ones get 503 (default 256)")
    serve.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks to split the model across")
    serve.add_argument("--max-batch-size", type=int, default=None, help="sequences per forward (config max_batch_size)")
    serve.add_argument("--max-seq-len", type=int, default=None, help="tokens per sequence (config max_seq_len)")
    serve.add_argument("--max-num-tokens", type=int, default=None, help="tokens per forward (chunked prefill)")
    serve.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                       help="KV-cache budget in tokens (transforms.resize_kv_cache.max_tokens)")
    serve.add_argument("--no-prefix-caching", action="store_true",
                       help="don't share the KV pages of common prompt prefixes between requests")


def _cmd_build(args: argparse.Namespace) -> int:
    from .api import build_optimizer, verify_options
    from .config import load_config
    from .utils.graph_writer import GraphWriter
    from .utils.logger import ad_logger

    config = load_config(args.yaml_extra, args.overrides + _world_size_override(args),
                         base={"model": args.model} if args.model else None)
    if not config.model:
        raise AutoDeployError("no model given: pass --model PATH (a checkpoint folder)")
    if config.world_size > 1:  # every rank builds its shard of the whole pipeline
        if args.until or args.verify:
            raise AutoDeployError("--until and --verify build one process's graph: use them without --world-size")
        from .distributed.runner import build_model

        build_model(config).close()
        ad_logger.info(f"build finished on {config.world_size} ranks")
        return 0
    if args.report:  # the report is the dump directory's index.html: dump there
        os.environ[GraphWriter.DUMP_GRAPHS_ENV] = args.report
    optimizer, _ = build_optimizer(config, verify=verify_options(args.verify, args.verify_atol, args.verify_rtol))
    optimizer(until=args.until)
    ad_logger.info("build finished" + (f" (until stage {args.until})" if args.until else ""))
    if args.report:
        ad_logger.info(f"report: {Path(args.report) / 'index.html'}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .config.loader import parse_override
    from .llm import LLM, has_tokenizer_files
    from .runtime.sampler import SamplingParams

    if not args.model:  # the embedded demo model (tiny, random weights, built offline on first use)
        from .models.demo import demo_model_path

        args.model = str(demo_model_path())
        print(f"autodeploy: no --model given, using the embedded demo model {args.model} (random weights)",
              file=sys.stderr)
    prompts: list = list(args.prompt)
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.replace(" ", "").split(",") if t])
        except ValueError:
            raise AutoDeployError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not prompts:
        raise AutoDeployError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3")
    if any(isinstance(p, str) for p in prompts) and Path(args.model).is_dir() and not has_tokenizer_files(args.model):
        raise AutoDeployError(f"{args.model} has no tokenizer files: pass prompts as --prompt-ids 1,2,3")
    settings = args.overrides + _world_size_override(args)
    overrides = {".".join(path): value for path, value in map(parse_override, settings)}
    kv = {"max_tokens": args.kv_cache_tokens} if args.kv_cache_tokens is not None else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        params.validate()
        llm = LLM(args.model, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                  max_num_tokens=args.max_num_tokens, kv_cache_config=kv, yaml_extra=args.yaml_extra,
                  overrides=overrides)
        if not llm.is_driver:  # a rank other than 0 under torchrun: it served rank 0's steps
            return 0
        with llm:
            return _generate(llm, args, prompts, params)
    except ValueError as exc:
        raise AutoDeployError(str(exc)) from None


def _generate(llm, args: argparse.Namespace, prompts: list, params) -> int:
    try:
        if llm.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise AutoDeployError(f"{args.model} has no tokenizer files: pass prompts as --prompt-ids 1,2,3")
        if args.stream:
            for i, token, delta in llm.generate_stream(prompts, params):
                print(f"[{i}] {token}" + (f" {delta!r}" if llm.tokenizer is not None else ""), flush=True)
            return 0
        outs = llm.generate(prompts, params)
    except ValueError as exc:
        raise AutoDeployError(str(exc)) from None
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        prompt = out.prompt if out.prompt is not None else ",".join(map(str, out.prompt_token_ids))
        print(f"=== prompt {i}: {prompt!r}")
        print(completion.text if completion.text is not None else " ".join(map(str, completion.token_ids)))
        print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}", flush=True)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main_bench
    from .config.loader import parse_override

    settings = args.overrides + _world_size_override(args)
    overrides = {".".join(path): value for path, value in map(parse_override, settings)}
    if args.num_threads is not None:
        if args.num_threads < 1:
            raise AutoDeployError(f"--num-threads must be >= 1, got {args.num_threads}")
        import torch

        torch.set_num_threads(args.num_threads)
    return main_bench(args, overrides)


def _cmd_graph_diff(args: argparse.Namespace) -> int:
    from .utils.graph_diff import diff_dumps

    print(diff_dumps(args.dir, args.a, args.b), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        apply_registry(args)
        if args.command == "models":
            return _cmd_models(args)
        if args.command == "build":
            return _cmd_build(args)
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "graph":
            return _cmd_graph_diff(args)
        if args.command == "serve":
            from .serve.server import main_serve

            return main_serve(args)
    except VerificationError as exc:
        print(f"autodeploy: verification failed: {exc}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    except AutoDeployError as exc:
        import logging
        import traceback

        from .utils.logger import ad_logger

        if ad_logger.isEnabledFor(logging.DEBUG) and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"autodeploy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autodeploy: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
