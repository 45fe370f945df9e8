"""A fleet on loopback, started here: two `nanovllm serve` replicas (one thread each) behind
vLLM's router (the vllm-router wheel of this environment, with benchmarks/fleet.py's recipe
flags), driven by the official `openai` client:

- answers through the router are the replicas' own, streamed and not;
- bad input still gets a 4xx: OpenAI's body for what a replica refuses, the router's own words
  for what it refuses first (types it checks itself);
- conversations stay on the replica that holds their prefix: across the replicas' prefix-cache
  counters, each turn finds what it would find on a single replica;
- a replica drained mid-load (SIGTERM, --shutdown-timeout) loses no request and exits 0; once
  restarted (a rolling restart) it gets its conversations' next turns again;
- a replica SIGKILLed mid-load: only the streams it was sending fail (the router cannot retry a
  response it has begun), everything sent after the kill is answered, and nothing hangs.

Bounded: a few dozen requests of at most 48 tokens per test, every wait with a timeout; no
replica logs a traceback. Skipped, saying why, where the router cannot be imported."""

import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest
from serving import engine_flags, kill_group, metrics, running_server, wait_until_idle

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/

from benchmarks.fleet import router_command, router_missing, wait_router  # noqa: E402
from benchmarks.serve import free_port  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(router_missing() is not None, reason=str(router_missing())),
]

NAME = "tiny"
ENGINE = dict(device="cpu", max_model_len=1024, num_kvcache_blocks=600, kvcache_block_size=16)
REPLICA_FLAGS = ["--served-model-name", NAME, "--shutdown-timeout", "30", *engine_flags(**ENGINE)]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TIMEOUT_S = 30  # any one request; a request that hangs fails the test here
LOAD_TOKENS = 48


class Fleet:
    """The replicas (tests/serving.py's Running) and the router, started once for the module;
    a test that stops a replica starts it again on its port before it ends."""

    def __init__(self, checkpoint: Path, stack: ExitStack):
        self.checkpoint, self.stack = checkpoint, stack
        self.started = []  # every replica process, restarted ones' predecessors too
        self.replicas = [self.start_replica(free_port()) for _ in range(2)]
        self.router_log = tempfile.NamedTemporaryFile("w+", prefix="vllm-router-", suffix=".log")
        stack.callback(self.router_log.close)
        port = free_port()
        workers = [replica.url for replica in self.replicas]
        self.router = subprocess.Popen(
            router_command(workers, port),
            stdout=self.router_log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        stack.callback(self.stop_router)
        self.url = f"http://127.0.0.1:{port}"
        wait_router(self.url, self.router, timeout_s=60)

    def start_replica(self, port: int):
        flags = ["--port", str(port), *REPLICA_FLAGS]  # after running_server's --port 0
        running = self.stack.enter_context(running_server(self.checkpoint, *flags, env=ONE_THREAD))
        self.started.append(running)
        return running

    def restart(self, i: int) -> None:
        """Replica i again, on its port, once the old process has gone; until the router's
        health checks have found it back (what a rolling restart waits for before the next)."""
        old = self.replicas[i]
        old.proc.wait(timeout=60)
        self.replicas[i] = self.start_replica(old.port)
        deadline = time.monotonic() + 20
        while not self.router_sees_healthy(old.url):
            assert time.monotonic() < deadline, "the router never found the replica healthy again"
            time.sleep(0.2)

    def router_sees_healthy(self, worker_url: str) -> bool:
        """The router's own view of a worker (its GET /workers: health checks, not requests)."""
        with urllib.request.urlopen(f"{self.url}/workers", timeout=10) as response:
            workers = json.load(response)["workers"]
        return any(w["url"] == worker_url and w["is_healthy"] for w in workers)

    def holder(self, prompt: str) -> int:
        """Which replica the router sends `prompt` to (a new one: cache_aware's choice),
        from the replicas' counters; the router remembers it there (its prefix tree)."""
        before = [wait_until_idle(r.port)["nanovllm:prompt_tokens_total"] for r in self.replicas]
        with self.client() as client:
            client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
        after = [wait_until_idle(r.port)["nanovllm:prompt_tokens_total"] for r in self.replicas]
        took = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
        assert len(took) == 1, (before, after)
        return took[0]

    def client(self, url: str | None = None) -> openai.OpenAI:
        base = url or self.url
        return openai.OpenAI(
            base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
        )

    def stop_router(self) -> None:
        self.router.terminate()
        try:
            self.router.wait(10)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.router.pid)

    def tracebacks(self) -> list[str]:
        return [r.log.name for r in self.started if "Traceback" in r.log_since(0)]


