"""A bounded load test on loopback: 64 concurrent streaming clients send 256 requests of mixed prompt and
output lengths; every request completes with exactly its token count, nothing is lost or left running."""

import asyncio
import random
import time

from conftest import MODEL

CLIENTS, REQUESTS = 64, 256


def test_64_streaming_clients_256_requests(served):
    from openai import AsyncOpenAI

    rng = random.Random(0)
    jobs = [("".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 60))), rng.randint(1, 48))
            for _ in range(REQUESTS)]

    async def main():
        client = AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        gate = asyncio.Semaphore(CLIENTS)

        async def one(prompt, max_tokens):
            async with gate:
                stream = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=1, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                chunks = [c async for c in stream]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                return chunks[-1].usage.completion_tokens, finish

        try:
            return await asyncio.gather(*(one(p, n) for p, n in jobs))
        finally:
            await client.close()

    start = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), timeout=300))
    elapsed = time.monotonic() - start
    assert [n for n, _ in results] == [n for _, n in jobs]
    assert all(finish == "length" for _, finish in results)
    scheduler = served.state.engine.scheduler
    assert not scheduler.has_unfinished() and scheduler.num_pages_in_use == 0
    print(f"{REQUESTS} requests, {CLIENTS} clients: {elapsed:.1f} s")
