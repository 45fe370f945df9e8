"""The command line: `nanovllm serve MODEL` (or `python -m nanovllm serve MODEL`).

    nanovllm serve ~/huggingface/Qwen3-0.6B/ --port 8000 --max-model-len 4096

Every Config field is an option, spelled in kebab case (`--max-num-seqs 64`,
`--enforce-eager` / `--no-enforce-eager`); Config checks the values. The HTTP options
(`--api-key`, `--max-request-bytes`, vLLM's CORS flags) are guards.py's. The port is taken
first: one in use is one line on stderr and exit status 2, before the model loads; so is a
model directory without config.json, when it follows `serve`, before torch is imported. Once the
model is loaded the server prints `nanovllm: serving MODEL on http://HOST:PORT` (the port
the OS chose for `--port 0`). SIGINT / SIGTERM stop it: no new connections, every request
in flight aborted (streams end with finish_reason "abort"), the engine and its TP workers
closed, exit status 0; with `--shutdown-timeout SECONDS` SIGTERM drains it first (drain.py).
"""

import argparse
import json
import logging
import os
import signal
import socket
import sys
import typing
from dataclasses import MISSING, fields

from nanovllm.demo import DOWNLOAD_COMMAND, is_demo_checkpoint

if typing.TYPE_CHECKING:
    from nanovllm.engine import LLMEngine
    from nanovllm.engine.async_engine import AsyncEngine
    from nanovllm.entrypoints.adapters import ServedAdapters

SERVER_OPTIONS = (
    "host",
    "port",
    "served_model_name",
    "api_key",
    "max_request_bytes",
    "allowed_origins",
    "allowed_methods",
    "allowed_headers",
    "allow_credentials",
    "reasoning_parser",
    "shutdown_timeout",
    "lora_modules",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nanovllm's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve MODEL over OpenAI's HTTP API.",
    )
    serve.add_argument(
        "model", help="a model directory (config.json, weights, tokenizer), or a GGUF file"
    )
    serve.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    serve.add_argument(
        "--port", type=int, default=8000, help="0: one the OS picks; default: %(default)s"
    )
    serve.add_argument(
        "--served-model-name", help="the name requests give as `model` (default: MODEL as given)"
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "qwen3"),
        help="tell a reasoning model's thinking from its answer: reasoning_content and content "
        "(structured outputs and tool calls then hold the answer alone)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=int,
        default=0,
        metavar="SECONDS",
        help="on SIGTERM, refuse new requests (503) and give those in flight this long to "
        "finish before aborting them; 0: abort at once (default: %(default)s)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT checkpoints) served under their names, as NAME=PATH or "
        '\'{"name": NAME, "path": PATH}\'; needs --enable-lora',
    )
    add_http_options(serve)
    add_config_options(serve)
    return parser


def add_http_options(parser: argparse.ArgumentParser) -> None:
    """vLLM's names and JSON-list values for its CORS flags."""
    group = parser.add_argument_group("HTTP options")
    group.add_argument(
        "--api-key",
        nargs="+",
        help="require `Authorization: Bearer KEY` (one of these keys) on /v1 and the tokenizer's "
        "routes; default: $NANOVLLM_API_KEY, else $VLLM_API_KEY, else none",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        help="larger request bodies get 413; default: 4 MiB (guards.py says why)",
    )
    for flag, default in (
        ("--allowed-origins", "[]"),
        ("--allowed-methods", '["*"]'),
        ("--allowed-headers", '["*"]'),
    ):
        group.add_argument(
            flag,
            type=json_strings,
            default=json_strings(default),
            metavar="JSON",
            help=f"CORS, a JSON list of strings; default: {default}",
        )
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def json_strings(value: str) -> tuple[str, ...]:
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return tuple(items)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per Config field; an option not given leaves Config's default."""
    from nanovllm.config import Config  # imports transformers and torch: seconds

    group = parser.add_argument_group("engine options (Config fields)")
    for f in fields(Config):
        if not f.init or f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.default is MISSING else f"default: {f.default}"
        if f.type is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=default
            )
        else:
            kind = option_type(f.type)
            group.add_argument(
                flag,
                type=kind,
                default=argparse.SUPPRESS,
                metavar=kind.__name__.upper(),
                help=default,
            )


