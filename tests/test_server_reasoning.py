"""Thinking mode on the server, as the official `openai` client sees it, on a checkpoint that
thinks as Qwen3 does (tests/thinking.py): the request's chat_template_kwargs reach the chat
template."""

import json
import urllib.error
import urllib.request

import openai
import pytest
from serving import engine_flags, running_server

NAME = "tiny"
ENGINE = dict(device="cpu", max_model_len=512, num_kvcache_blocks=96, kvcache_block_size=16)
USER = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def server(thinking_checkpoint):
    flags = ["--served-model-name", NAME, *engine_flags(**ENGINE)]
    with running_server(thinking_checkpoint, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0
    ) as client:
        yield client


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rendered(server, **kwargs) -> str:
    """The prompt the server renders for USER, as /tokenize and /detokenize give it back."""
    status, tokens = post(server, "/tokenize", {"messages": USER, **kwargs})
    assert status == 200, tokens
    return post(server, "/detokenize", {"tokens": tokens["tokens"]})[1]["prompt"]


def test_chat_template_kwargs_reach_the_template(server, client):
    default = rendered(server)
    off = rendered(server, chat_template_kwargs={"enable_thinking": False})
    assert default.endswith("<|im_start|>assistant\n")
    assert off == default + "<think>\n\n</think>\n\n"
    for kwargs, prompt in (({"enable_thinking": False}, off), ({"enable_thinking": True}, default)):
        reply = client.chat.completions.create(
            model=NAME,
            messages=USER,
            max_tokens=2,
            extra_body={"chat_template_kwargs": kwargs},
        )
        counted = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False})[1]
        assert reply.usage.prompt_tokens == counted["count"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (["enable_thinking"], "chat_template_kwargs must be an object"),
        ({"tokenize": True}, "chat_template_kwargs may not set tokenize"),
        (
            {"messages": [], "add_generation_prompt": False},
            "may not set add_generation_prompt, messages",
        ),
    ],
)
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
        )
    assert message in refused.value.body["message"]
    assert refused.value.body["param"] == "chat_template_kwargs"
