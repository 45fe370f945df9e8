"""nano-vLLM's throughput benchmark, and the same workload through its peers.

    python bench.py                                # nano-vLLM's run: Qwen3-0.6B, 256 requests
    python bench.py --preset cpu-small             # a small random model: 11-19 s on 2 CPU cores
    python bench.py --preset cpu-small --compare hf,vllm

`--help` has more examples. nano-vLLM's run is a GPU's workload: on a CPU it takes about an
hour, which bench.py says first (warn_if_long_on_a_cpu). The timed run shows a progress bar on
stderr; Ctrl-C ends it with its figures so far, in one line (exit status 130).

The workload is seeded: `num_seqs` prompts of random token ids, prompt and output
lengths uniform in their ranges, `ignore_eos` so every request makes exactly its
`max_tokens`. One warm-up generate, then the timed one. `--preset` writes a model's
config.json (and a placeholder tokenizer) to a temporary directory and runs on random
weights (`load_format="dummy"`), so nothing is downloaded.

`--compare` runs nanovllm and each listed peer in its own process group (killed
afterwards, helpers included), the same workload through each, and prints a table.
The engines' runners are in benchmarks/engines.py, the process groups and the table in
benchmarks/compare.py.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks import compare, contention, engines
from nanovllm.demo import DOWNLOAD_COMMAND, QWEN3_0_6B_CONFIG, write_weightless_checkpoint

DEFAULT_MODEL = "~/huggingface/Qwen3-0.6B/"
BACKENDS = ("nanovllm", "hf", "vllm")
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)
# How long nanovllm takes on a CPU, to warn before a run of more than LONG_RUN_S: every token,
# prompt or output, costs 2 FLOPs a parameter, at CPU_GFLOPS_PER_CORE a core. Measured:
# docs/benchmarks.md's Qwen3-0.6B-shape run on a 2-core AMD EPYC with AVX2 (float32) made 79.7
# tok/s, 2 x 0.596 GFLOP each: 47 GFLOP/s a core, rounded down for longer contexts and busier
# machines. A 2-core AMD EPYC with AVX-512 (bfloat16) ran nano-vLLM's workload at ~150 GFLOP/s
# a core in prefill and ~85 in its first decode steps: the estimate errs long.
CPU_GFLOPS_PER_CORE = 40
LONG_RUN_S = 600
# nano-vLLM's workload; a preset may override it, a flag overrides both.
DEFAULT_WORKLOAD = {
    "num_seqs": 256,
    "min_input_len": 100,
    "max_input_len": 1024,
    "min_output_len": 100,
    "max_output_len": 1024,
}


@dataclass(frozen=True)
class Preset:
    config: dict
    workload: dict


# Published config.json files (transformers-4 keys, as the checkpoints carry them).
LLAMA3_2_1B_CONFIG = {  # meta-llama/Llama-3.2-1B
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN2_5_0_5B_CONFIG = {  # Qwen/Qwen2.5-0.5B
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V0_3_CONFIG = {  # mistralai/Mistral-7B-v0.3
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32768,
}
QWEN3_30B_A3B_CONFIG = {  # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# A family's architecture shrunk to ~5M parameters (float32): per-step overhead and
# batching dominate, the home ground of continuous batching. Every family's cpu-small
# has this shape; Llama keeps its 131072 positions (its RoPE scaling starts at 8192).
CPU_SMALL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=4096,
    torch_dtype="float32",
    bos_token_id=0,
    eos_token_id=1,
)
CPU_SMALL_WORKLOAD = {
    "num_seqs": 128,
    "min_input_len": 16,
    "max_input_len": 256,
    "min_output_len": 16,
    "max_output_len": 256,
}


def cpu_small(config: dict, **overrides) -> Preset:
    return Preset(dict(config, **CPU_SMALL_SHAPE | overrides), CPU_SMALL_WORKLOAD)


PRESETS = {
    "qwen3-0.6b": Preset(QWEN3_0_6B_CONFIG, {}),
    "llama3.2-1b": Preset(LLAMA3_2_1B_CONFIG, {}),
    "qwen2.5-0.5b": Preset(QWEN2_5_0_5B_CONFIG, {}),
    "mistral-7b-v0.3": Preset(MISTRAL_7B_V0_3_CONFIG, {}),  # for a GPU
    "qwen3-30b-a3b": Preset(QWEN3_30B_A3B_CONFIG, {}),  # for a GPU (61 GB in bfloat16)
    "cpu-small": cpu_small(QWEN3_0_6B_CONFIG),
    "cpu-small-llama": cpu_small(LLAMA3_2_1B_CONFIG, max_position_embeddings=131072),
    "cpu-small-qwen2": cpu_small(QWEN2_5_0_5B_CONFIG),
    "cpu-small-mistral": cpu_small(MISTRAL_7B_V0_3_CONFIG),
    # 16 experts of 128, 4 per token: the experts' weights read per token are 2/3 of the
    # dense shape's MLP.
    "cpu-small-qwen3-moe": cpu_small(
        QWEN3_30B_A3B_CONFIG, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128
    ),
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]  # max_tokens of each request (ignore_eos: exactly that many)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """nano-vLLM's workload: token ids uniform in [0, 10000] (capped by the vocabulary),
    lengths uniform in [min, max], all drawn from one seeded generator."""
    rng = random.Random(args.seed)
    max_token = min(10000, vocab_size - 1)
    prompts = [
        [
            rng.randint(0, max_token)
            for _ in range(rng.randint(args.min_input_len, args.max_input_len))
        ]
        for _ in range(args.num_seqs)
    ]
    output_lens = [
        rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)
    ]
    return Workload(prompts, output_lens)


# -- arguments ------------------------------------------------------------------------


EXAMPLES = """\
examples:
  python bench.py --preset cpu-small
      a small random model (5M parameters, 128 requests): 11-19 s on 2 CPU cores
  python bench.py --preset qwen3-0.6b --num-seqs 32 --min-input-len 16 --max-input-len 128 \\
      --min-output-len 16 --max-output-len 64
      Qwen3-0.6B's shape with random weights, a workload sized for a CPU: ~40 s on 2 cores
  python bench.py --model ~/huggingface/Qwen3-0.6B/
      nano-vLLM's run, 256 requests of 100-1024 tokens each: a GPU's workload (on 2 CPU
      cores, ~1 h by bench.py's estimate); the checkpoint comes from
      `hf download Qwen/Qwen3-0.6B --local-dir ~/huggingface/Qwen3-0.6B/`

Ctrl-C ends a run with its figures so far (exit status 130).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"checkpoint directory (default {DEFAULT_MODEL})"
    )
    model.add_argument(
        "--preset", choices=sorted(PRESETS), help="a model shape with random weights (no download)"
    )
    for name in DEFAULT_WORKLOAD:
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"default {DEFAULT_WORKLOAD[name]}, or the preset's",
        )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--temperature", type=float, default=0.6, help="(default 0.6; 0 = greedy)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="(default auto: nanovllm's choice, e.g. float32 for a bf16 checkpoint "
        "on a CPU without native bf16; the peers get the dtype it chose)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--cpu-decode-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nanovllm on a CPU: small decode batches in one native call (default: on; "
        "--no-cpu-decode-step runs them layer by layer)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="nanovllm: schedule step n+1 while step n runs",
    )
    p.add_argument(
        "--scheduling-policy",
        default="mixed",
        choices=("mixed", "prefill_first"),
        help="nanovllm's scheduling policy (default mixed)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='nanovllm: speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (default off); its acceptance is reported',
    )
    p.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="nanovllm: N random LoRA adapters (every projection), the requests naming them "
        "in turn; all N in one batch (default 0: the base model)",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="their rank (default 16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--max-model-len", type=int, default=4096, help="(default 4096)")
    p.add_argument(
        "--backend",
        default="nanovllm",
        choices=BACKENDS,
        help="the one engine to run without --compare (default nanovllm)",
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="PEERS",
        help="comma-separated peers (hf, vllm) to run after nanovllm, each in its "
        "own process, with a table of the results",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="CPU KV-cache memory of nanovllm and vLLM, GiB (default 4)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of nanovllm and hf (default: torch's, one per core); "
        "vLLM keeps its own thread binding",
    )
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=32,
        help="requests per transformers generate() call (default 32)",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("NANOVLLM_BENCH_VLLM_PYTHON", sys.executable),
        help="the interpreter that has vllm installed (default: env "
        "NANOVLLM_BENCH_VLLM_PYTHON, else this one)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds one engine may take under --compare (default 3600)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=("int8", "int4"),
        help="nanovllm's weights quantized at load (int8, int4: a CPU's; default none)",
    )
    p.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="run the engines quiet, then beside N busy-looping processes, and compare",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and complete the arguments: workload from flag, else preset, else default.
    A bad combination exits with argparse's usage error naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset].workload if args.preset else {}
    for name, default in DEFAULT_WORKLOAD.items():
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    try:
        args.peers = check_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def check_args(args: argparse.Namespace) -> list[str]:
    """Raise ValueError naming a bad value; return the peers of --compare."""
    for name in ("num_seqs", "min_input_len", "min_output_len", "tp", "hf_batch_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for kind in ("input", "output"):
        low, high = getattr(args, f"min_{kind}_len"), getattr(args, f"max_{kind}_len")
        if low > high:
            raise ValueError(f"--min-{kind}-len ({low}) is larger than --max-{kind}-len ({high})")
    if args.max_input_len + args.max_output_len > args.max_model_len:
        raise ValueError(
            f"--max-input-len + --max-output-len ({args.max_input_len} + "
            f"{args.max_output_len}) exceeds --max-model-len ({args.max_model_len})"
        )
    if args.kv_cache_gib <= 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.lora_adapters < 0 or args.lora_rank < 1:
        raise ValueError("--lora-adapters must be >= 0 and --lora-rank >= 1")
    peers = [p.strip() for p in args.compare.split(",") if p.strip()] if args.compare else []
    unknown = [p for p in peers if p not in BACKENDS[1:]]
    if unknown:
        raise ValueError(
            f"--compare takes peers from {', '.join(BACKENDS[1:])}; got {', '.join(unknown)}"
        )
    return peers


# -- the model --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    path: str
    load_format: str  # "auto" (the checkpoint's weights) or "dummy" (random)
    hf_config: dict  # config.json
    dtype: str  # --dtype; "auto": nanovllm's own choice, the checkpoint's for a peer


@contextmanager
def model_spec(args: argparse.Namespace):
    """The checkpoint to run: --model, or a temporary directory written for --preset."""
    if not args.preset:
        path = os.path.expanduser(args.model)
        with open(os.path.join(path, "config.json")) as f:  # main checked that it is there
            config = json.load(f)
        yield ModelSpec(path, "auto", config, resolve_dtype(args, config))
        return
    config = PRESETS[args.preset].config
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.preset}-") as path:
        write_weightless_checkpoint(path, config)
        yield ModelSpec(path, "dummy", config, resolve_dtype(args, config))


