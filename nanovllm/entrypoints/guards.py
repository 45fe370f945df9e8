"""What stands between a client and the handlers, and what the server gives back when idle:

- the API key (`--api-key`, or NANOVLLM_API_KEY, or vLLM's VLLM_API_KEY): every /v1 route and
  the tokenizer's routes ask for `Authorization: Bearer KEY` and answer 401 without it;
  /health and /metrics stay open to monitors, as in vLLM;
- a POST body must be JSON (`Content-Type: application/json`, as vLLM requires): a browser
  sends another type without asking (a "simple" request), JSON only after a CORS preflight,
  which this server refuses unless `--allowed-origins` names the page's origin;
- a body larger than `--max-request-bytes` is refused with 413, before it is read when its
  Content-Length says so, else as soon as it passes the limit;
- freed memory goes back to the system after a second with no request in flight (a CPU
  runner keeps freed memory for reuse, runner/cpu.py, so one large request would otherwise
  grow the process for good).
"""

import asyncio
import ctypes
import ctypes.util
import hashlib
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from nanovllm.entrypoints.protocol import error_body, parse_body

logger = logging.getLogger("nanovllm")

API_KEY_VARIABLES = ("NANOVLLM_API_KEY", "VLLM_API_KEY")  # read in this order
GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize")
# The largest legitimate body is a batch of prompts, each at most max_model_len tokens: 64
# prompts of 4,096 token ids are ~1.8 MB of JSON. Parsing is what a large body costs the event
# loop: 4 MiB of small nested lists take ~0.3 s to parse, 16 MiB ~1.2 s (this machine).
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
IDLE_TRIM_S = 1.0


class HTTPOptions(NamedTuple):
    api_keys: tuple[str, ...] = ()  # none: no key asked for
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allowed_origins: tuple[str, ...] = ()  # CORS: none, so no page of another origin may call
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def api_keys_from_environment() -> tuple[str, ...]:
    """NANOVLLM_API_KEY, else VLLM_API_KEY: a deployment that moves from vLLM keeps its
    protection rather than silently serving everyone."""
    key = next((os.environ[v] for v in API_KEY_VARIABLES if os.environ.get(v)), None)
    return (key,) if key else ()


class HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


class ClientGone(Exception):
    """The client closed its connection before the request's body had arrived."""


def install(app: FastAPI, options: HTTPOptions, idle: "IdleTrim") -> None:
    """The middleware, innermost first: the idle count, the API key, CORS (outermost, so that
    a 401 an allowed page gets carries CORS headers)."""
    app.add_middleware(IdleTrimMiddleware, idle=idle)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=options.api_keys)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers),
            allow_credentials=options.allow_credentials,
        )


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body of a POST, as a JSON object: 400 unless its type is JSON, 413 past
    max_bytes; ClientGone if the client leaves before it has all arrived."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise HTTPError(400, f"Content-Type must be application/json, got {media_type or 'none'!r}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return parse_body(b"".join(chunks))


def _too_large(size: int, max_bytes: int) -> HTTPError:
    return HTTPError(
        413,
        f"the request body ({size:,} bytes or more) is larger than this server's limit of "
        f"{max_bytes:,} bytes (--max-request-bytes)",
        code="request_too_large",
    )


class APIKeyMiddleware:
    """Bearer-token check on the guarded paths (vLLM's: keys compared as SHA-256 digests in
    constant time); OPTIONS passes, for CORS preflights."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]):
        self.app = app
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"].startswith(GUARDED_PATHS)
            and not self.authorized(Headers(scope=scope).get("authorization", ""))
        ):
            body = error_body(
                "a valid API key is required: send the header `Authorization: Bearer KEY`",
                code="invalid_api_key",
            )
            response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, header: str) -> bool:
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(key.strip().encode()).digest()
        matches = [secrets.compare_digest(digest, known) for known in self.digests]
        return any(matches)  # every key compared, so the time tells nothing of which


class IdleTrim:
    """Returns freed heap memory to the system (glibc's malloc_trim) once no request has
    been in flight for IDLE_TRIM_S, if one ran since the last time. On a CPU the runner asks
    glibc to keep freed memory (prefill activations page-fault otherwise: docs/cpu.md,
    platforms/cpu/host.py); trimming only when idle keeps that gain under load, at the price of the
    first step after an idle second faulting its pages in again."""

    def __init__(self):
        self.in_flight = 0
        self.dirty = False  # a POST ran since the last trim
        self.trim = _malloc_trim()

    async def run(self, offload: Callable[..., Awaitable]) -> None:
        """The trimming loop (a task of the server's lifespan); `offload` runs it off the
        event loop (a trim of a large heap takes milliseconds)."""
        if self.trim is None:
            return
        while True:
            await asyncio.sleep(IDLE_TRIM_S)
            if self.in_flight == 0 and self.dirty:
                self.dirty = False
                await offload(self.trim, 0)


class IdleTrimMiddleware:
    def __init__(self, app: ASGIApp, idle: IdleTrim):
        self.app, self.idle = app, idle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.idle.in_flight += 1
        self.idle.dirty |= scope["method"] == "POST"  # monitors' GETs allocate little
        try:
            await self.app(scope, receive, send)
        finally:
            self.idle.in_flight -= 1


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library is not glibc."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
