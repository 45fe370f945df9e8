"""The command line: `nanovllm serve MODEL` (or `python -m nanovllm serve MODEL`).

    nanovllm serve ~/huggingface/Qwen3-0.6B/ --port 8000 --max-model-len 4096

Every Config field is an option, spelled in kebab case (`--max-num-seqs 64`,
`--enforce-eager` / `--no-enforce-eager`); Config checks the values. Once the model is
loaded the server prints `nanovllm: serving MODEL on http://HOST:PORT` (the port the OS
chose for `--port 0`). SIGINT / SIGTERM stop it: no new connections, every request in
flight aborted (streams end with finish_reason "abort"), the engine and its TP workers
closed, exit status 0.
"""

import argparse
import signal
import socket
import sys
import typing
from dataclasses import MISSING, fields

from nanovllm.config import Config

SERVER_OPTIONS = ("host", "port", "served_model_name")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nanovllm's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve MODEL over OpenAI's HTTP API.",
    )
    serve.add_argument("model", help="a model directory (config.json, weights, tokenizer)")
    serve.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    serve.add_argument(
        "--port", type=int, default=8000, help="0: one the OS picks; default: %(default)s"
    )
    serve.add_argument(
        "--served-model-name", help="the name requests give as `model` (default: MODEL as given)"
    )
    add_config_options(serve)
    return parser


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per Config field; an option not given leaves Config's default."""
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
    return args[0] if len(args) == 1 else annotation


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        import nanovllm.entrypoints.openai_server  # noqa: F401  (needs the `serve` extra)
    except ImportError as e:
        parser.exit(
            1, f"nanovllm serve needs the serve extra (pip install 'nano-vllm[serve]'): {e}\n"
        )
    return serve(parser, args)


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import uvicorn

    from nanovllm.engine import LLMEngine
    from nanovllm.engine.async_engine import AsyncEngine
    from nanovllm.entrypoints.openai_server import Server, build_app

    options = {
        k: v for k, v in vars(args).items() if k not in ("command", "model", *SERVER_OPTIONS)
    }
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.create_server((args.host, args.port), family=family)  # fails before loading
    try:
        engine = LLMEngine(args.model, **options)
    except (TypeError, ValueError) as e:
        sock.close()
        parser.error(str(e))
    front = AsyncEngine(engine)
    name = args.served_model_name or args.model
    server = Server(uvicorn.Config(build_app(front, name), timeout_graceful_shutdown=5), front)
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


if __name__ == "__main__":
    sys.exit(main())