def missing_model(args: argparse.Namespace) -> str | None:
    """The error for a --model without config.json, pointing a CPU user at a preset; None
    if the model is there (or a preset runs)."""
    path = os.path.expanduser(args.model)
    if args.preset or os.path.isfile(os.path.join(path, "config.json")):
        return None
    return (
        f"bench.py: no model at {path!r} (no config.json).\n"
        "  On a CPU, a small random model (seconds):  python bench.py --preset cpu-small\n"
        f"  Qwen3-0.6B, for nano-vLLM's run (a GPU's):  {DOWNLOAD_COMMAND}\n"
        "  More examples (Qwen3-0.6B's shape, random weights, sized for a CPU): bench.py --help"
    )


def resolve_dtype(args: argparse.Namespace, hf_config: dict) -> str:
    """nanovllm resolves "auto" itself (run_nanovllm records what it chose); a peer alone
    gets the checkpoint's dtype (vLLM's CPU build would run a float32 checkpoint in
    bfloat16). Under --compare the peers are given nanovllm's choice (main)."""
    if args.dtype != "auto" or args.backend == "nanovllm":
        return args.dtype
    return str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")


# -- one engine ---------------------------------------------------------------------------


def run_backend(args: argparse.Namespace) -> dict:
    """Run the workload through args.backend in this process; return its figures."""
    if args.threads and args.backend != "vllm":
        import torch

        torch.set_num_threads(args.threads)
    with model_spec(args) as spec:
        workload = make_workload(args, spec.hf_config["vocab_size"])
        warn_if_long_on_a_cpu(args, spec.hf_config, workload)
        print(  # a real model's load and warm-up take a while on a CPU: say what happens
            f"bench.py: {args.backend} loads the model and warms up; the timed run's progress "
            "bar follows",
            file=sys.stderr,
            flush=True,
        )
        run = engines.RUNNERS[args.backend]
        result = run(args, spec, workload)
        result.setdefault("dtype", spec.dtype)
    if result["status"] == "ok":
        result.update(throughput(result["time_s"], workload))
        result.setdefault("peak_rss_mib", engines.self_peak_rss_mib())
    elif result["status"] == "interrupted":  # Ctrl-C: the tokens made so far, over their time
        result["output_tok_s"] = result["output_tokens"] / result["time_s"]
    result.update(engine=args.backend, requested_output_tokens=workload.num_output_tokens)
    return result


