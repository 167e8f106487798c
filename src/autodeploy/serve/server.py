"""``autodeploy serve``: build the LLM, then serve the app with uvicorn until SIGINT / SIGTERM.

uvicorn stops accepting connections on a signal, lets the requests in flight finish for
``GRACEFUL_SHUTDOWN_S`` seconds, then the app's lifespan stops the engine thread (what is left is
cancelled), and the command exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import sys
import threading
from pathlib import Path

from ..errors import AutoDeployError

GRACEFUL_SHUTDOWN_S = 10


def make_server(app, host: str = "127.0.0.1", port: int = 8000):
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT / SIGTERM start a graceful shutdown (uvicorn's own re-raises the signal at the end, so
            the process would die of it instead of exiting 0)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    return Server(config)


def bound_address(server) -> str:
    """``http://host:port`` of a started uvicorn server (the real port when 0 was asked for)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{host}:{port}"


async def _serve(server, on_ready) -> None:
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        on_ready(bound_address(server))
    await task


def _llm_kwargs(args, overrides: dict) -> dict:
    from ..llm import LLM

    kwargs = dict(max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                  max_num_tokens=args.max_num_tokens, yaml_extra=args.yaml_extra, overrides=overrides,
                  kv_cache_config={"max_tokens": args.kv_cache_tokens} if args.kv_cache_tokens else None)
    if args.world_size != 1:
        if args.world_size < 1:
            raise AutoDeployError(f"--world-size must be >= 1, got {args.world_size}")
        if "world_size" not in inspect.signature(LLM).parameters:
            raise AutoDeployError("--world-size > 1 is not available yet: this build has no tensor parallelism")
        kwargs["world_size"] = args.world_size
    return kwargs


def main_serve(args) -> int:
    from ..config.loader import parse_override
    from ..llm import LLM
    from .app import build_app

    chat_template = None
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise AutoDeployError(f"--chat-template {path}: no such file")
        chat_template = path.read_text()
    if not args.model:
        from ..models.demo import demo_model_path

        args.model = str(demo_model_path())  # its tokenizer ships a chat template
        print(f"autodeploy: no --model given, serving the embedded demo model {args.model} (random weights)",
              file=sys.stderr)
    if args.max_waiting < 1:
        raise AutoDeployError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    overrides = {".".join(path): value for path, value in map(parse_override, args.overrides)}
    try:
        llm = LLM(args.model, **_llm_kwargs(args, overrides))
    except ValueError as exc:
        raise AutoDeployError(str(exc)) from None
    if getattr(llm, "engine", None) is None:  # a non-driver rank of a distributed run serves rank 0's steps
        return 0
    if args.no_prefix_caching:
        llm.engine.scheduler.set_prefix_caching(False)
    name = args.served_model_name or Path(args.model).name
    server = make_server(build_app(llm, name, chat_template, args.max_waiting), args.host, args.port)

    def ready(address: str) -> None:
        print(f"autodeploy: serving {name!r} on {address} (OpenAI API at {address}/v1)", flush=True)

    try:
        asyncio.run(_serve(server, ready))
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    if not server.started:
        raise AutoDeployError(f"could not listen on {args.host}:{args.port} (see the message above)")
    return 0
