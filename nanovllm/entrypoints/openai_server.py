"""The OpenAI-compatible HTTP server (FastAPI) over an AsyncEngine:

    GET  /health               200 while the engine thread runs
    GET  /v1/models            the one served model
    POST /v1/completions       prompt: text, token ids, or a list of them
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template
    GET  /metrics              Prometheus text: queues, KV-cache use, token counters

`stream: true` answers Server-Sent Events: `data: {chunk}` lines, then `data: [DONE]`.
Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for a bad
request (FastAPI's 422 included), 404 for another model's name or an unknown path.
"""

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import NamedTuple

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from nanovllm.engine.async_engine import AsyncEngine, Delta, RequestStream
from nanovllm.entrypoints import protocol
from nanovllm.entrypoints.protocol import ResponseHead, error_body
from nanovllm.entrypoints.tools import ToolCalling
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


class ModelNotFound(LookupError):
    pass


class Accepted(NamedTuple):
    stream: RequestStream
    params: SamplingParams
    body: dict


def build_app(front: AsyncEngine, model_name: str) -> FastAPI:
    """The app; its lifespan starts the engine thread in uvicorn's event loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front.start()
        yield

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    server = OpenAIServer(front, model_name)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_exception_handler(
        RequestValidationError,
        lambda request, e: error_response(400, f"invalid request: {e.errors()}"),
    )
    app.add_exception_handler(
        HTTPException,
        lambda request, e: error_response(
            e.status_code, f"{request.method} {request.url.path}: {e.detail}"
        ),
    )
    return app


class Server(uvicorn.Server):
    """uvicorn's server that, as it shuts down (once it stops accepting), aborts every
    request in flight, so open streams end now instead of running to their max_tokens."""

    def __init__(self, config: uvicorn.Config, front: AsyncEngine):
        super().__init__(config)
        self.front = front

    async def shutdown(self, sockets: list | None = None) -> None:
        self.front.abort_all()
        await super().shutdown(sockets)


def error_response(status: int, message: str, **fields: str | None) -> JSONResponse:
    return JSONResponse(error_body(message, **fields), status_code=status)


class OpenAIServer:
    def __init__(self, front: AsyncEngine, model_name: str):
        self.front, self.model_name = front, model_name
        self.registry = CollectorRegistry()  # per app, so two apps in a process do not clash
        self.registry.register(EngineMetrics(front, model_name))

    async def health(self) -> Response:
        return Response(status_code=200 if self.front.is_alive() else 503)

    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "nanovllm",
                    "max_model_len": self.front.engine.config.max_model_len,
                }
            ],
        }

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        accepted = await self._accept(request, chat)
        if isinstance(accepted, Response):
            return accepted
        stream, params, body = accepted
        streamed, top_k = bool(body.get("stream")), params.logprobs
        if chat:
            head = ResponseHead(
                "chatcmpl",
                "chat.completion.chunk" if streamed else "chat.completion",
                self.model_name,
            )
            choice = functools.partial(protocol.chat_choice, top_k=top_k, streamed=streamed)
        else:
            head = ResponseHead("cmpl", "text_completion", self.model_name)
            choice = functools.partial(protocol.completion_choice, top_k=top_k)
        calling = ToolCalling.from_body(body) if chat else None  # tools.py reads the text
        if streamed:
            chunks = self._chunks(
                stream, head, choice, protocol.include_usage(body), top_k is not None, chat
            )
            if calling is not None:
                chunks = calling.stream(chunks)
            return EventStream(chunks, on_close=lambda: self.front.abort(stream))
        deltas = await self._collect(request, stream)
        if deltas is None:  # the client left; the request is aborted
            return Response(status_code=499)
        choices = protocol.merge(deltas, stream.num_choices)
        if calling is not None:
            choice = calling.read_calls(choice)
        return JSONResponse(
            head(
                choices=[choice(d) for d in choices],
                usage=protocol.usage(
                    stream.prompt_token_ids, sum(len(d.token_ids) for d in choices)
                ),
            )
        )

    async def _accept(self, request: Request, chat: bool) -> Accepted | Response:
        """Parse and check the request and queue it, or the error response."""
        body: dict = {}
        try:
            body = protocol.parse_body(await request.body())
            protocol.check_fields(body)
            if body.get("model") not in (None, self.model_name):
                raise ModelNotFound(
                    f"The model `{body['model']}` does not exist; this server "
                    f"serves `{self.model_name}`"
                )
            params = protocol.sampling_params(body, chat)
            protocol.include_usage(body)
            prompts = (
                [self._render(body)] if chat else protocol.completion_prompts(body.get("prompt"))
            )
            stream = await self.front.add_request(prompts, params, add_special_tokens=not chat)
        except ModelNotFound as e:
            return error_response(404, str(e), param="model", code="model_not_found")
        except (TypeError, ValueError) as e:
            return error_response(400, str(e), param=protocol.param_of(str(e), body))
        return Accepted(stream, params, body)

    def _render(self, body: dict) -> str:
        """The conversation as the chat template renders it (pure Python, so the event loop
        may run it; the tokenizer proper runs in the engine thread)."""
        messages = protocol.chat_messages(body.get("messages"))
        add_generation_prompt = body.get("add_generation_prompt", True)
        calling = ToolCalling.from_body(body)  # its tools rendered, unless tool_choice is "none"
        try:
            return self.front.tokenizer.apply_chat_template(
                messages,
                tools=None if calling is None else calling.tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as e:
            raise ValueError(f"messages: the chat template failed: {e}") from None

    async def _chunks(
        self,
        stream: RequestStream,
        head: ResponseHead,
        choice: Callable[[Delta], dict],
        with_usage: bool,
        logprobs: bool,
        chat: bool,
    ) -> AsyncIterator[dict]:
        """One chunk per choice per step with new text (or tokens, when logprobs are
        asked for); chat opens each choice with its role; the usage last, if asked."""
        if chat:
            for i in range(stream.num_choices):
                yield head(
                    choices=[
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
        num_tokens = 0
        async for batch in self.front.deltas(stream):
            for delta in batch:
                num_tokens += len(delta.token_ids)
                if delta.text or delta.finish_reason or (logprobs and delta.token_ids):
                    yield head(choices=[choice(delta)])
        if with_usage:
            yield head(choices=[], usage=protocol.usage(stream.prompt_token_ids, num_tokens))

    async def _collect(self, request: Request, stream: RequestStream) -> list[Delta] | None:
        """Every Delta of the stream; None, and the request aborted, if the client leaves."""

        async def collect() -> list[Delta]:
            return [delta async for batch in self.front.deltas(stream) for delta in batch]

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # its deltas() aborts the request
        return work.result() if not work.cancelled() else None


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: what comes is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-Sent Events of JSON chunks, ending with `data: [DONE]`. `on_close` runs however
    the response ends: starlette drops the iterator of a client that has gone, unclosed."""

    def __init__(self, chunks: AsyncIterator[dict], on_close: Callable[[], None]):
        super().__init__(_sse(chunks), media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as e:  # the engine failed mid-stream: the status is sent, say it here
        logger.exception("stream failed")
        yield f"data: {json.dumps(error_body(str(e), type_='internal_error'))}\n\n"
    yield "data: [DONE]\n\n"


class EngineMetrics:
    """A Prometheus collector reading the AsyncEngine's figures at each scrape."""

    def __init__(self, front: AsyncEngine, model_name: str):
        self.front, self.labels = front, [model_name]

    def collect(self):
        stats, front = self.front.stats, self.front
        for family, name, doc, value in (
            (
                GaugeMetricFamily,
                "num_requests_running",
                "Sequences holding KV-cache blocks.",
                stats.num_running,
            ),
            (
                GaugeMetricFamily,
                "num_requests_waiting",
                "Sequences waiting to run.",
                stats.num_waiting,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (1 = all).",
                stats.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "prompt_tokens",
                "Prompt tokens of requests taken.",
                front.num_prompt_tokens,
            ),
            (
                CounterMetricFamily,
                "generation_tokens",
                "Tokens generated.",
                front.num_generation_tokens,
            ),
        ):
            metric = family(f"nanovllm:{name}", doc, labels=["model_name"])
            metric.add_metric(self.labels, value)
            yield metric
