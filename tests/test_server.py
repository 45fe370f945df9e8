"""The OpenAI-compatible server, as a client sees it: a real `python -m nanovllm serve`
process on 127.0.0.1 (a port the OS picks), driven by the official `openai` client, its
answers checked against the offline LLM on the same checkpoint. Every server started here
is stopped here; every wait is bounded."""

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from nanovllm import LLM, SamplingParams

NAME = "tiny"  # --served-model-name
ENGINE = dict(device="cpu", max_model_len=512, num_kvcache_blocks=96, kvcache_block_size=16)
START_TIMEOUT_S = 90
USER = [{"role": "user", "content": "def main():"}]


def engine_flags(**engine: object) -> list[str]:
    return [x for k, v in engine.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@contextmanager
def running_server(model: Path, *flags: str):
    """A server process in a session of its own (so nothing of it can outlive the test):
    yields (process, port); SIGTERM at the end, SIGKILL to the group if that fails."""
    log = tempfile.NamedTemporaryFile("w+", prefix="nanovllm-serve-", suffix=".log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm", "serve", str(model), "--port", "0", *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc, wait_for_port(proc, Path(log.name))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        kill_group(proc.pid)
        log.close()


def wait_for_port(proc: subprocess.Popen, log: Path) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", log.read_text())
        if found:
            return int(found.group(1))
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"no server after {START_TIMEOUT_S}s:\n{log.read_text()}")


def live_processes(pgid: int) -> list[str]:
    """The processes of a process group that have not exited (zombies are left out: who
    reaps an orphan, and when, is up to this machine's init). Linux's /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        state, _, group = text.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state != "Z":
            found.append(text)
    return found


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def server(bos_checkpoint):
    """One server for the module. The checkpoint's tokenizer adds a BOS to text, so
    completions (which add it, as LLM.generate does) and chat (whose template is rendered
    without it, as LLM.chat does) tokenize differently."""
    with running_server(bos_checkpoint, "--served-model-name", NAME, *engine_flags(**ENGINE)) as (
        proc,
        port,
    ):
        yield port


@pytest.fixture(scope="module")
def offline(bos_checkpoint):
    with LLM(str(bos_checkpoint), **ENGINE) as llm:
        yield llm


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", timeout=60, max_retries=0
    ) as client:
        yield client


def greedy(max_tokens: int, **params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(nanovllm:\w+)\{[^}]*\} (\S+)$", text, re.M)}


def wait_until_idle(port: int, timeout_s: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        figures = metrics(port)
        if figures["nanovllm:num_requests_running"] == 0:
            return figures
        time.sleep(0.05)
    raise AssertionError(f"still running after {timeout_s}s: {figures}")


# -- results equal the offline engine's ---------------------------------------------------


def test_a_greedy_completion_is_the_offline_generation(client, offline):
    for prompt in ("def parse(text):", [5, 17, 230, 41, 9]):
        expected = offline.generate([prompt], greedy(20), use_tqdm=False)[0]
        got = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.object == "text_completion" and got.id.startswith("cmpl-")
        assert got.choices[0].text == expected.outputs[0].text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert (
            got.usage.completion_tokens == 20
            and got.usage.total_tokens == got.usage.prompt_tokens + 20
        )


def test_a_streamed_completion_concatenates_to_the_offline_text(client, offline):
    expected = offline.generate(["import os"], greedy(24), use_tqdm=False)[0].outputs[0]
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="import os",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_streamed_chat_deltas_concatenate_to_the_message_and_to_llm_chat(client, offline):
    expected = offline.chat(USER, greedy(24), use_tqdm=False)[0]
    whole = client.chat.completions.create(
        model=NAME,
        messages=USER,
        max_completion_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=USER,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)  # no second BOS
    assert (
        chunks[0].object == "chat.completion.chunk"
        and chunks[0].choices[0].delta.role == "assistant"
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sixteen_concurrent_clients_each_get_their_offline_result(server, offline):
    prompts = [f"def f{i}(x, y={i}):" for i in range(16)]
    lengths = [8 + i for i in range(16)]
    expected = offline.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, stream: bool) -> str:
        kwargs = dict(
            model=NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        if not stream:
            return (await client.completions.create(**kwargs)).choices[0].text
        return "".join(
            [
                c.choices[0].text
                async for c in await client.completions.create(stream=True, **kwargs)
            ]
        )

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", timeout=120, max_retries=0
        ) as client:
            return await asyncio.gather(
                *(one(client, p, n, i % 2 == 0) for i, (p, n) in enumerate(zip(prompts, lengths)))
            )

    assert asyncio.run(all_of_them()) == [out.outputs[0].text for out in expected]


def test_n_seeded_samples_and_logprobs_are_the_offline_ones(client, offline):
    params = SamplingParams(
        temperature=0.8, top_k=20, seed=11, n=2, max_tokens=6, ignore_eos=True, logprobs=2
    )
    expected = offline.generate(["class A:"], params, use_tqdm=False)[0].outputs
    got = client.completions.create(
        model=NAME,
        prompt="class A:",
        n=2,
        temperature=0.8,
        seed=11,
        max_tokens=6,
        logprobs=2,
        extra_body={"top_k": 20, "ignore_eos": True},
    )
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [o.text for o in expected]
    assert got.usage.completion_tokens == 12
    for choice, output in zip(got.choices, expected):
        chosen = [entry[t] for t, entry in zip(output.token_ids, output.logprobs)]
        assert choice.logprobs.tokens == [lp.decoded_token for lp in chosen]
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in chosen])
        assert [len(top) for top in choice.logprobs.top_logprobs] == [2] * 6


def test_chat_logprobs_give_each_token_and_its_top_alternatives(client, offline):
    expected = offline.chat(USER, greedy(5, logprobs=3), use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(
        model=NAME,
        messages=USER,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = got.choices[0].logprobs.content
    assert [t.token for t in content] == [
        expected.logprobs[i][t].decoded_token for i, t in enumerate(expected.token_ids)
    ]
    for item, entry in zip(content, expected.logprobs):
        ranked = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [t.token for t in item.top_logprobs] == [lp.decoded_token for lp in ranked]
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6
        assert item.bytes == list(item.token.encode())


def test_a_stop_string_split_across_tokens_is_never_partly_streamed(client, offline):
    prompt = "def main():"
    reference = offline.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0]
    pieces = [offline.tokenizer.decode([t]) for t in reference.token_ids]
    assert "".join(pieces) == reference.text  # so a piece boundary is a token boundary
    # A 4-character stop string made of the last 2 characters of a token and the first 2
    # of the next, whose first occurrence is there.
    for k in range(len(pieces) - 1):
        start = len("".join(pieces[: k + 1])) - 2
        stop = reference.text[start : start + 4]
        if min(len(pieces[k]), len(pieces[k + 1])) >= 2 and reference.text.find(stop) == start:
            break
    else:
        pytest.fail(f"no token pair to split a stop string over in {pieces}")
    expected = reference.text[:start]
    assert (
        offline.generate([prompt], greedy(40, stop=[stop]), use_tqdm=False)[0].outputs[0].text
        == expected
    )
    streamed = ""
    for chunk in client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        streamed += chunk.choices[0].text
        assert expected.startswith(streamed), f"streamed {streamed!r} past the stop {stop!r}"
    assert streamed == expected and chunk.choices[0].finish_reason == "stop"


def test_logit_bias_steers_greedy_tokens_as_offline(client, offline):
    plain = offline.generate(["def parse(text):"], greedy(12), use_tqdm=False)[0].outputs[0]
    first = plain.token_ids[0]
    bias = {first: -100, (first + 1) % 256: 4}
    expected = offline.generate(["def parse(text):"], greedy(12, logit_bias=bias), use_tqdm=False)[
        0
    ].outputs[0]
    got = client.completions.create(
        model=NAME,
        prompt="def parse(text):",
        max_tokens=12,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == expected.text != plain.text
    assert first not in expected.token_ids[:1]


# -- errors ---------------------------------------------------------------------------------


def test_bad_requests_get_400_with_an_error_body_and_the_server_keeps_serving(client, server):
    cases = [
        (dict(prompt="x", temperature=-1), "temperature"),
        (dict(prompt="x", max_tokens="ten"), "max_tokens"),
        (dict(prompt="word " * 600), "prompt"),  # longer than max_model_len=512
        (dict(prompt=[[1, 2], "x", 3]), "prompt"),
        (dict(prompt=["x", [1, 10**6]]), "prompt"),  # "prompt 1: token id ... outside"
        (dict(prompt="x", echo=True), "echo"),
        (dict(prompt="x", logit_bias={"5": 101}), "logit_bias"),
        (dict(prompt="x", logit_bias={"five": 1}), "logit_bias"),
        (dict(prompt="x", logit_bias={str(10**6): 1}), "logit_bias"),  # past the vocab
        (dict(prompt="x", extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=NAME, **kwargs)
        error = caught.value.body
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, error
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"content": "no role"}])
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="another-model", prompt="x")
    assert caught.value.body["code"] == "model_not_found"
    assert (
        client.completions.create(model=NAME, prompt="x", max_tokens=3).usage.completion_tokens >= 1
    )


def test_bad_json_and_unknown_paths_get_openai_error_bodies(server):
    for method, path, body, status in (
        ("POST", "/v1/completions", b'{"prompt": ', 400),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400),
        ("GET", "/v1/nowhere", None, 404),
    ):
        connection = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
        connection.request(method, path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == status
        assert set(json.loads(response.read())["error"]) == {"message", "type", "param", "code"}
        connection.close()


# -- lifecycle --------------------------------------------------------------------------------


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    with urllib.request.urlopen(f"http://127.0.0.1:{server}/health", timeout=10) as response:
        assert response.status == 200
    before = wait_until_idle(server)
    got = client.completions.create(
        model=NAME, prompt="for i in", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = wait_until_idle(server)
    assert (
        after["nanovllm:prompt_tokens_total"] - before["nanovllm:prompt_tokens_total"]
        == got.usage.prompt_tokens
    )
    assert (
        after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] == 7
    )
    assert (
        after["nanovllm:num_requests_waiting"] == 0 and after["nanovllm:kv_cache_usage_perc"] == 0
    )


def test_a_client_that_drops_its_stream_has_its_request_aborted(client, server):
    before = wait_until_idle(server)
    stream = client.completions.create(
        model=NAME, prompt="x", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
    )
    for _ in zip(range(3), stream):
        pass
    assert metrics(server)["nanovllm:num_requests_running"] == 1
    stream.close()
    after = wait_until_idle(server)
    generated = (
        after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"]
    )
    assert 3 <= generated < 480  # aborted, not run to the end
    assert after["nanovllm:kv_cache_usage_perc"] == 0  # its blocks are free


def test_a_client_that_leaves_a_whole_response_has_its_request_aborted(server):
    before = wait_until_idle(server)
    connection = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "x", "max_tokens": 480, "ignore_eos": True}),
        {"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 10
    while metrics(server)["nanovllm:num_requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    connection.close()
    generated = (
        wait_until_idle(server)["nanovllm:generation_tokens_total"]
        - before["nanovllm:generation_tokens_total"]
    )
    assert 0 < generated < 480


def test_sigterm_ends_open_streams_and_exits_0_leaving_no_process(checkpoints):
    flags = engine_flags(**ENGINE, tensor_parallel_size=2)  # a TP worker must be stopped too
    with running_server(checkpoints["gqa"], *flags) as (proc, port):
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0
        ) as client:
            stream = client.completions.create(
                model=str(checkpoints["gqa"]),
                prompt="x",
                max_tokens=480,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in zip(range(3), stream):
                pass
            proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            finish = [c.choices[0].finish_reason for c in stream][-1]
        assert finish == "abort"
        assert proc.wait(timeout=20) == 0 and time.monotonic() - start < 10
        # Nothing is left in the server's session: its TP worker has gone, and so (within
        # moments: it exits when its pipe closes) multiprocessing's resource tracker.
        deadline = time.monotonic() + 5
        while live_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_processes(proc.pid) == []


def test_a_bad_engine_option_is_refused_before_serving(checkpoints):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanovllm",
            "serve",
            str(checkpoints["gqa"]),
            "--port",
            "0",
            "--max-num-seqs",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "max_num_seqs" in result.stderr
