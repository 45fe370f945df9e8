"""The hostile mix of benchmarks/serve.py: clients that are not the server's friends, run beside
the normal load in a process of their own (as they would be other machines), each sending one
of these after another, chosen at random (seeded), until told to stop:

    dropped stream     a streamed completion of 256 tokens, left after its first chunk
    dropped response   a whole (non-streamed) completion of 256 tokens, left after 0.2 s
    half a body        a request whose body stops halfway, then the connection closes
    oversized prompt   a 3.9 MB text prompt of 1.3M words: under the body limit, far over
                       the context
    past the limit     a 12 MB body: its Content-Length alone is over --max-request-bytes
    bad JSON           a body cut off mid-object
    not JSON           the same request as text/plain (what a web page can send anywhere)
    logprobs 1000, max_tokens 2**40   values past the server's limits

Each is raw HTTP over its own connection; what the server answered (a status, or nothing
when the client left first) is counted per kind.
"""

import asyncio
import json
import multiprocessing
import random
from collections import Counter

OVERSIZED = json.dumps({"prompt": "go " * 1_300_000}).encode()  # words: each a token or more
PAST_THE_LIMIT = 12_000_000  # bytes a body declares
TIMEOUT_S = 60


def _head(host: str, length: int, content_type: str = "application/json") -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


async def _send(host: str, port: int, head: bytes, body: bytes, leave_after_s: float | None) -> str:
    """Send a request; its status (e.g. "400"), or "left" if the client leaves first."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + body)
        await writer.drain()
        if leave_after_s is not None:
            await asyncio.sleep(leave_after_s)
            return "left"
        status_line = await asyncio.wait_for(reader.readline(), TIMEOUT_S)
        return status_line.split()[1].decode() if status_line else "closed"
    finally:
        writer.close()


async def _dropped_stream(host: str, port: int, model: str) -> str:
    body = json.dumps(
        {"model": model, "prompt": [1, 2, 3], "max_tokens": 256, "ignore_eos": True, "stream": True}
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_head(host, len(body)) + body)
        await writer.drain()
        while b"data:" not in await asyncio.wait_for(reader.readline(), TIMEOUT_S):
            pass
        return "left"
    finally:
        writer.close()


async def _attack(kind: str, host: str, port: int, model: str) -> str:
    small = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 256, "ignore_eos": True})
    if kind == "dropped stream":
        return await _dropped_stream(host, port, model)
    if kind == "dropped response":
        return await _send(host, port, _head(host, len(small)), small.encode(), 0.2)
    if kind == "half a body":
        return await _send(host, port, _head(host, len(small)), small.encode()[:20], 0.1)
    if kind == "oversized prompt":
        return await _send(host, port, _head(host, len(OVERSIZED)), OVERSIZED, None)
    if kind == "past the limit":
        return await _send(host, port, _head(host, PAST_THE_LIMIT), OVERSIZED[:65536], None)
    if kind == "bad JSON":
        return await _send(host, port, _head(host, 12), b'{"prompt": [', None)
    if kind == "not JSON":
        return await _send(host, port, _head(host, len(small), "text/plain"), small.encode(), None)
    bad = {"logprobs 1000": {"logprobs": 1000}, "max_tokens 2**40": {"max_tokens": 2**40}}[kind]
    body = json.dumps({"model": model, "prompt": "x", **bad}).encode()
    return await _send(host, port, _head(host, len(body)), body, None)


KINDS = (
    "dropped stream",
    "dropped response",
    "half a body",
    "oversized prompt",
    "past the limit",
    "bad JSON",
    "not JSON",
    "logprobs 1000",
    "max_tokens 2**40",
)


async def _client(host: str, port: int, model: str, seed: int, stop, seen: Counter) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        kind = rng.choice(KINDS)
        try:
            outcome = await _attack(kind, host, port, model)
        except (OSError, asyncio.TimeoutError) as e:
            outcome = type(e).__name__
        seen[f"{kind}: {outcome}"] += 1


def _run(host: str, port: int, model: str, num_clients: int, stop, results) -> None:
    seen: Counter = Counter()

    async def main() -> None:
        await asyncio.gather(
            *(_client(host, port, model, seed, stop, seen) for seed in range(num_clients))
        )

    asyncio.run(main())
    results.put(dict(seen))


class HostileMix:
    """`with HostileMix(...) as mix:` runs the clients in a child process while the block
    runs; mix.counts is then what they sent and what came back."""

    def __init__(self, host: str, port: int, model: str, num_clients: int):
        context = multiprocessing.get_context("spawn")
        self.stop, self.results = context.Event(), context.Queue()
        self.process = context.Process(
            target=_run, args=(host, port, model, num_clients, self.stop, self.results)
        )
        self.counts: dict[str, int] = {}

    def __enter__(self) -> "HostileMix":
        self.process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.counts = self.results.get(timeout=TIMEOUT_S + 30)
        self.process.join(30)
