"""Speculative decoding's decode speed against plain decoding, as a function of its measured
acceptance: one stream and 16 concurrent streams, greedy, on bench.py's cpu-small (random
weights, nothing downloaded).

    python -m benchmarks.speculative [--streams 1 16] [--tokens 128] [--k 4] [--rounds 3]

Random weights do not copy text, so what makes drafts hit has to be said. Two workloads:

  ngram      the real n-gram proposer on prompts that are a short random pattern repeated (text
             that repeats, as code and templated output do). A random model's greedy
             continuation settles into a loop of a few tokens within some steps, and the
             proposer finds that loop in the sequence's own tokens: the acceptance is measured,
             not chosen.
  oracle q   BENCHMARK ONLY, to sweep acceptance: a proposer that knows the greedy
             continuation (from the plain run) and proposes it with each draft token replaced
             by a wrong one with probability 1 - q. q = 0: every draft is wrong, the worst
             case (k tokens verified and thrown away every step). Greedy, so the tokens must
             still be the plain run's, which the benchmark checks.
  no match   the n-gram lookup runs on the looping prompts, and its drafts are thrown away, as
             when nothing matches: no row is verified, what is left is the cost of looking
             and of the seam.

Decode tokens/s = tokens the decode steps yield / their time (prefill steps apart); each
figure is the median over --rounds rounds, the engines alternating within a round. Greedy, the
speculative tokens must be plain decoding's: "streams differing" counts the streams (over all
rounds) whose tokens were not, which only a near-tie flipped by rounding could explain (a
verified chunk and a decode row add in different orders).
"""

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time

import torch

from bench import PRESETS
from nanovllm import LLM, SamplingParams
from nanovllm.demo import write_weightless_checkpoint

PROMPT_LEN = 32


class OracleProposer:
    """Drafts from the known greedy continuation, each token wrong with probability 1 - q."""

    def __init__(self, continuations: dict[tuple, list[int]], q: float, k: int, vocab: int):
        self.continuations, self.q, self.k, self.vocab = continuations, q, k, vocab
        self.rng = random.Random(0)

    def propose(self, seq, limit: int) -> list[int]:
        truth = self.continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        done = seq.num_completion_tokens
        drafts = truth[done : done + min(self.k, limit)]
        return [
            t
            if self.rng.random() < self.q
            else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            for t in drafts
        ]

    def forget(self, seq_id: int) -> None:
        pass


class TimedLookup:
    """The real proposer, its host time per call recorded (the lookup's cost per row)."""

    def __init__(self, proposer):
        self.proposer, self.seconds, self.calls = proposer, 0.0, 0

    def propose(self, seq, limit: int) -> list[int]:
        start = time.perf_counter()
        drafts = self.proposer.propose(seq, limit)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return drafts

    def forget(self, seq_id: int) -> None:
        self.proposer.forget(seq_id)


class NoMatch:
    """The real lookup, its drafts discarded: what a workload where nothing repeats costs."""

    def __init__(self, proposer):
        self.proposer = proposer

    def propose(self, seq, limit: int) -> list[int]:
        self.proposer.propose(seq, limit)
        return []

    def forget(self, seq_id: int) -> None:
        self.proposer.forget(seq_id)


