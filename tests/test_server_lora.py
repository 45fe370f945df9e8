"""LoRA adapters on the server, as a client sees them: a real `python -m nanovllm serve
--enable-lora --lora-modules ...` process driven by the official `openai` client, the request's
`model` choosing the adapter. The oracle: PEFT's greedy tokens (transformers + PEFT) under each
adapter, which the offline LLM gives (tests/test_lora.py), and the server's text is the offline
LLM's. Adapters loaded and unloaded at run time; bad ones refused with OpenAI's error body."""

import asyncio
import json
import urllib.error
import urllib.request
from typing import NamedTuple

import openai
import pytest
from serving import ENGINE, NAME, engine_flags, running_server

from nanovllm import LLM, SamplingParams
from nanovllm.lora.request import LoRARequest

pytest.importorskip("peft")
from peft_adapters import ALL, build_adapter, peft_greedy  # noqa: E402

PROMPT = [5, 17, 230, 41, 9, 77]
TOKENS = 10
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
LORA_FLAGS = ["--enable-lora", *engine_flags(max_loras=2, max_lora_rank=8)]
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture(scope="module")
def adapters(bos_checkpoint, tmp_path_factory):
    """sql: rank 8 on every target; chat: rank 4 on q, v and down; late: rank 8, loaded at run
    time; wide: rank 16, above the server's --max-lora-rank."""
    root = tmp_path_factory.mktemp("served_adapters")
    return {
        "sql": build_adapter(bos_checkpoint, root / "sql", 8, ALL, seed=11),
        "chat": build_adapter(
            bos_checkpoint, root / "chat", 4, ["q_proj", "v_proj", "down_proj"], 12
        ),
        "late": build_adapter(bos_checkpoint, root / "late", 8, ["o_proj", "up_proj"], 13),
        "wide": build_adapter(bos_checkpoint, root / "wide", 16, ["q_proj"], 14),
    }


@pytest.fixture(scope="module")
def server(bos_checkpoint, adapters):
    modules = [
        f"sql={adapters['sql']}",
        json.dumps({"name": "chat", "path": str(adapters["chat"])}),
    ]
    flags = ["--served-model-name", NAME, "--lora-modules", *modules]
    flags += engine_flags(**ENGINE) + LORA_FLAGS
    with running_server(bos_checkpoint, *flags, env=RUNTIME) as running:
        yield running


