"""The OpenAI-compatible server, as a client sees it: a real `python -m nanovllm serve`
process on 127.0.0.1 (a port the OS picks), driven by the official `openai` client, its
answers checked against the offline LLM on the same checkpoint. Every server started here
is stopped here; every wait is bounded."""

import asyncio
import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import torch
from conftest import hf_model
from serving import (
    ENGINE,
    NAME,
    engine_flags,
    live_processes,
    metrics,
    running_server,
    wait_until_idle,
)

from nanovllm import LLM, SamplingParams
from nanovllm.demo import DEMO_MARKER, DOWNLOAD_COMMAND

USER = [{"role": "user", "content": "def main():"}]


@pytest.fixture(scope="module")
def offline(bos_checkpoint):
    with LLM(str(bos_checkpoint), **ENGINE) as llm:
        yield llm


@pytest.fixture
def client(server):
    with server.client() as client:
        yield client


def greedy(max_tokens: int, **params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)


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
            base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0
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
        for top, entry, token in zip(
            choice.logprobs.top_logprobs, output.logprobs, output.token_ids
        ):
            # OpenAI's "up to logprobs + 1": the top 2 and the sampled token
            expected_top = [lp for lp in entry.values() if lp.rank <= 2] + [entry[token]]
            assert top == {lp.decoded_token: pytest.approx(lp.logprob) for lp in expected_top}


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


# -- what evaluation harnesses send: echo with logprobs, /tokenize and /detokenize ---------------


