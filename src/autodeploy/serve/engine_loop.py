"""One background thread drives the :class:`~autodeploy.runtime.engine.Engine` for every HTTP request.

The event loop's handlers :meth:`EngineLoop.submit` requests and read their tokens from a per-request
:class:`RequestHandle` (an ``asyncio.Queue`` fed with ``call_soon_threadsafe``). The thread adds what
was submitted since the last step, runs one :meth:`Engine.step` over all running requests (continuous
batching: a request that arrives while others decode joins the next step; a step of several decode forwards
ends at the next forward when something arrives) and hands each new token to its handle. Only this thread
touches the engine, so the engine needs no locks.

An exception inside a step fails the requests in flight (each handle gets a 500 :class:`Failed`), their
pages are freed, and the loop goes on with the next requests.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..runtime.engine import Engine
from ..runtime.sampler import SamplingParams, TokenLogprob
from ..runtime.scheduler import Interrupt, Request
from ..utils.logger import ad_logger
from .metrics import ServerMetrics
from .protocol import APIError


@dataclass
class Token:
    """One generated token of a request, its new text, and whether the request finished with it."""

    token_id: int
    text: str
    logprob: TokenLogprob | None
    finish_reason: str | None  # None while the request runs


@dataclass
class Failed:
    error: APIError


class RequestHandle:
    """A submitted request as the event loop sees it: its events, and the engine's request once added."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.prompt_token_ids, self.params, self.loop = prompt_token_ids, params, loop
        self.queue: asyncio.Queue[Token | Failed] = asyncio.Queue()
        self.request: Request | None = None
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.done = False

    def put(self, event: Token | Failed) -> None:  # from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Token]:
        """The request's tokens until it finishes; raises :class:`APIError` if it fails."""
        while True:
            event = await self.queue.get()
            if isinstance(event, Failed):
                raise event.error
            yield event
            if event.finish_reason is not None:
                return

    async def collect(self) -> list[Token]:
        return [t async for t in self.events()]


class EngineLoop:
    """The engine thread (see the module docstring). ``max_waiting``: submitted requests not yet running
    above which :meth:`submit` answers 503."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int = 256):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet taken by the thread
        self._thread = threading.Thread(target=self._run, name="autodeploy-engine", daemon=True)
        # a step of several decode forwards ends before its next forward when something is submitted (or aborted)
        self._interrupt = engine.scheduler.interrupt = Interrupt()
        self.ready = False
        metrics.bind(self)

    # -- the event loop's side ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def start(self) -> None:
        self._thread.start()
        self.ready = True

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left and end the thread."""
        self.ready = False
        if self._thread.is_alive():
            self._post(("stop", None))
            self._thread.join(timeout)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        with self._lock:
            if self.num_waiting >= self.max_waiting:
                raise APIError(503, f"the server is at capacity: {self.num_waiting} requests are waiting "
                               f"(--max-waiting {self.max_waiting}); retry later", code="server_busy",
                               type="service_unavailable")
            self._pending += 1
        handle = RequestHandle(prompt_token_ids, params, asyncio.get_running_loop())
        self._post(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (its client went away); a no-op once it finished."""
        if not handle.done:
            self._post(("abort", handle))

    # -- the engine thread --------------------------------------------------------------------------
    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._interrupt.set()  # after the put: the engine thread clears the flag before it takes what was put

    def _run(self) -> None:
        scheduler = self.engine.scheduler
        while True:
            busy = scheduler.has_unfinished()
            self._interrupt.clear()
            try:
                commands = [self._inbox.get(timeout=None if not busy else 0)]
            except queue.Empty:
                commands = []
            while True:  # everything submitted so far joins this step
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, handle in commands:
                if kind == "stop":
                    self._fail_all(APIError(503, "the server is shutting down", code="shutting_down",
                                            type="service_unavailable"), drain=True)
                    return
                if kind == "add":
                    self._add(handle)
                elif kind == "abort" and handle.request is not None and not handle.done:
                    self.engine.abort(handle.request)
                    self._finish(handle, "abort")
            if scheduler.has_unfinished():
                self._step()

    def _add(self, handle: RequestHandle) -> None:
        with self._lock:
            self._pending -= 1
        req = self.engine.add_request(handle.prompt_token_ids, handle.params)
        handle.request = req
        if req.finished:  # rejected (the handlers check first: only what changed since)
            handle.done = True
            handle.put(Failed(APIError(400, req.error or "the request cannot be served")))
            return
        self._handles[req.request_id] = handle
        self.metrics.prompt_tokens.inc(len(handle.prompt_token_ids))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001  (a failed forward fails its requests, not the server)
            ad_logger.error(f"engine step failed, failing the requests in flight: {type(exc).__name__}: {exc}")
            self.engine.reset()
            self._fail_all(APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_error"))
            return
        now = time.monotonic()
        for out in outputs:
            handle = self._handles.get(out.request.request_id)
            if handle is None or out.new_token_id is None:
                continue
            if handle.last_token_time is None:
                self.metrics.ttft.observe(now - handle.arrival)
            else:
                self.metrics.itl.observe(now - handle.last_token_time)
            handle.last_token_time = now
            self.metrics.generation_tokens.inc()
            reason = out.request.finish_reason if out.finished else None
            handle.put(Token(out.new_token_id, out.text, out.logprob, reason))
            if out.finished:
                self._finish(handle, reason)

    def _finish(self, handle: RequestHandle, reason: str) -> None:
        handle.done = True
        self._handles.pop(handle.request.request_id, None)
        self.metrics.finished.labels(reason=reason).inc()

    def _fail_all(self, error: APIError, drain: bool = False) -> None:
        """Fail every request in flight (and with ``drain``, every one submitted and not yet added)."""
        for handle in list(self._handles.values()):
            if handle.request is not None and not handle.request.finished:
                self.engine.abort(handle.request, "error")
            handle.put(Failed(error))
            self._finish(handle, "error")
        while drain:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                handle.done = True
                handle.put(Failed(error))