@pytest.fixture(scope="module")
def offline(bos_checkpoint, adapters):
    """The offline LLM's greedy text and tokens per served name, each checked against PEFT."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    names = {NAME: None, "sql": 1, "chat": 2, "late": 3}
    found = {}
    with LLM(str(bos_checkpoint), **ENGINE, **LORA) as llm:
        for name, lora_int_id in names.items():
            path = adapters.get(name)
            request = None if path is None else LoRARequest(name, lora_int_id, str(path))
            out = llm.generate([PROMPT], params, use_tqdm=False, lora_request=request)[0]
            assert out.outputs[0].token_ids == peft_greedy(bos_checkpoint, path, PROMPT, TOKENS)
            found[name] = out.outputs[0].text
    assert len(set(found.values())) == len(found), "each adapter changes the text"
    return found


@pytest.fixture
def client(server):
    with server.client() as client:
        yield client


def complete(client: openai.OpenAI, model: str) -> str:
    got = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.model == model
    return got.choices[0].text


class Answer(NamedTuple):
    status_code: int
    text: str

    def json(self) -> dict:
        return json.loads(self.text)


def post(server, path: str, body: dict) -> Answer:
    request = urllib.request.Request(
        f"{server.url}/v1/{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Answer(response.status, response.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())


def test_models_lists_the_base_and_each_adapter(client, adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {NAME, "sql", "chat"}
    for name in ("sql", "chat"):
        assert cards[name].model_extra["root"] == str(adapters[name])
        assert cards[name].model_extra["parent"] == NAME


def test_the_model_field_chooses_the_adapter_as_peft_computes_it(client, offline):
    for name in (NAME, "sql", "chat"):
        assert complete(client, name) == offline[name]


def test_requests_of_every_adapter_at_once_share_steps_and_each_is_right(server, offline):
    async def run() -> list[tuple[str, str]]:
        async with server.client(openai.AsyncOpenAI) as client:

            async def one(model: str) -> tuple[str, str]:
                got = await client.completions.create(
                    model=model,
                    prompt=PROMPT,
                    max_tokens=TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                return model, got.choices[0].text

            return await asyncio.gather(*(one(m) for m in [NAME, "sql", "chat"] * 3))

    for model, text in asyncio.run(run()):
        assert text == offline[model], model


def test_a_streamed_chat_under_an_adapter_is_its_whole_reply(client):
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=TOKENS, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="sql", messages=messages, max_tokens=TOKENS, temperature=0, stream=True
        )
    )
    assert all(chunk.model == "sql" for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and whole.model == "sql"


def test_an_unknown_model_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as raised:
        complete(client, "no-such-adapter")
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "sql" in error["message"] and "chat" in error["message"]


def test_an_adapter_loaded_at_run_time_serves_and_unloaded_is_gone(
    server, client, adapters, offline
):
    loaded = post(
        server, "load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}
    )
    assert loaded.status_code == 200, loaded.text
    assert "late" in {card.id for card in client.models.list().data}
    # three adapters over two slots: they take turns, each right
    for name in ("late", "sql", "chat", "late"):
        assert complete(client, name) == offline[name]
    again = post(
        server, "load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    unloaded = post(server, "unload_lora_adapter", {"lora_name": "late"})
    assert unloaded.status_code == 200, unloaded.text
    assert "late" not in {card.id for card in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "late")
    gone = post(server, "unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "adapter_config.json"),
        ({"lora_name": "x", "lora_path": "WIDE"}, 400, "rank"),
        ({"lora_name": "x"}, 400, "'lora_path' is required"),
        ({"lora_name": 7, "lora_path": "/x"}, 400, "'lora_name' must be a non-empty string"),
        ({"lora_name": NAME, "lora_path": "WIDE"}, 400, "already been loaded"),
    ],
)
def test_a_bad_adapter_is_refused_and_the_server_serves_on(
    server, client, adapters, offline, body, status, words
):
    if body.get("lora_path") == "WIDE":
        body = dict(body, lora_path=str(adapters["wide"]))
    refused = post(server, "load_lora_adapter", body)
    assert refused.status_code == status, refused.text
    error = refused.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert {card.id for card in client.models.list().data} == {NAME, "sql", "chat"}
    assert complete(client, "sql") == offline["sql"]
    assert "Traceback" not in server.log.read_text()


@pytest.mark.slow
def test_without_the_runtime_switch_there_are_no_load_routes(bos_checkpoint, adapters):
    flags = ["--served-model-name", NAME, "--lora-modules", f"sql={adapters['sql']}"]
    with running_server(bos_checkpoint, *flags, *engine_flags(**ENGINE), *LORA_FLAGS) as running:
        body = {"lora_name": "late", "lora_path": str(adapters["late"])}
        assert post(running, "load_lora_adapter", body).status_code == 404


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lora-modules", "sql"], "expected name=path"),
        (["--lora-modules", "sql=/no/such/adapter"], "--lora-modules sql=/no/such/adapter"),
        (["--no-enable-lora", "--lora-modules", "sql=/x"], "--lora-modules needs --enable-lora"),
    ],
)
def test_bad_lora_modules_stop_the_server_with_a_usage_error(bos_checkpoint, flags, words):
    import subprocess
    import sys

    command = [sys.executable, "-m", "nanovllm", "serve", str(bos_checkpoint), "--port", "0"]
    command += engine_flags(**ENGINE) + LORA_FLAGS + flags
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
