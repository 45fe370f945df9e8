"""The OpenAI-compatible HTTP server (FastAPI) over an AsyncEngine:

    GET  /health               200 while the engine thread runs
    GET  /v1/models            the served model (and its LoRA adapters: adapters.py)
    POST /v1/completions       prompt: text, token ids, or a list of them; echo for scoring
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template
    POST /tokenize, /detokenize  vLLM's: text or messages -> token ids, and back
    GET  /metrics              Prometheus text: queues, KV-cache use, token counters

`stream: true` answers Server-Sent Events: `data: {chunk}` lines, then `data: [DONE]`.
Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for a bad
request (FastAPI's 422 included), 401 without the API key (guards.py), 404 for another
model's name or an unknown path, 413 for a body past --max-request-bytes. A client that
leaves has its request aborted, with one INFO line.
"""

import asyncio
import functools
import json
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, NamedTuple

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from nanovllm.engine.async_engine import AsyncEngine, Delta, RequestStream
from nanovllm.entrypoints import guards, protocol, responses
from nanovllm.entrypoints.guards import HTTPOptions
from nanovllm.entrypoints.metrics import EngineMetrics
from nanovllm.entrypoints.protocol import ModelNotFound, error_body
from nanovllm.entrypoints.responses import ResponseHead
from nanovllm.entrypoints.tokenization import Tokenization, TokenizedPrompt
from nanovllm.entrypoints.tools import ToolCalling
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.entrypoints.adapters import ServedAdapters
    from nanovllm.entrypoints.drain import Drain
    from nanovllm.entrypoints.reasoning import Reasoning, ReasoningParser

logger = logging.getLogger("nanovllm")


class Accepted(NamedTuple):
    model: str  # the name it asked for: the base model's, or a LoRA adapter's
    stream: RequestStream
    params: SamplingParams
    body: dict
    prompts: list[TokenizedPrompt]
    reasoning: "Reasoning | None"  # a chat request's, with a reasoning parser


def build_app(
    front: AsyncEngine,
    model_name: str,
    options: HTTPOptions | None = None,
    reasoning: "ReasoningParser | None" = None,
    drain: "Drain | None" = None,
    adapters: "ServedAdapters | None" = None,
) -> FastAPI:
    """The app; its lifespan starts the engine thread in uvicorn's event loop, and the task
    that gives memory back when the server is idle. With `reasoning` (--reasoning-parser),
    chat replies' thinking is told apart from their answer (reasoning.py); with `drain`
    (--shutdown-timeout), SIGTERM drains the server (drain.py, with Server); with `adapters`
    (--enable-lora), a request's `model` may name a LoRA adapter (adapters.py)."""
    options = options or HTTPOptions()
    idle = guards.IdleTrim()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front.start()
        trimming = asyncio.create_task(idle.run(front.offload))
        yield
        trimming.cancel()

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    server = OpenAIServer(front, model_name, options.max_request_bytes, reasoning, drain, adapters)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    if adapters is not None:
        from nanovllm.entrypoints.adapters import runtime_updating_allowed

        if runtime_updating_allowed():
            app.add_api_route("/v1/load_lora_adapter", server.load_adapter, methods=["POST"])
            app.add_api_route("/v1/unload_lora_adapter", server.unload_adapter, methods=["POST"])
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
    if drain is not None:  # innermost: a request without its API key is told 401 first
        from nanovllm.entrypoints.drain import DrainMiddleware

        app.add_middleware(DrainMiddleware, drain=drain)
    guards.install(app, options, idle)
    return app


class Server(uvicorn.Server):
    """uvicorn's server that, as it shuts down (once it stops accepting), aborts every
    request in flight, so open streams end now instead of running to their max_tokens. With a
    `drain` (--shutdown-timeout) the first SIGTERM drains it first (drain.py): it goes on
    serving what it has, refusing the rest, and shuts down once that is done or the time is up;
    any signal after that, and SIGINT, shut it down at once."""

    def __init__(self, config: uvicorn.Config, front: AsyncEngine, drain: "Drain | None" = None):
        super().__init__(config)
        self.front, self.drain = front, drain
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining: asyncio.Task | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        """uvicorn's signal handler (it runs between two of the event loop's bytecodes)."""
        drain = self.drain
        if sig == signal.SIGTERM and drain and not drain.draining and self.loop is not None:
            drain.begin()  # refused from now on, before the loop runs again
            self.loop.call_soon_threadsafe(self._start_draining)
            return
        super().handle_exit(sig, frame)

    def _start_draining(self) -> None:
        self.draining = self.loop.create_task(self.drain.run(self._stop))

    def _stop(self) -> None:
        self.should_exit = True  # uvicorn's main loop sees it within 0.1 s

    async def shutdown(self, sockets: list | None = None) -> None:
        self.front.abort_all()
        await super().shutdown(sockets)