def hf_logprob_rows(path, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is transformers' log_softmax for the token after position i."""
    with torch.inference_mode():
        logits = hf_model(str(path))(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def test_lm_eval_loglikelihood_requests_score_as_transformers(client, offline, bos_checkpoint):
    """lm-eval 0.4.13's local-completions, loglikelihood and loglikelihood_rolling alike: a
    batch of token-id windows, temperature 0, max_tokens 1, logprobs 1, seed 1234, echo; it
    reads token_logprobs[ctxlen:-1] (summed) and, for is_greedy, top_logprobs[ctxlen:-1]."""
    tokenizer = offline.tokenizer
    context = tokenizer.encode("def parse(text):")  # with the BOS, as lm-eval's prefix token
    greedy_ids = offline.generate([context], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    windows = [
        context + tokenizer.encode(" return x", add_special_tokens=False),
        context + greedy_ids,
    ]
    got = client.completions.create(
        model=NAME, prompt=windows, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True
    )
    assert got.usage.prompt_tokens == sum(map(len, windows)) and got.usage.completion_tokens == 2
    for choice, window in zip(sorted(got.choices, key=lambda c: c.index), windows):
        rows = hf_logprob_rows(bos_checkpoint, window)
        lp, ctxlen = choice.logprobs, len(context)
        assert len(lp.token_logprobs) == len(window) + 1  # the prompt, then the completion
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [rows[i - 1, t].item() for i, t in enumerate(window) if i > 0]
        assert lp.token_logprobs[1 : len(window)] == pytest.approx(expected, abs=1e-4)
        # lm-eval's answer: the continuation's logprob and whether it is the greedy one
        assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(
            sum(expected[ctxlen - 1 :]), abs=1e-3
        )
        is_greedy = all(
            tok == max(top.values())
            for tok, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1])
        )
        hf_greedy = all(rows[i - 1].argmax() == window[i] for i in range(ctxlen, len(window)))
        assert is_greedy == hf_greedy
        # the echoed text, its tokens and where each begins
        prompt_text = tokenizer.decode(window)
        assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
        assert lp.tokens[: len(window)] == [tokenizer.decode([t]) for t in window]
        assert "".join(lp.tokens[: len(window)]) == prompt_text
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(window) + 1)]
        assert lp.text_offset[len(window)] == len(prompt_text)  # the completion follows
    assert is_greedy  # the last window continues greedily: lm-eval must see it so


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, offline, bos_checkpoint):
    """The text-prompt form (lm-eval's tokenized_requests=False; older harnesses send
    max_tokens 0): the prompt's text as sent, its tokens' logprobs, no completion."""
    prompt = "def parse(text):"
    ids = offline.tokenizer.encode(prompt)  # the BOS first
    got = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=0, logprobs=0, echo=True, temperature=0
    )
    choice = got.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 0
    rows = hf_logprob_rows(bos_checkpoint, ids)
    expected = [rows[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert choice.logprobs.tokens == [offline.tokenizer.decode([t]) for t in ids]
    plain = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )
    assert plain.choices[0].text == prompt + expected[0].outputs[0].text
    assert plain.choices[0].logprobs is None


def post(server, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_tokenize_and_detokenize_answer_as_vllms(server, offline):
    tokenizer = offline.tokenizer
    text = "def parse(text):"
    ids = tokenizer.encode(text)
    assert post(server, "/tokenize", {"prompt": text}) == (
        200,
        {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None},
    )
    status, got = post(
        server,
        "/tokenize",
        {"prompt": text, "add_special_tokens": False, "return_token_strs": True},
    )
    assert got["tokens"] == ids[1:] == tokenizer.encode(text, add_special_tokens=False)
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids[1:])
    chat = offline.chat(USER, greedy(1), use_tqdm=False)[0]
    status, got = post(server, "/tokenize", {"model": NAME, "messages": USER})
    assert got["tokens"] == chat.prompt_token_ids  # the template's, no second BOS
    assert post(server, "/detokenize", {"tokens": ids}) == (200, {"prompt": tokenizer.decode(ids)})
    status, got = post(server, "/detokenize", {"tokens": [1, 10**6]})
    assert status == 400 and got["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404


# -- errors ---------------------------------------------------------------------------------


def test_bad_requests_get_400_with_an_error_body_and_the_server_keeps_serving(client, server):
    cases = [  # (request, the field named, words of the message)
        (dict(prompt="x", temperature=-1), "temperature", ""),
        (dict(prompt="x", max_tokens="ten"), "max_tokens", ""),
        (dict(prompt="word " * 600), "prompt", "max_model_len=512"),  # 601 tokens
        (dict(prompt=[[1, 2], "x", 3]), "prompt", "holds a int"),
        (dict(prompt=[1, 2.5]), "prompt", "token ids must be ints, got float (2.5)"),
        (dict(prompt=["x", [1, 10**6]]), "prompt", "prompt 1: token id 1000000 is outside"),
        (dict(prompt=["x"] * 513), "prompt", "max_num_seqs=512"),
        (dict(prompt="x", echo=True, stream=True), "echo", "without stream"),
        (dict(prompt="x", logit_bias={"5": 101}), "logit_bias", ""),
        (dict(prompt="x", logit_bias={"five": 1}), "logit_bias", ""),
        (dict(prompt="x", logit_bias={str(10**6): 1}), "logit_bias", ""),  # past the vocab
        (dict(prompt="x", extra_body={"stop_token_ids": [10**6]}), "stop_token_ids", ""),
        (dict(prompt="x", logprobs=21), "logprobs", "max_logprobs=20"),  # vLLM's default cap
        (dict(prompt="x", max_tokens=2**40), "max_tokens", "max_model_len=512"),
        (dict(prompt="x", max_tokens=10**9), "max_tokens", "max_model_len=512"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=NAME, **kwargs)
        error = caught.value.body
        assert error["type"] == "invalid_request_error" and words in error["message"]
        assert error["param"] == param, error
    for kwargs, param, words in [
        (dict(messages=[{"content": "no role"}]), "messages", "role"),
        (dict(messages=USER, max_completion_tokens="5"), "max_completion_tokens", "an int"),
        (dict(messages=USER, max_completion_tokens=2**70), "max_completion_tokens", "=512"),
        (dict(messages=USER, logprobs=True, top_logprobs=21), "top_logprobs", ""),
        (dict(messages=USER, extra_body={"echo": True}), "echo", "/v1/completions"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=NAME, **kwargs)
        assert caught.value.body["param"] == param and words in caught.value.body["message"]
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
        ("POST", "/v1/completions", b'{"prompt": "ab\\ud800c"}', 400),  # a lone surrogate
        ("GET", "/v1/nowhere", None, 404),
    ):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request(method, path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == status
        assert set(json.loads(response.read())["error"]) == {"message", "type", "param", "code"}
        connection.close()


# -- lifecycle --------------------------------------------------------------------------------


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
        assert response.status == 200
    before = wait_until_idle(server.port)
    got = client.completions.create(
        model=NAME, prompt="for i in", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = wait_until_idle(server.port)
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


def test_the_prefix_cache_counters_count_a_repeated_prompts_hits(client, server, offline):
    ids = [7 + (i * 37) % 400 for i in range(50)]  # a prompt no other test sends
    offline.generate([ids], greedy(1), use_tqdm=False)
    cached = offline.generate([ids], greedy(1), use_tqdm=False)[0].num_cached_tokens
    assert cached >= 32  # its full blocks, the last token's aside
    before = wait_until_idle(server.port)
    for _ in range(2):
        client.completions.create(model=NAME, prompt=ids, max_tokens=1)
    after = wait_until_idle(server.port)
    assert after["nanovllm:prefix_cache_queries_total"] - before[
        "nanovllm:prefix_cache_queries_total"
    ] == 2 * len(ids)
    assert (
        after["nanovllm:prefix_cache_hits_total"] - before["nanovllm:prefix_cache_hits_total"]
        == cached  # the first request found nothing, the second what the offline engine did
    )


def test_a_client_that_drops_its_stream_has_its_request_aborted(client, server):
    before = wait_until_idle(server.port)
    stream = client.completions.create(
        model=NAME, prompt="x", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
    )
    for _ in zip(range(3), stream):
        pass
    assert metrics(server.port)["nanovllm:num_requests_running"] == 1
    stream.close()
    after = wait_until_idle(server.port)
    generated = (
        after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"]
    )
    assert 3 <= generated < 480  # aborted, not run to the end
    assert after["nanovllm:kv_cache_usage_perc"] == 0  # its blocks are free


def test_a_client_that_leaves_a_whole_response_has_its_request_aborted_quietly(server):
    """Aborted, with one INFO line in the server's log and no traceback; a client that
    leaves halfway through its request's body gets the same."""
    before, log_start = wait_until_idle(server.port), server.log_size()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "x", "max_tokens": 480, "ignore_eos": True}),
        {"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 10
    while (
        metrics(server.port)["nanovllm:num_requests_running"] == 0 and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    connection.close()
    generated = (
        wait_until_idle(server.port)["nanovllm:generation_tokens_total"]
        - before["nanovllm:generation_tokens_total"]
    )
    assert 0 < generated < 480
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as half:
        half.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
        time.sleep(0.2)
    lines = wait_for_log_lines(server, log_start, 2)
    assert not any("Traceback" in line or "ERROR" in line for line in lines), lines
    assert lines == [
        "INFO:     /v1/completions: the client went away; its request was aborted",
        "INFO:     /v1/completions: the client went away while sending its request",
    ]


def wait_for_log_lines(server, start: int, count: int, timeout_s: float = 10) -> list[str]:
    """The server's log lines from `start`, but the access lines of /metrics (which the test
    polls), once there are `count` (or the timeout has passed)."""

    def lines() -> list[str]:
        return [line for line in server.log_since(start).splitlines() if "/metrics" not in line]

    deadline = time.monotonic() + timeout_s
    while len(lines()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # a line too many would show now
    return lines()


@pytest.mark.slow
def test_sigterm_ends_open_streams_and_exits_0_leaving_no_process(checkpoints):
    flags = engine_flags(**ENGINE, tensor_parallel_size=2)  # a TP worker must be stopped too
    with running_server(checkpoints["gqa"], *flags) as (proc, port, _):
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


@pytest.mark.slow
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
    assert "demo checkpoint" not in result.stderr


@pytest.mark.slow
def test_serving_the_random_demo_checkpoint_warns_that_its_text_is_noise(checkpoints, tmp_path):
    demo = shutil.copytree(checkpoints["gqa"], tmp_path / "demo")
    (demo / DEMO_MARKER).write_text("random weights\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanovllm",
            "serve",
            str(demo),
            "--port",
            "0",
            "--max-num-seqs",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # told before the engine is built, which this bad option then stops
    assert result.returncode == 2 and "max_num_seqs" in result.stderr
    assert "tiny demo checkpoint: its weights are random" in result.stderr
    assert DOWNLOAD_COMMAND in result.stderr