def warn_if_long_on_a_cpu(args: argparse.Namespace, hf_config: dict, workload: Workload) -> None:
    """One line on stderr when nanovllm on a CPU would take more than LONG_RUN_S: how long,
    and the preset that takes seconds."""
    if args.backend != "nanovllm" or uses_cuda(args.device):
        return
    cores = args.threads or len(os.sched_getaffinity(0))
    seconds = cpu_seconds(hf_config, workload, cores)
    if seconds > LONG_RUN_S:
        tokens = workload.num_prompt_tokens + workload.num_output_tokens
        print(
            f"bench.py: this run takes ~{seconds / 60:.0f} min on this CPU (estimated: {tokens:,} "
            f"tokens x {engines.weight_bytes_per_step(hf_config, 1) / 1e9:.2f}B parameters at "
            f"{CPU_GFLOPS_PER_CORE} GFLOP/s a core, {cores} cores). For a run of seconds: "
            "python bench.py --preset cpu-small",
            file=sys.stderr,
            flush=True,
        )


def cpu_seconds(hf_config: dict, workload: Workload, cores: int) -> float:
    """A conservative estimate: every token, prompt or output, costs 2 FLOPs a parameter (the
    attention over the context is left out: it is small beside the weights at these lengths)."""
    tokens = workload.num_prompt_tokens + workload.num_output_tokens
    flops = 2 * engines.weight_bytes_per_step(hf_config, 1) * tokens
    return flops / (CPU_GFLOPS_PER_CORE * 1e9 * cores)


