"""Helpers for the tests that drive real server processes (`python -m nanovllm serve`): start
one in a session of its own, find its port and its log, read its metrics and its memory."""

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
from typing import NamedTuple

NAME = "tiny"  # --served-model-name
ENGINE = dict(device="cpu", max_model_len=512, num_kvcache_blocks=96, kvcache_block_size=16)
START_TIMEOUT_S = 90


class Running(NamedTuple):
    proc: subprocess.Popen
    port: int
    log: Path  # its stdout and stderr

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log.open(errors="replace") as f:
            f.seek(offset)
            return f.read()

    def client(self, client_class: type | None = None, **options):
        """The official openai client (or `client_class`, openai.AsyncOpenAI) for this server:
        no retries, a minute's timeout."""
        import openai

        options = dict(api_key="unused", timeout=60, max_retries=0) | options
        return (client_class or openai.OpenAI)(base_url=f"{self.url}/v1", **options)

    def rss_mib(self) -> float:
        """The server process's resident memory (Linux's /proc)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024


def engine_flags(**engine: object) -> list[str]:
    return [x for k, v in engine.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@contextmanager
def running_server(model: Path, *flags: str, env: dict[str, str] | None = None):
    """A server process in a session of its own (so nothing of it can outlive the test):
    yields a Running; SIGTERM at the end, SIGKILL to the group if that fails."""
    log = tempfile.NamedTemporaryFile("w+", prefix="nanovllm-serve-", suffix=".log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm", "serve", str(model), "--port", "0", *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        yield Running(proc, wait_for_port(proc, Path(log.name)), Path(log.name))
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