@pytest.fixture(scope="module")
def fleet(wide_checkpoint):
    with ExitStack() as stack:
        fleet = Fleet(wide_checkpoint, stack)
        yield fleet
        assert fleet.tracebacks() == []


@pytest.fixture(scope="module")
def offline(wide_checkpoint):
    with LLM(str(wide_checkpoint), **ENGINE) as llm:
        yield llm


# -- through the router -----------------------------------------------------------------------


def test_answers_through_the_router_are_the_replicas_own(fleet):
    messages = [{"role": "user", "content": "What does a router do?"}]
    greedy = dict(model=NAME, max_tokens=24, temperature=0)
    with fleet.client() as routed, fleet.client(fleet.replicas[1].url) as direct:
        assert [m.id for m in routed.models.list().data] == [NAME]
        expected = direct.completions.create(prompt="def route(request):", **greedy)
        got = routed.completions.create(prompt="def route(request):", **greedy)
        assert got.choices[0].text == expected.choices[0].text and got.usage == expected.usage
        whole = direct.chat.completions.create(messages=messages, **greedy).choices[0]
        chunks = list(routed.chat.completions.create(messages=messages, stream=True, **greedy))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_bad_input_through_the_router_gets_a_4xx(fleet):
    base = dict(model=NAME, prompt="x", max_tokens=4)
    with fleet.client() as client:
        # What the router passes on, the replica refuses: 400 and OpenAI's body, streamed or not.
        for bad, param in (
            ({"temperature": -1}, "temperature"),
            ({"max_tokens": 5000}, "max_tokens"),
            ({"extra_body": {"include_stop_str_in_output": "yes"}}, "include_stop_str_in_output"),
            ({"extra_body": {"response_format": 5}}, "response_format"),
        ):
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as refused:
                    client.completions.create(**{**base, **bad}, stream=stream)
                assert refused.value.body["param"] == param
                assert refused.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as refused:
            client.completions.create(**{**base, "model": "another"})
        assert refused.value.body["code"] == "model_not_found"
        # A field the router reads itself (its request types are Rust structs) with the wrong
        # type is refused there, before any replica: 422 and its words, not OpenAI's body.
        for bad in ({"max_tokens": "four"}, {"temperature": "hot"}):
            with pytest.raises(openai.UnprocessableEntityError) as refused:
                client.completions.create(**{**base, **bad})
            assert next(iter(bad)) in refused.value.body
    assert fleet.tracebacks() == []


# -- conversations and the prefix cache -------------------------------------------------------


def conversations(num: int, turns: int) -> list[list[str]]:
    """Each conversation's user messages: the first long (its own from the first words on),
    then short ones."""
    rng = random.Random(42)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    return [[text(60)] + [text(8) for _ in range(turns - 1)] for _ in range(num)]


async def converse(url: str, talks: list[list[str]]) -> None:
    """Every conversation at once, each one turn after another (greedy answers)."""
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
    ) as client:

        async def talk(user_messages: list[str]) -> None:
            messages = []
            for content in user_messages:
                messages.append({"role": "user", "content": content})
                out = await client.chat.completions.create(
                    model=NAME, messages=messages, max_tokens=8, temperature=0
                )
                messages.append({"role": "assistant", "content": out.choices[0].message.content})

        await asyncio.gather(*(talk(user_messages) for user_messages in talks))


def hits_on_one_engine(llm: LLM, talks: list[list[str]]) -> int:
    """The prefix-cache hits of the same conversations on one engine: what each turn finds
    where its conversation's earlier turns ran."""
    hits, greedy = 0, SamplingParams(temperature=0, max_tokens=8)
    for user_messages in talks:
        messages = []
        for content in user_messages:
            messages.append({"role": "user", "content": content})
            out = llm.chat(messages, greedy, use_tqdm=False)[0]
            hits += out.num_cached_tokens
            messages.append({"role": "assistant", "content": out.outputs[0].text})
    return hits