def error_response(status: int, message: str, **fields: str | None) -> JSONResponse:
    return JSONResponse(error_body(message, **fields), status_code=status)


class OpenAIServer:
    def __init__(
        self,
        front: AsyncEngine,
        model_name: str,
        max_request_bytes: int,
        reasoning: "ReasoningParser | None" = None,
        drain: "Drain | None" = None,
        adapters: "ServedAdapters | None" = None,
    ):
        self.front, self.model_name = front, model_name
        self.max_request_bytes = max_request_bytes
        self.reasoning, self.drain, self.adapters = reasoning, drain, adapters
        self.tokenization = Tokenization(front)
        config = front.engine.config
        self.max_model_len, self.max_logprobs = config.max_model_len, config.max_logprobs
        self.registry = CollectorRegistry()  # per app, so two apps in a process do not clash
        self.registry.register(EngineMetrics(front, model_name))

    async def health(self) -> Response:
        """200 while the engine thread runs and the server is not draining."""
        if self.drain is not None and self.drain.draining:
            return Response(status_code=503)
        return Response(status_code=200 if self.front.is_alive() else 503)

    async def models(self) -> dict:
        base = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "nanovllm",
            "max_model_len": self.max_model_len,
        }
        adapters = [] if self.adapters is None else self.adapters.cards(created=0)
        return {"object": "list", "data": [base, *adapters]}

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, self.tokenization.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, self.tokenization.detokenize)

    async def load_adapter(self, request: Request) -> Response:
        return await self._answer(request, self.adapters.load)

    async def unload_adapter(self, request: Request) -> Response:
        return await self._answer(request, self.adapters.unload)

    async def _answer(self, request: Request, handle: Callable) -> Response:
        """A request answered by one JSON object (the tokenizer's routes), or a line of text
        (the adapters' routes, as vLLM's)."""
        body: dict = {}
        try:
            body = await self._read(request)
            answer = await handle(body)
            if isinstance(answer, str):
                return Response(answer, media_type="text/plain")
            return JSONResponse(answer)
        except Exception as e:
            return _refusal(e, request, body)

    async def _read(self, request: Request) -> dict:
        body = await guards.read_json(request, self.max_request_bytes)
        self._lora_int_id(body)  # the model it names is served
        return body

    def _lora_int_id(self, body: dict) -> int:
        """The LoRA adapter the request's `model` names; 0: the base model. ModelNotFound if
        it names neither."""
        if self.adapters is not None:
            return self.adapters.resolve(body.get("model"))
        if body.get("model") not in (None, self.model_name):
            raise ModelNotFound(
                f"The model `{body['model']}` does not exist; this server "
                f"serves `{self.model_name}`"
            )
        return 0

    async def _serve(self, request: Request, chat: bool) -> Response:
        accepted = await self._accept(request, chat)
        if isinstance(accepted, Response):
            return accepted
        model, stream, params, body, prompts, reasoning = accepted
        streamed, top_k = bool(body.get("stream")), params.logprobs
        if chat:
            head = ResponseHead(
                "chatcmpl",
                "chat.completion.chunk" if streamed else "chat.completion",
                model,
            )
            choice = functools.partial(responses.chat_choice, top_k=top_k, streamed=streamed)
        else:
            head = ResponseHead("cmpl", "text_completion", model)
            choice = functools.partial(responses.completion_choice, top_k=top_k)
        calling = ToolCalling.from_body(body) if chat else None  # tools.py reads the text
        if streamed:
            chunks = self._chunks(
                stream, head, choice, protocol.include_usage(body), top_k is not None, chat
            )
            if reasoning is not None:  # the thinking first: tool calls are read in the answer
                chunks = reasoning.stream(chunks)
            if calling is not None:
                chunks = calling.stream(chunks)
            return EventStream(chunks, on_close=lambda: self.front.abort(stream))
        deltas = await self._collect(request, stream)
        if deltas is None:  # the client left; the request is aborted
            logger.info("%s: the client went away; its request was aborted", request.url.path)
            return Response(status_code=499)
        echo = None
        if protocol.echo(body):
            echo = responses.Echoed(
                [p.text for p in prompts],
                stream.prompt_token_ids,
                stream.prompt_logprobs,
                keep_completion=not protocol.echo_only(body),
                decode=self.front.tokenizer.decode,
            )
        if reasoning is not None:
            choice = reasoning.read(choice)
        if calling is not None:
            choice = calling.read_calls(choice)
        whole = functools.partial(
            responses.whole, head, choice, deltas, stream.num_choices, stream.prompt_token_ids, echo
        )
        # In the tokenizer thread: an echoed prompt's logprobs can make a large response.
        return Response(await self.front.offload(whole), media_type="application/json")

    async def _accept(self, request: Request, chat: bool) -> Accepted | Response:
        """Read, parse and check the request, tokenize its prompts and queue them (the
        tokenizer's work off the event loop), or the error response."""
        body: dict = {}
        try:
            body = await self._read(request)
            protocol.check_fields(body, chat)
            params = protocol.sampling_params(body, chat, self.max_model_len, self.max_logprobs)
            protocol.include_usage(body)
            reasoning = None
            if chat:
                prompts = [await self.tokenization.chat_prompt(body, params.n)]
                if self.reasoning is not None:  # a structured output starts after the thinking
                    reasoning = self.reasoning.for_prompt(prompts[0].text)
                    params = reasoning.constrain(params)
            else:
                prompts = await self.tokenization.completion_prompts(body, params.n)
            token_ids, lora_int_id = [p.token_ids for p in prompts], self._lora_int_id(body)
            stream = await self.front.add_request(token_ids, params, lora_int_id)
        except Exception as e:
            return _refusal(e, request, body)
        model = body.get("model") or self.model_name
        return Accepted(model, stream, params, body, prompts, reasoning)

    async def _chunks(
        self,
        stream: RequestStream,
        head: ResponseHead,
        choice: Callable[..., dict],
        with_usage: bool,
        logprobs: bool,
        chat: bool,
    ) -> AsyncIterator[dict]:
        """One chunk per choice per step with new text (or tokens, when logprobs are
        asked for); chat opens each choice with its role; the usage last, if asked.
        A completions chunk's text_offsets continue its choice's text."""
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
        num_tokens, sent = 0, [0] * stream.num_choices  # characters sent, per choice
        async for batch in self.front.deltas(stream):
            for delta in batch:
                num_tokens += len(delta.token_ids)
                if delta.text or delta.finish_reason or (logprobs and delta.token_ids):
                    if chat:
                        yield head(choices=[choice(delta)])
                    else:
                        yield head(choices=[choice(delta, text_offset=sent[delta.index])])
                    sent[delta.index] += len(delta.text)
        if with_usage:
            yield head(choices=[], usage=responses.usage(stream.prompt_token_ids, num_tokens))

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
                work.cancel()  # its deltas() aborts the request as the cancellation lands
        if not work.done() or work.cancelled():  # cancelled, or cancelling: the client left
            return None
        return work.result()


def _refusal(error: Exception, request: Request, body: dict) -> Response:
    """The response to a request refused before it was queued; errors other than the
    client's are raised on."""
    if isinstance(error, guards.ClientGone):
        logger.info("%s: the client went away while sending its request", request.url.path)
        return Response(status_code=499)
    if isinstance(error, guards.HTTPError):
        return error_response(error.status, str(error), code=error.code)
    if isinstance(error, ModelNotFound):
        return error_response(404, str(error), param=error.param, code="model_not_found")
    if isinstance(error, (TypeError, ValueError)):
        return error_response(400, str(error), param=protocol.param_of(str(error), body))
    raise error


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
