"""Draining on SIGTERM (`--shutdown-timeout SECONDS`, vLLM's option): a replica taken out of a
fleet (a rolling restart, a scale-down) stops taking requests and finishes those it has.

    SIGTERM  ─ draining: a new request to /v1, /tokenize or /detokenize gets 503 with OpenAI's
               error body and `Retry-After`, /health answers 503 (a router or load balancer
               routes around the replica); the requests in flight, streams too, run on
    idle     ─ the last of them has ended: the server stops, exit status 0
    timeout  ─ --shutdown-timeout seconds have passed: the server stops, aborting what still runs
               (streams end with finish_reason "abort"), exit status 0
    SIGTERM again, or SIGINT ─ the server stops at once, aborting what runs

With --shutdown-timeout 0 (the default, as vLLM's) SIGTERM stops the server at once. The socket
stays open while draining, so a client is told 503 rather than refused a connection.
"""

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from nanovllm.entrypoints.guards import GUARDED_PATHS
from nanovllm.entrypoints.protocol import error_body

logger = logging.getLogger("nanovllm")

# What a refused client is told to wait: the replica will not serve it again, but a load
# balancer (or the replica's replacement) will once it has seen /health fail, in seconds.
RETRY_AFTER_S = 1


class Drain:
    """The server's drain: whether it has begun, and the requests it waits for."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.in_flight = 0  # requests on the guarded paths, taken before the drain began
        self.since: float | None = None  # monotonic; None until SIGTERM
        self.idle = asyncio.Event()  # set when draining and nothing is in flight

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        """From now on new requests are refused (safe in a signal handler: sets a field)."""
        self.since = time.monotonic()

    async def run(self, stop: Callable[[], None]) -> None:
        """Wait for the requests in flight, at most timeout_s, then `stop` the server (which
        aborts whatever still runs)."""
        logger.info(
            "SIGTERM: draining: new requests get 503; %d in flight, given %gs to finish",
            self.in_flight,
            self.timeout_s,
        )
        if self.in_flight == 0:
            self.idle.set()
        try:
            await asyncio.wait_for(self.idle.wait(), self.timeout_s)
            logger.info("drained: every request finished")
        except TimeoutError:
            logger.warning(
                "--shutdown-timeout (%gs) reached: aborting the %d requests still in flight",
                self.timeout_s,
                self.in_flight,
            )
        stop()

    def left(self) -> None:
        """A request in flight has ended."""
        self.in_flight -= 1
        if self.draining and self.in_flight == 0:
            self.idle.set()


class DrainMiddleware:
    """Counts the requests in flight on the guarded paths; refuses new ones once draining."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await refusal()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.left()


def refusal() -> JSONResponse:
    body = error_body(
        "this server is shutting down and takes no new requests; send it to another replica",
        type_="server_error",
        code="server_shutting_down",
    )
    return JSONResponse(body, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