def test_conversations_stay_on_the_replica_that_holds_their_prefix(fleet, offline):
    talks = conversations(num=4, turns=3)
    expected = hits_on_one_engine(offline, talks)
    assert expected > 0
    before = [wait_until_idle(r.port) for r in fleet.replicas]
    asyncio.run(converse(fleet.url, talks))
    after = [wait_until_idle(r.port) for r in fleet.replicas]

    def delta(name: str) -> list[float]:
        return [a[f"nanovllm:{name}"] - b[f"nanovllm:{name}"] for a, b in zip(after, before)]

    assert all(served > 0 for served in delta("prompt_tokens_total"))  # both replicas took some
    assert sum(delta("prefix_cache_hits_total")) == expected


# -- a replica drained, a replica killed ------------------------------------------------------


async def load(url: str, seconds: float, clients: int, signal_at: float, act) -> list[dict]:
    """`clients` clients sending requests one after another for `seconds`, half streamed; `act`
    is called after `signal_at` seconds. Each request's start, end, kind and outcome."""
    done: list[dict] = []
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
    ) as client:
        start = time.monotonic()

        async def one(i: int, n: int) -> dict:
            streamed = (i + n) % 2 == 0
            request = dict(
                model=NAME,
                prompt=f"client {i}, request {n}: def main():",
                max_tokens=LOAD_TOKENS,
                extra_body={"ignore_eos": True},
            )
            record = {"start": time.monotonic() - start, "streamed": streamed}
            try:
                if streamed:
                    tokens, finish = 0, None
                    stream = await client.completions.create(
                        **request, stream=True, stream_options={"include_usage": True}
                    )
                    async for chunk in stream:
                        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
                        finish = chunk.choices[0].finish_reason if chunk.choices else finish
                else:
                    out = await client.completions.create(**request)
                    tokens, finish = out.usage.completion_tokens, out.choices[0].finish_reason
                record["outcome"] = (tokens, finish)
            except openai.APIError as e:
                record["outcome"] = type(e).__name__
            record["end"] = time.monotonic() - start
            return record

        async def client_loop(i: int) -> None:
            n = 0
            while time.monotonic() - start < seconds:
                done.append(await one(i, n))
                n += 1

        async def signal_later() -> None:
            await asyncio.sleep(signal_at)
            act()

        await asyncio.gather(signal_later(), *(client_loop(i) for i in range(clients)))
    return done


COMPLETE = (LOAD_TOKENS, "length")
HELD = "A conversation the router remembers on one replica: " + "omega " * 40


def test_a_replica_drained_mid_load_loses_no_request(fleet):
    i = fleet.holder(HELD)
    drained = fleet.replicas[i]
    offset = drained.log_size()
    done = asyncio.run(
        load(
            fleet.url,
            4,
            clients=6,
            signal_at=1,
            act=lambda: drained.proc.send_signal(signal.SIGTERM),
        )
    )
    assert len(done) >= 12 and [r for r in done if r["outcome"] != COMPLETE] == []
    assert drained.proc.wait(timeout=30) == 0
    log = drained.log_since(offset)
    assert "drained: every request finished" in log and "Traceback" not in log
    # A rolling restart: once back, the replica gets its conversations' next turns again.
    fleet.restart(i)
    with fleet.client() as client:
        client.completions.create(model=NAME, prompt=HELD + "and a next turn", max_tokens=1)
    assert metrics(fleet.replicas[i].port)["nanovllm:prompt_tokens_total"] > 0


def test_a_replica_killed_mid_load_fails_only_its_streams_and_nothing_hangs(fleet):
    killed = fleet.replicas[1]
    at = 1.0
    done = asyncio.run(load(fleet.url, 4, clients=6, signal_at=at, act=killed.proc.kill))
    failed = [r for r in done if r["outcome"] != COMPLETE]
    # The router retries a request that got no answer (a refused or reset connection, a 5xx)
    # on another replica; a stream the killed replica had begun cannot be retried: cut.
    assert all(r["streamed"] and r["start"] < at < r["end"] for r in failed), failed
    assert all(r["outcome"] == "APIConnectionError" for r in failed)
    after = [r for r in done if r["start"] > at + 0.1]
    assert len(after) >= 6 and all(r["outcome"] == COMPLETE for r in after)
    assert all(r["end"] - r["start"] < TIMEOUT_S for r in done)
    fleet.restart(1)