def throughput(time_s: float, workload: Workload) -> dict:
    return {
        "num_prompt_tokens": workload.num_prompt_tokens,
        "output_tok_s": workload.num_output_tokens / time_s,
        "total_tok_s": (workload.num_prompt_tokens + workload.num_output_tokens) / time_s,
    }


def print_result(result: dict) -> None:
    if result["status"] == "interrupted" and "output_tok_s" in result:
        print(
            f"Interrupted: {result['output_tokens']} of {result['requested_output_tokens']}tok "
            f"in {result['time_s']:.2f}s, Throughput so far: {result['output_tok_s']:.2f}tok/s"
        )
        return
    if result["status"] != "ok":
        print(f"{result['engine']}: {result['status']} {result.get('error', '')}".rstrip())
        return
    if result.get("dtype"):
        print(f"Dtype: {result['dtype']} ({result['engine']}'s; --dtype auto lets it choose)")
    print(
        f"Total: {result['output_tokens']}tok, Time: {result['time_s']:.2f}s, "
        f"Throughput: {result['output_tok_s']:.2f}tok/s"
    )
    if spec := result.get("spec_decode"):
        print(
            f"  speculative: acceptance {spec['acceptance_rate']:.1%} "
            f"({spec['num_accepted_tokens']} of {spec['num_draft_tokens']} drafts), "
            f"mean acceptance length {spec['mean_acceptance_length']:.2f} over "
            f"{spec['num_drafts']} verified rows"
        )
    if result.get("decode_time_s") is not None:
        print(
            f"  prefill {result['prefill_time_s']:.2f}s, decode {result['decode_time_s']:.2f}s "
            f"over {result['num_decode_steps']} steps ({result['mean_decode_step_ms']:.2f} "
            f"ms/step), decode bandwidth (est.) {result['decode_bandwidth_gb_s']:.1f} GB/s"
        )


# -- peers side by side ---------------------------------------------------------------------


