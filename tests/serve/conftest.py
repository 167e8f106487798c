"""A real server on 127.0.0.1 (a free port) over the demo model, in this process: uvicorn in a thread."""

import asyncio
import threading
import time

import pytest

from autodeploy import LLM, SamplingParams
from autodeploy.models.demo import demo_model_path
from autodeploy.serve import build_app
from autodeploy.serve.server import bound_address, make_server

MODEL = "demo"
PROMPTS = ["hello world", "The quick brown fox", "a", "Once upon a time, in a land far away,"]
MAX_TOKENS = 12


class Served:
    def __init__(self, app, server, thread):
        self.app, self.server, self.thread = app, server, thread
        self.url = bound_address(server)
        self.state = app.state.server

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def start_server(app) -> Served:
    server = make_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return Served(app, server, thread)


def stop_server(served: Served) -> None:
    served.server.should_exit = True
    served.thread.join(30)
    assert not served.thread.is_alive(), "the test server did not stop"


@pytest.fixture(scope="session")
def demo_llm():
    return LLM(str(demo_model_path()), max_batch_size=16)


@pytest.fixture(scope="session")
def reference(demo_llm):
    """LLM.generate's greedy outputs (ignore_eos: a fixed length) for PROMPTS, before any server runs."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: o.outputs[0] for p, o in zip(PROMPTS, demo_llm.generate(PROMPTS, params))}


@pytest.fixture(scope="session")
def served(demo_llm, reference):
    served = start_server(build_app(demo_llm, MODEL, max_waiting=256))  # the demo tokenizer's chat template
    yield served
    stop_server(served)
