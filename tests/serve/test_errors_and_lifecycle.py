"""Errors in OpenAI's error JSON over raw HTTP (and the next request served), an engine failure (500 for the
requests in flight, then serving goes on), the waiting bound (503), a disconnecting client (its pages
freed), the metrics, and SIGTERM on a real `autodeploy serve` process (exit 0)."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import MODEL

OK = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}


def post(served, body, path="/v1/completions", **kw):
    return httpx.post(served.url + path, timeout=60, **({"json": body} if not isinstance(body, str) else
                                                        {"content": body, "headers": {"content-type":
                                                                                      "application/json"}}), **kw)


@pytest.mark.parametrize("body, status, param, words", [
    ('{"prompt": "hello", "max_tokens": ', 400, None, "not valid JSON"),
    ({"max_tokens": 4}, 400, "prompt", "prompt"),
    ({"prompt": "hello", "max_tokens": "four"}, 400, "max_tokens", "integer"),
    ({"prompt": "hello", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ({"prompt": "hello", "top_p": 2}, 400, "top_p", "less than or equal to 1"),
    ({"prompt": "hello", "logprobs": 50}, 400, "logprobs", "20"),
    ({"prompt": "hello", "n": 2}, 400, "n", "only n=1"),
    ({"prompt": "hello", "max_tokens": 0}, 400, "max_tokens", "only with echo"),
    ({"prompt": "hello", "model": "gpt-5"}, 404, "model", "'gpt-5' does not exist"),
    ({"prompt": "x" * 600}, 400, "prompt", "max_seq_len=512"),
    ({"prompt": "x" * 500, "max_tokens": 100}, 400, "prompt", "more than max_seq_len=512"),
    ({"prompt": [1, 2, 100000]}, 400, "prompt", "vocab_size"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": "hello", "extra": 1, "stop": [""]}, 400, "stop", "non-empty"),
])
def test_malformed_requests_get_4xx_error_json(served, body, status, param, words):
    r = post(served, body)
    error = r.json()["error"]
    assert r.status_code == status, error
    assert words in error["message"] and error["param"] == param
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert post(served, OK).status_code == 200  # the next valid request succeeds


def test_chat_errors_and_unknown_routes(served):
    r = post(served, {"messages": []}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(served, {"messages": [{"role": "user", "content": 3}]}, "/v1/chat/completions")
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"]
    r = httpx.get(served.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_engine_failure_fails_the_requests_in_flight_then_serving_goes_on(served):
    scheduler = served.state.engine.scheduler
    forward = scheduler.forward
    calls = []

    def failing(seqs):
        calls.append(len(seqs))
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return forward(seqs)

    scheduler.forward = failing
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(served, {**OK, "max_tokens": 40})))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        scheduler.forward = forward
    failed = [r for r in results if r.status_code == 500]
    assert failed and all("injected fault" in r.json()["error"]["message"] for r in failed)
    assert all(r.status_code in (200, 500) for r in results)
    assert post(served, OK).status_code == 200
    assert scheduler.num_pages_in_use == 0 and not scheduler.has_unfinished()


def test_waiting_bound_gives_503(served):
    loop = served.state.loop
    bound, loop.max_waiting = loop.max_waiting, 0
    try:
        r = post(served, OK)
    finally:
        loop.max_waiting = bound
    assert r.status_code == 503 and "--max-waiting" in r.json()["error"]["message"]


def wait_until_idle(scheduler, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while scheduler.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_disconnecting_client_cancels_its_request(served, monkeypatch):
    scheduler = served.state.engine.scheduler
    wait_until_idle(scheduler)  # an earlier test's request still ending would take the steps counted below
    forward, abort = scheduler.forward, served.state.loop.abort
    steps = []
    client_gone, aborted = threading.Event(), threading.Event()

    def held_forward(seqs):  # the request's steps wait for what the test checks, so no step ends it early however
        steps.append(len(seqs))  # slow the machine: the second until the client has read its first token and
        if len(steps) == 2:  # left, the later ones until the server has asked the engine to abort it
            client_gone.wait(timeout=30)
        elif len(steps) > 2:
            aborted.wait(timeout=30)
        return forward(seqs)

    def abort_and_tell(handle):
        abort(handle)
        aborted.set()

    monkeypatch.setattr(served.state.loop, "abort", abort_and_tell)
    monkeypatch.setattr(scheduler, "forward", held_forward)
    body = {**OK, "max_tokens": 400, "stream": True, "extra_body": None, "ignore_eos": True}
    try:
        with httpx.stream("POST", served.url + "/v1/completions", json=body) as r:
            # keep the line iterator: a dropped one is closed at once, and closing it closes the connection (the
            # client would leave here, and on a loaded machine the abort could beat the engine's second step)
            lines = r.iter_lines()
            first = next(lines)
            deadline = time.monotonic() + 30
            while len(steps) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert scheduler.num_pages_in_use > 0, (r.status_code, first, steps)
    finally:
        client_gone.set()
    wait_until_idle(scheduler)
    assert not scheduler.has_unfinished() and scheduler.num_pages_in_use == 0
    assert 0 < len(steps) < 400  # served, and stopped early (a slow engine thread may not reach its second step)


def test_metrics(served):
    post(served, OK)
    text = httpx.get(served.url + "/metrics").text
    for name in ("autodeploy_requests_running", "autodeploy_requests_waiting", "autodeploy_prompt_tokens_total",
                 "autodeploy_generation_tokens_total", "autodeploy_kv_cache_pages_used",
                 "autodeploy_time_to_first_token_seconds_bucket", "autodeploy_inter_token_latency_seconds_count",
                 'autodeploy_requests_finished_total{reason="length"}'):
        assert name in text


@pytest.mark.slow  # builds the demo model in a second process
def test_sigterm_stops_a_serve_process_with_exit_0():
    env = {**os.environ, "AUTO_DEPLOY_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "autodeploy.cli", "serve", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the server listens
        assert "serving" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split(" on ")[1].split()[0]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
