"""Cost of the sampler per decode step: every filter and penalty, and logprobs, vs
temperature alone.

    python benchmarks/sampler.py [--batch 256] [--vocab 151936] [--device cpu] [--threads N]

Each configuration runs decode-like steps on random logits: one token appended to every
sequence per step, the metadata built from the sequences as the model runner does
(host work, including the penalties' incremental token counts), then what
ModelRunner.sample does around the sampler: the logprobs check (a scan of the batch when
no sequence asks), and for those that ask the raw log_softmax before sampling and the
Logprob dicts after it (with their host sync). Configurations take turns step by step;
each reports its fastest step (the least disturbed by other load on the machine) and its
ratio to temperature-only.
"""

import argparse
import time
import timeit

import torch

from nanovllm.core.sequence import Sequence, logits_rows
from nanovllm.sampling.logprobs import collect_logprobs, find_logprob_rows, raw_logprobs
from nanovllm.sampling.metadata import SamplingMetadataBuilder
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams

CONFIGS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=0.8, top_k=50),
    "seeded": dict(temperature=0.8, seed=0),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "filters": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "penalties": dict(
        temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3
    ),
    "full": dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    ),
    "full+seed": dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=0,
    ),
    "min_tokens": dict(temperature=0.8, min_tokens=4096, stop_token_ids=[1, 2, 3]),
    "logit_bias": dict(temperature=0.8, logit_bias=dict.fromkeys(range(0, 2000, 20), 2.0)),
    "logprobs=0": dict(temperature=0.8, logprobs=0),
    "logprobs=5": dict(temperature=0.8, logprobs=5),
    "logprobs=20": dict(temperature=0.8, logprobs=20),
    "greedy+lp=5": dict(temperature=0, logprobs=5),
}


class Workload:
    """A batch of sequences with one configuration, stepped like decoding."""

    def __init__(self, config: dict, args, device: torch.device):
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=4096, **config)
        self.seqs = []
        for _ in range(args.batch):
            prompt = torch.randint(0, args.vocab, (args.prompt_len,), generator=g).tolist()
            seq = Sequence(prompt, params, block_size=256, eos_token_ids=[0])
            for token in torch.randint(0, args.vocab, (args.output_len,), generator=g).tolist():
                seq.append_token(token)
            self.seqs.append(seq)
        self.vocab, self.device = args.vocab, device
        self.metadata = SamplingMetadataBuilder(args.vocab, device)
        self.logits = torch.randn(args.batch, args.vocab, generator=g).to(device) * 3
        self.sampler = Sampler()
        self.times: list[tuple[float, float]] = []  # (metadata s, sampler s) per step

    def step(self) -> None:
        for seq in self.seqs:  # a decode row: its last token runs, the next is sampled
            seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1
        logits = self.logits.clone()
        start = time.perf_counter()
        metadata = self.metadata.build(self.seqs)
        mid = time.perf_counter()
        asked = find_logprob_rows(self.seqs, None)  # as ModelRunner.sample does
        raw = None if asked is None else raw_logprobs(logits, asked)
        sampled = self.sampler(logits, metadata)
        if asked is not None:
            collect_logprobs(asked, raw, sampled, len(self.seqs))
        tokens = sampled.tolist()  # waits for the device
        self.times.append((mid - start, time.perf_counter() - mid))
        for seq, token in zip(self.seqs, tokens):
            seq.append_token(token)

    def best_ms(self) -> tuple[float, float]:
        """The fastest step after the first (warm-up): least disturbed by other load."""
        host, sample = min(self.times[1:], key=sum)
        return host * 1e3, sample * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0 = torch's default); 1 is steadier on a busy machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"batch {args.batch}, vocab {args.vocab}, {device}, torch threads "
        f"{torch.get_num_threads()}, histories {args.prompt_len} + {args.output_len} tokens"
    )
    workloads = {name: Workload(config, args, device) for name, config in CONFIGS.items()}
    for _ in range(args.steps + 1):  # round-robin, so outside load hits every config alike
        for workload in workloads.values():
            workload.step()
    results = {name: w.best_ms() for name, w in workloads.items()}
    base = sum(results["temperature"])
    for name, (host_ms, sample_ms) in results.items():
        print(
            f"{name:12s} metadata {host_ms:8.1f} ms  sampler {sample_ms:8.1f} ms  "
            f"total / temperature-only {(host_ms + sample_ms) / base:5.2f}"
        )
    seqs = workloads["temperature"].seqs
    check = (
        min(timeit.repeat(lambda: find_logprob_rows(seqs, logits_rows(seqs)), number=100, repeat=5))
        / 100
    )
    print(
        f"logprobs checks when no sequence asks: {check * 1e6:.1f} us per step "
        f"({check * 1e3 / base:.3%} of temperature-only)"
    )


if __name__ == "__main__":
    main()