def option_type(annotation: object) -> type:
    """The type an option's text converts to: X for a field of type X or X | None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if str in args:  # a field that parses its own text (speculative_config: JSON)
        return str
    return args[0] if len(args) == 1 else annotation


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if missing := missing_model(argv):  # before build_parser, which imports torch
        print(missing, file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    sock = listen(parser, args.host, args.port)  # before anything slow: a port in use is told now
    try:
        import nanovllm.entrypoints.openai_server  # noqa: F401  (needs the `serve` extra)
    except ImportError as e:
        parser.exit(
            1, f"nanovllm serve needs the serve extra (pip install 'nano-vllm[serve]'): {e}\n"
        )
    return serve(parser, args, sock)


def missing_model(argv: list[str]) -> str | None:
    """The error for `serve MODEL ...` where MODEL has no config.json; None otherwise. Only a
    model right after `serve` is surely the positional argument before the options are known
    (`--port 8000 MODEL` needs the parser); Config checks every model again."""
    if len(argv) < 2 or argv[0] != "serve" or argv[1].startswith("-"):
        return None
    asks_for_help = bool({"-h", "--help"} & set(argv))
    if asks_for_help or is_model(os.path.expanduser(argv[1])):
        return None
    return (
        f"nanovllm serve: no model at {argv[1]!r} (no config.json in it, nor a GGUF file); "
        f"serve a model directory, e.g. Qwen3-0.6B after `{DOWNLOAD_COMMAND}`"
    )


def is_model(path: str) -> bool:
    """A checkpoint folder, a GGUF file, or a folder holding one (Config tells which)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return True
    if os.path.isdir(path):
        return any(name.endswith(".gguf") for name in os.listdir(path))
    return path.endswith(".gguf") and os.path.isfile(path)


def listen(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    """The server's socket, listening. Made with proto IPPROTO_TCP, which its connections
    inherit: asyncio sets TCP_NODELAY only on a connection whose socket says TCP (proto 0 does
    not). Without it a response's head and body went as two segments, the body held back by
    Nagle's algorithm until the client acknowledged the head, which a keep-alive client (the
    openai client, vLLM's router) delays by 40 ms: +40 ms on each whole response, and on each
    hop through the router."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)  # "Address already in use"
        parser.exit(2, f"nanovllm serve: cannot listen on {host}:{port}: {reason}\n")
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=sock.detach())


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from nanovllm.engine import LLMEngine
    from nanovllm.engine.async_engine import AsyncEngine
    from nanovllm.entrypoints import guards
    from nanovllm.entrypoints.openai_server import Server, build_app

    options = {
        k: v for k, v in vars(args).items() if k not in ("command", "model", *SERVER_OPTIONS)
    }
    http = guards.HTTPOptions(
        tuple(key for key in args.api_key or () if key) or guards.api_keys_from_environment(),
        args.max_request_bytes or guards.DEFAULT_MAX_REQUEST_BYTES,
        args.allowed_origins,
        args.allowed_methods,
        args.allowed_headers,
        args.allow_credentials,
    )
    log_as_uvicorn_does(logging.getLogger("nanovllm"))
    if is_demo_checkpoint(args.model):
        logging.getLogger("nanovllm").warning(
            "%s is nanovllm's tiny demo checkpoint: its weights are random, its text is noise. "
            "For a real model: %s",
            args.model,
            DOWNLOAD_COMMAND,
        )
    try:
        engine = LLMEngine(args.model, **options)
    except (TypeError, ValueError) as e:
        sock.close()
        parser.error(str(e))
    reasoning = None
    if args.reasoning_parser:
        from nanovllm.entrypoints.reasoning import ReasoningParser

        try:
            reasoning = ReasoningParser.load(args.reasoning_parser, engine.tokenizer)
        except ValueError as e:
            fail(parser, engine, sock, str(e))
    front = AsyncEngine(engine)
    name = args.served_model_name or args.model
    adapters = None
    if engine.config.enable_lora:
        try:
            adapters = served_adapters(front, name, args.lora_modules or ())
        except (TypeError, ValueError) as e:
            fail(parser, engine, sock, str(e))
    elif args.lora_modules:
        fail(parser, engine, sock, "--lora-modules needs --enable-lora")
    drain = None
    if args.shutdown_timeout:
        from nanovllm.entrypoints.drain import Drain

        drain = Drain(args.shutdown_timeout)
    app = build_app(front, name, http, reasoning, drain, adapters)
    server = Server(uvicorn.Config(app, timeout_graceful_shutdown=5), front, drain)
    # uvicorn re-raises the signal that stopped it once its handlers are gone: these
    # catch it, so the process ends with status 0 after closing the engine.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    print(f"nanovllm: serving {name} on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        front.close()
        sock.close()
    return 0


def served_adapters(front: "AsyncEngine", name: str, modules: list[str]) -> "ServedAdapters":
    """The server's LoRA adapters, those of --lora-modules read and checked now (a
    ValueError or TypeError naming the one at fault)."""
    from nanovllm.entrypoints.adapters import ServedAdapters, parse_lora_module

    adapters = ServedAdapters(front, name)
    for module in modules:
        try:
            adapters.add_at_start(*parse_lora_module(module))
        except (TypeError, ValueError) as e:
            raise type(e)(f"--lora-modules {module}: {e}") from None
    return adapters


def fail(
    parser: argparse.ArgumentParser, engine: "LLMEngine", sock: socket.socket, error: str
) -> typing.NoReturn:
    """Exit with a usage error once the engine is up: the engine closed (its TP workers too)."""
    engine.close()
    sock.close()
    parser.error(error)


def log_as_uvicorn_does(logger: logging.Logger) -> None:
    """The engine's and the server's INFO lines on stderr, formatted as uvicorn's own."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
