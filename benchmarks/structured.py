"""What structured outputs cost: a grammar's compile time (first and cached), and a decode
step's time with 0, 1, 16 and 64 of its 64 rows held to a realistic JSON schema (an order:
nested objects, an array of items, enums, patterns, numbers), at bench.py's cpu-small shape
and the demo model, side by side in one run.

    python -m benchmarks.structured [--batch 64] [--constrained 0 1 16 64] [--steps 24]
                                    [--rounds 3] [--threads N] [--clock wall|cpu]

cpu-small has random weights (load_format="dummy") and, in place of its placeholder
tokenizer, a byte-level BPE of its vocabulary size (4,096) trained as the demo's is (xgrammar
needs a real vocabulary); the demo model has its own (512). Every row samples (temperature
0.8); the unconstrained rows ignore EOS, the constrained ones cannot end early either (the
schema's strings and arrays are long). Once all rows decode, --steps steps are timed per
round, the settings taking turns each round; a setting's figure is its median step. Beside
it: the grammar's share of the step, the matchers' work (advance + fill the bitmask) and the
bitmask's application to the logits. `--clock cpu` times with the process's CPU time instead
of the wall clock: on a machine others load, that (with --threads 1) is the work done, not the
waiting for a core.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import PRESETS
from nanovllm import LLM, SamplingParams
from nanovllm.demo import build_tokenizer, demo_checkpoint, write_weightless_checkpoint
from nanovllm.structured import StructuredOutputsParams
from nanovllm.structured.grammars import Grammars
from nanovllm.structured.matchers import GrammarMask, GrammarMatchers

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 60},
                "email": {"type": "string", "format": "email"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[a-z0-9]{8}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number"},
                    "category": {"enum": ["book", "toy", "food", "tool"]},
                },
                "required": ["sku", "quantity", "price", "category"],
            },
        },
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "notes": {"type": "string", "maxLength": 400},
    },
    "required": ["order_id", "customer", "items", "status", "notes"],
}
SCHEMAS = {
    "order (json)": StructuredOutputsParams(json=ORDER),
    "order, no whitespace": StructuredOutputsParams(json=ORDER, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex (a date)": StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "choice of 4": StructuredOutputsParams(choice=["north", "south", "east", "west"]),
}
PARTS = ("grammar", "apply")


def cpu_small_checkpoint(root: Path) -> Path:
    """bench.py's cpu-small config, with a byte-level BPE tokenizer of its vocabulary size."""
    config = dict(PRESETS["cpu-small"].config)
    path = write_weightless_checkpoint(root / "cpu-small", config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink(missing_ok=True)
    size = build_tokenizer(path, vocab_size=config["vocab_size"])
    assert size == config["vocab_size"], size
    return path


def compile_times(llm: LLM) -> dict[str, tuple[float, float]]:
    """ms to compile each schema for this tokenizer: the first time, then from the cache."""
    grammars = Grammars(llm.tokenizer, llm.config.hf_config.vocab_size)
    times = {}
    for name, params in SCHEMAS.items():
        first = time.perf_counter()
        grammars.compile(params)
        cached = time.perf_counter()
        grammars.compile(params)
        end = time.perf_counter()
        times[name] = ((cached - first) * 1e3, (end - cached) * 1e3)
    return times


CLOCK = time.perf_counter  # or time.process_time: --clock


def timed(owner: object, name: str, totals: dict[str, float], part: str) -> None:
    """Wrap owner.name (a class attribute) to add its time to totals[part]."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += CLOCK() - start

    setattr(owner, name, wrapper)


def measure(llm: LLM, batch: int, constrained: int, steps: int, seed: int) -> list[dict]:
    """Per decode step: its ms and the grammar's parts', `constrained` of `batch` rows held."""
    g = torch.Generator().manual_seed(seed)
    free = SamplingParams(temperature=0.8, max_tokens=steps + 16, ignore_eos=True)
    held = SamplingParams(
        temperature=0.8, max_tokens=steps + 16, structured_outputs=SCHEMAS["order (json)"]
    )
    for i in range(batch):
        prompt = torch.randint(10, 400, (32,), generator=g).tolist()
        llm.add_request(prompt, held if i < constrained else free)
    while True:  # every prompt prefilled, a few decode steps to settle
        out = llm.step()
        if out.num_decode_tokens == batch and not out.num_prefill_tokens:
            break
    samples = []
    for _ in range(steps):
        TOTALS.update(dict.fromkeys(PARTS, 0.0))
        start = CLOCK()
        out = llm.step()
        elapsed = CLOCK() - start
        if out.num_decode_tokens != batch:
            raise RuntimeError(f"a row ended early ({out.num_decode_tokens} of {batch} decoded)")
        samples.append({"step": elapsed * 1e3, **{p: TOTALS[p] * 1e3 for p in PARTS}})
    for request_id in list(llm.requests):
        llm.abort_request(request_id)
    return samples


TOTALS = dict.fromkeys(PARTS, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--constrained", type=int, nargs="+", default=[0, 1, 16, 64])
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    timed(GrammarMatchers, "build", TOTALS, "grammar")
    timed(GrammarMask, "apply", TOTALS, "apply")
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        "unknown",
    )
    threads = args.threads or "the engine's choice of"
    print(f"{cpu}, {os.cpu_count()} cores, {threads} torch threads, {args.clock} clock")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        models = {"cpu-small": cpu_small_checkpoint(Path(tmp)), "demo": demo_checkpoint()}
        for name, path in models.items():
            dummy = dict(load_format="dummy") if name == "cpu-small" else {}
            with LLM(
                str(path),
                device="cpu",
                max_num_seqs=args.batch,
                kvcache_block_size=16,
                cpu_threads=args.threads,
                **dummy,
            ) as llm:
                report(name, llm, args)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def report(name: str, llm: LLM, args: argparse.Namespace) -> None:
    vocab = llm.config.hf_config.vocab_size
    print(f"\n{name} (vocabulary {vocab}): compile ms, first / cached")
    for schema, (first, cached) in compile_times(llm).items():
        print(f"  {schema:<22} {first:8.2f} / {cached:.3f}")
    runs: dict[int, list[dict]] = {k: [] for k in args.constrained}
    for r in range(args.rounds):  # the settings take turns, so load hits them alike
        for k in args.constrained:
            runs[k] += measure(llm, args.batch, k, args.steps, seed=r)
    first = runs[args.constrained[0]]
    base = statistics.median(s["step"] for s in first)
    print(f"{name}: decode step of {args.batch} rows, median ms over {len(first)} steps")
    print(f"  {'held':>5} {'step':>8} {'vs 0':>7} {'grammar':>8} {'apply':>7}")
    for k, samples in runs.items():
        step = statistics.median(s["step"] for s in samples)
        parts = [statistics.median(s[p] for s in samples) for p in PARTS]
        print(f"  {k:>5} {step:8.2f} {step / base - 1:+7.1%} {parts[0]:8.2f} {parts[1]:7.2f}")


if __name__ == "__main__":
    main()