def prompts(streams: int, looping: bool, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if looping:  # an 8-token pattern, 4 times
        return [
            [rng.randrange(2, vocab) for _ in range(8)] * (PROMPT_LEN // 8) for _ in range(streams)
        ]
    return [[rng.randrange(2, vocab) for _ in range(PROMPT_LEN)] for _ in range(streams)]


def decode_run(llm: LLM, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of one generate-like loop, and the completions."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in batch]
    decode_s, decoded, done = 0.0, 0, {}
    while not llm.is_finished():
        start = time.perf_counter()
        out = llm.step()
        elapsed = time.perf_counter() - start
        if not out.num_prefill_tokens:
            decode_s += elapsed
            decoded += len(out.new_tokens)
        done.update({o.seq_id: o.token_ids for o in out.finished})
    return decoded / decode_s, [done[i] for i in ids]


def measure(plain: LLM, spec: LLM, streams: int, args, vocab: int) -> list[dict]:
    """Every workload at `streams` streams: plain and speculative tok/s, acceptance."""
    rows = []
    cases = [("ngram", None), ("no match", None), *((f"oracle q={q}", q) for q in args.q)]
    for name, q in cases:
        batch = prompts(streams, not name.startswith("oracle"), vocab, seed=streams)
        _, truth = decode_run(plain, batch, args.tokens)
        proposer = spec.scheduler.proposer
        if name == "ngram":
            spec.scheduler.proposer = TimedLookup(proposer)
        elif name == "no match":
            spec.scheduler.proposer = NoMatch(proposer)
        elif q is not None:
            continuations = {tuple(p): c for p, c in zip(batch, truth)}
            spec.scheduler.proposer = OracleProposer(continuations, q, args.k, vocab)
        decode_run(spec, batch, args.tokens)  # warm-up (the plain run above was plain's)
        plain_rates, spec_rates, accepted, drafted, verified, differ = [], [], 0, 0, 0, 0
        for _ in range(args.rounds):
            plain_rates.append(decode_run(plain, batch, args.tokens)[0])
            before = spec.stats().spec_decode
            rate, got = decode_run(spec, batch, args.tokens)
            after = spec.stats().spec_decode
            differ += sum(a != b for a, b in zip(got, truth))  # a near-tie flipped by rounding
            spec_rates.append(rate)
            accepted += after.num_accepted_tokens - before.num_accepted_tokens
            drafted += after.num_draft_tokens - before.num_draft_tokens
            verified += after.num_drafts - before.num_drafts
        lookup = spec.scheduler.proposer
        spec.scheduler.proposer = proposer
        p, s = statistics.median(plain_rates), statistics.median(spec_rates)
        rows.append(
            dict(
                streams=streams,
                workload=name,
                acceptance=accepted / drafted if drafted else None,
                mean_acceptance_length=1 + accepted / verified if verified else None,
                plain_tok_s=p,
                spec_tok_s=s,
                speedup=s / p,
                streams_differing=differ,
            )
        )
        if isinstance(lookup, TimedLookup):
            rows[-1]["lookup_us_per_row"] = lookup.seconds / lookup.calls * 1e6
        print_row(rows[-1], flush=True)
    return rows


def print_row(row: dict, flush: bool = False) -> None:
    acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
    length = (
        "-" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}"
    )
    print(
        f"| {row['streams']} | {row['workload']} | {acceptance} | {length} | "
        f"{row['plain_tok_s']:.0f} | {row['spec_tok_s']:.0f} | {row['speedup']:.2f}x | "
        f"{row['streams_differing']} |",
        flush=flush,
    )


def machine() -> str:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?"
    )
    load = open("/proc/loadavg").read().split()[:3]
    return f"{model}, {torch.get_num_threads()} threads, load {' '.join(load)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    p.add_argument("--max-n", type=int, default=4, help="prompt_lookup_max")
    p.add_argument("--q", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.8, 0.9, 1.0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="cpu_threads (0: the engine's choice)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    config = PRESETS["cpu-small"].config
    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.min_n,
        "prompt_lookup_max": args.max_n,
    }
    with tempfile.TemporaryDirectory() as path:
        write_weightless_checkpoint(path, config)
        engine = dict(
            load_format="dummy", device="cpu", cpu_threads=args.threads, cpu_kvcache_space_gib=0.25
        )
        with (
            LLM(path, **engine) as plain,
            LLM(path, speculative_config=spec_config, **engine) as spec,
        ):
            print(f"cpu-small, k={args.k}; {machine()}")
            print(
                "| streams | workload | acceptance | mean acceptance length | plain tok/s | "
                "speculative tok/s | speed-up | streams differing |"
            )
            print("|---|---|---|---|---|---|---|---|")
            rows = [
                row
                for n in args.streams
                for row in measure(plain, spec, n, args, config["vocab_size"])
            ]
            for row in rows:
                if "lookup_us_per_row" in row:
                    us = row["lookup_us_per_row"]
                    print(f"n-gram lookup at {row['streams']} streams: {us:.1f} us per row")
            print(f"after: {machine()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