def child_argv(args: argparse.Namespace, backend: str, json_path: str) -> list[str]:
    """This run's resolved arguments for one engine in its own process."""
    argv = ["--preset", args.preset] if args.preset else ["--model", args.model]
    for name in (
        *DEFAULT_WORKLOAD,
        "seed",
        "temperature",
        "dtype",
        "device",
        "tp",
        "max_model_len",
        "kv_cache_gib",
        "threads",
        "hf_batch_size",
        "scheduling_policy",
        "quantization",
        "speculative_config",
        "lora_adapters",
        "lora_rank",
    ):
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.async_scheduling:
        argv.append("--async-scheduling")
    return argv + ["--backend", backend, "--json", json_path]


def run_peer(args: argparse.Namespace, backend: str) -> dict:
    """One engine as `bench.py --backend X` in its own process group."""
    python = args.vllm_python if backend == "vllm" else sys.executable
    if not os.path.exists(python):
        return {"engine": backend, "status": "not installed", "error": f"no interpreter {python}"}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        json_path = os.path.join(tmp, "result.json")
        cmd = [python, os.path.abspath(__file__), *child_argv(args, backend, json_path)]
        run = compare.run_in_process_group(cmd, args.timeout, uses_cuda(args.device))
        # An interrupted engine writes its figures so far, if it had begun its timed run.
        if run.status not in ("ok", "interrupted") or not os.path.isfile(json_path):
            status = run.status if run.status != "ok" else "failed (no result)"
            # its stderr went by on ours: the tail is kept for --json, not printed again
            return {"engine": backend, "status": status, "stderr": run.stderr[-2000:]}
        with open(json_path) as f:
            result = json.load(f)["results"][0]
    if result["status"] == "ok":
        result.update(peak_rss_mib=run.peak_rss_mib, peak_gpu_mib=run.peak_gpu_mib)
    return result


def run_engines(args: argparse.Namespace) -> list[dict]:
    """nanovllm, then each peer, each in its own process group; a table of the results."""
    results = [run_peer(args, "nanovllm")]
    peer_args = argparse.Namespace(**vars(args))
    if args.dtype == "auto" and results[0]["status"] == "ok":
        peer_args.dtype = results[0]["dtype"]  # every engine runs the same dtype
    for backend in args.peers:
        if interrupted(results):  # Ctrl-C ends the comparison, not only one engine
            break
        results.append(run_peer(peer_args, backend))
    for r in results:
        if r["status"] != "ok" and r.get("error"):
            print(f"{r['engine']}: {r['error']}", file=sys.stderr)
    compare.print_table(results)
    return results


def uses_cuda(device: str) -> bool:
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """The exit status: 0, or EXIT_INTERRUPTED after Ctrl-C (the figures so far printed)."""
    args = parse_args(argv)
    if missing := missing_model(args):  # before torch is imported: at once
        raise SystemExit(missing)
    print_machine(machine())
    if args.contend:
        quiet = run_engines(args)
        if interrupted(quiet):
            results = quiet
        else:
            with contention.busy_processes(args.contend):
                busy = run_engines(args)
            contention.print_table(quiet, busy, args.contend)
            results = quiet + busy
    elif args.peers:
        results = run_engines(args)
        print_result(results[0])
    else:
        results = [run_backend(args)]
        print_result(results[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine(), "results": results}, f, indent=2)
    return EXIT_INTERRUPTED if interrupted(results) else 0


def interrupted(results: list[dict]) -> bool:
    return any(r["status"] == "interrupted" for r in results)


# The vector and matrix extensions worth naming: what the CPU computes natively.
CPU_EXTENSIONS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "amx_fp16",
    "asimd",
    "sve",
)


def machine() -> dict:
    """What the figures were measured on, and how busy it was (1-minute load average)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    lines = cpuinfo.splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "unknown")
    flags = next(
        (x.split(":", 1)[1].split() for x in lines if x.startswith(("flags", "Features"))), []
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0],
        "cpu_extensions": [f for f in CPU_EXTENSIONS if f in flags],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def print_machine(m: dict) -> None:
    print(
        f"CPU: {m['cpu']} ({m['cores']} cores; {' '.join(m['cpu_extensions']) or 'no'} "
        f"extensions), load average {m['load_avg_1min']:.2f}"
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # while loading or warming up: the timed run has no figures yet
        print("bench.py: interrupted before the timed run: no figures", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
