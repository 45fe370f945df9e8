"""Draining on SIGTERM (`--shutdown-timeout`), on a real server process: new requests get 503
with OpenAI's error body and Retry-After, /health fails, the requests in flight (a stream, and
one whose body was still arriving) finish in full, and the server exits 0 once they have; a
second SIGTERM, or the timeout, aborts what is left (streams end with finish_reason "abort") and
it exits 0 all the same, with no traceback in its log."""

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
from serving import engine_flags, live_processes, running_server

NAME = "tiny"
ENGINE = dict(device="cpu", max_model_len=1024, num_kvcache_blocks=600, kvcache_block_size=16)
LONG = dict(model=NAME, prompt="x", max_tokens=1000, stream=True, extra_body={"ignore_eos": True})

pytestmark = pytest.mark.slow


def serve(checkpoint, timeout_s: int):
    flags = ["--served-model-name", NAME, "--shutdown-timeout", str(timeout_s)]
    return running_server(checkpoint, *flags, *engine_flags(**ENGINE))


def client_of(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=60, max_retries=0)


def status_of(url: str, body: dict | None = None) -> tuple[int, dict, str | None]:
    """A request's status, JSON body (or {}) and Retry-After."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {}, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers.get("Retry-After")


def half_sent(port: int) -> tuple[socket.socket, bytes]:
    """A completions request whose headers and half its body are sent: in flight until the
    rest comes. Returns the socket and the rest."""
    body = json.dumps({"model": NAME, "prompt": "def main():", "max_tokens": 5}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + body[:10])
    return sock, body[10:]


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def wait_exit(proc, within_s: float) -> int:
    start = time.monotonic()
    code = proc.wait(timeout=within_s)
    assert time.monotonic() - start < within_s
    return code


def test_sigterm_drains_what_is_in_flight_refusing_the_rest(wide_checkpoint):
    with serve(wide_checkpoint, timeout_s=60) as running, client_of(running) as client:
        sock, rest = half_sent(running.port)
        stream = client.completions.create(**LONG, stream_options={"include_usage": True})
        first = [chunk for _, chunk in zip(range(3), stream)]
        offset = running.log_size()
        running.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the signal is handled between two of the event loop's steps

        status, body, retry_after = status_of(
            f"{running.url}/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2}
        )
        assert (status, body["error"]["code"], retry_after) == (503, "server_shutting_down", "1")
        assert status_of(f"{running.url}/health")[0] == 503
        assert status_of(f"{running.url}/metrics")[0] == 200  # monitors still see it

        chunks = first + list(stream)  # the stream in flight runs to its end
        assert chunks[-1].usage.completion_tokens == 1000
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        sock.sendall(rest)  # so does the request whose body was still arriving
        reply = read_all(sock).decode()
        assert reply.startswith("HTTP/1.1 200") and '"finish_reason": "length"' in reply

        assert wait_exit(running.proc, within_s=15) == 0
        log = running.log_since(offset)
        assert "draining" in log and "drained: every request finished" in log
        assert "Traceback" not in log
        assert live_processes(running.proc.pid) == []


def test_the_timeout_aborts_what_is_left_and_exits_0(wide_checkpoint):
    with serve(wide_checkpoint, timeout_s=1) as running, client_of(running) as client:
        stream = client.completions.create(**{**LONG, "n": 8})
        next(iter(stream))
        offset = running.log_size()
        running.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        finish = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices}
        assert set(finish.values()) == {"abort"} and time.monotonic() - start < 10
        assert wait_exit(running.proc, within_s=15) == 0
        log = running.log_since(offset)
        assert "--shutdown-timeout (1s) reached" in log and "Traceback" not in log


def test_a_second_sigterm_aborts_at_once(wide_checkpoint):
    with serve(wide_checkpoint, timeout_s=600) as running, client_of(running) as client:
        stream = client.completions.create(**{**LONG, "n": 8})
        next(iter(stream))
        running.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert status_of(f"{running.url}/health")[0] == 503  # draining
        running.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        finish = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices}
        assert set(finish.values()) == {"abort"} and time.monotonic() - start < 10
        assert wait_exit(running.proc, within_s=15) == 0
        assert "Traceback" not in running.log_since(0)
