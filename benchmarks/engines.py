"""The engines bench.py runs, one per process: nanovllm, transformers (`hf`) and vLLM.

Each runner takes the same workload (token-id prompts, one output length per request,
`ignore_eos`), does one small warm-up generate, times the real one, and returns its
figures as a dict: status, time_s, output_tokens, and what else it can tell.
Only token ids are produced: no engine spends timed work on detokenizing.

The timed run shows a progress bar on stderr (tokens, their rate, the time left; vLLM's
is its own). Ctrl-C ends nanovllm's and transformers' timed run early: status
"interrupted", with the output tokens made so far and the time they took.
"""

import os
import resource
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter

from tqdm import tqdm

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
WARMUP_PROMPTS, WARMUP_PROMPT_LEN, WARMUP_TOKENS = 4, 32, 8


def warmup_prompts(workload) -> list[list[int]]:
    return [p[:WARMUP_PROMPT_LEN] for p in workload.prompts[:WARMUP_PROMPTS]]


def self_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _peak_gpu_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_reserved() / 2**20 if torch.cuda.is_initialized() else None


# -- nanovllm -------------------------------------------------------------------------------


def run_nanovllm(args, spec, workload) -> dict:
    from nanovllm import LLM, SamplingParams

    loras = lora_requests(args, spec)
    lora_options = dict(enable_lora=True, max_loras=len(loras), max_lora_rank=args.lora_rank)
    llm = LLM(
        spec.path,
        load_format=spec.load_format,
        dtype=spec.dtype,
        device=args.device,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        max_model_len=args.max_model_len,
        cpu_kvcache_space_gib=args.kv_cache_gib,
        scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        cpu_decode_step=args.cpu_decode_step,
        cpu_threads=args.threads or 0,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
        **(lora_options if loras else {}),
    )
    try:
        warmup = SamplingParams(
            temperature=args.temperature, max_tokens=WARMUP_TOKENS, ignore_eos=True
        )
        llm.generate(warmup_prompts(workload), warmup, use_tqdm=False)
        params = [
            SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True)
            for n in workload.output_lens
        ]
        before = llm.stats().spec_decode  # the warm-up's drafts are not the run's
        per_request = [loras[i % len(loras)] for i in range(len(params))] if loras else None
        result = _timed_steps(llm, workload.prompts, params, per_request)
        if before is not None:
            result["spec_decode"] = spec_decode_figures(before, llm.stats().spec_decode)
        result["peak_gpu_mib"] = _peak_gpu_mib()
        # what dtype="auto" chose on this machine
        result["dtype"] = str(llm.model_runner.dtype).removeprefix("torch.")
    finally:
        llm.close()
    if result["status"] == "ok":  # the bandwidth estimate counts the whole workload's reads
        result.update(decode_figures(result, spec.hf_config, result["dtype"], workload))
    return result


def lora_requests(args, spec) -> list:
    """--lora-adapters random adapters of --lora-rank, in a temporary directory (removed when
    the process exits)."""
    if not getattr(args, "lora_adapters", 0):
        return []
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    from benchmarks.lora_adapters import write_random_adapter
    from nanovllm.lora.request import LoRARequest

    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return [
        LoRARequest(
            f"lora{i}",
            i + 1,
            str(write_random_adapter(spec.hf_config, root / str(i), args.lora_rank, i)),
        )
        for i in range(args.lora_adapters)
    ]


def spec_decode_figures(before, after) -> dict:
    """Speculative decoding's counters over the timed run (after - before) and its rates."""
    figures = {
        name: getattr(after, name) - getattr(before, name)
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    drafts, tokens = figures["num_drafts"], figures["num_draft_tokens"]
    accepted = figures["num_accepted_tokens"]
    figures["acceptance_rate"] = accepted / tokens if tokens else 0.0
    figures["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
    return figures


@contextmanager
def progress_bar(total_tokens: int) -> Iterator[tqdm]:
    """A bar on stderr, redrawn every second while a step runs: a CPU's first prefill step can
    take a minute (16,384 tokens of Qwen3-0.6B), and a clock that moves says it is not stuck."""
    bar = tqdm(total=total_tokens, desc="Generating", unit="tok", dynamic_ncols=True)
    done = threading.Event()
    ticker = threading.Thread(target=_redraw_until, args=(bar, done), daemon=True)
    ticker.start()
    try:
        yield bar
    finally:
        done.set()
        ticker.join()
        bar.close()


def _redraw_until(bar: tqdm, done: threading.Event) -> None:
    while not done.wait(1.0):
        bar.refresh()  # under tqdm's lock, as update() draws


def _timed_steps(llm, prompts: list[list[int]], params: list, loras: list | None = None) -> dict:
    """generate()'s loop, timing each step: a step with prompt work (a mixed step too)
    counts as prefill time, a pure decode step as decode time. Ctrl-C ends it early.

    The bar counts the tokens computed, prompt and output alike, so that its rate and time
    left hold through the long prefill steps of a CPU (the last output token of a request is
    sampled, never computed; a preempted request computes its tokens again, past the total)."""
    start = perf_counter()
    for prompt, sp, lora in zip(prompts, params, loras or [None] * len(prompts)):
        llm.add_request(llm.make_request(prompt, sp, lora_request=lora))
    figures = {"prefill_time_s": 0.0, "decode_time_s": 0.0, "num_decode_steps": 0}
    status, output_tokens = "ok", 0
    to_compute = sum(map(len, prompts)) + sum(sp.max_tokens - 1 for sp in params)
    with progress_bar(to_compute) as bar:
        try:
            while not llm.is_finished():
                step_start = perf_counter()
                out = llm.step()
                elapsed = perf_counter() - step_start
                if out.num_prefill_tokens:
                    figures["prefill_time_s"] += elapsed
                else:
                    figures["decode_time_s"] += elapsed
                    figures["num_decode_steps"] += 1
                output_tokens += len(out.new_tokens)  # one per token made, finished or not
                bar.set_postfix(output=output_tokens, refresh=False)
                bar.update(out.num_prefill_tokens + out.num_decode_tokens)
        except KeyboardInterrupt:  # the engine dropped its requests: report what was made
            status = "interrupted"
    return {
        "status": status,
        "time_s": perf_counter() - start,
        "output_tokens": output_tokens,
        **figures,
    }


def decode_figures(result: dict, hf_config: dict, dtype: str, workload) -> dict:
    """Mean decode step time and gpt-fast's achieved-bandwidth estimate: the bytes a
    decode step must read (weights, and each sequence's K/V so far) over its time."""
    steps = result["num_decode_steps"]
    if not steps:
        return {"mean_decode_step_ms": None, "decode_bandwidth_gb_s": None}
    itemsize = _ITEMSIZE[dtype]
    # Output token j >= 2 of a request comes from a decode step over P + j - 1 tokens.
    kv_tokens = sum(
        (n - 1) * len(p) + (n - 1) * n // 2 for p, n in zip(workload.prompts, workload.output_lens)
    )
    decode_rows = sum(n - 1 for n in workload.output_lens)
    weights = weight_bytes_per_step(hf_config, itemsize)
    kv = kv_tokens * kv_bytes_per_token(hf_config, itemsize)
    return {
        "mean_decode_step_ms": 1e3 * result["decode_time_s"] / steps,
        "decode_bandwidth_gb_s": (steps * weights + kv) / result["decode_time_s"] / 1e9,
        # what a mean decode step reads, for its roofline (scripts/gpu_check.py)
        "decode_weight_gb_per_step": weights / 1e9,
        "decode_kv_gb_per_step": kv / steps / 1e9,
        "mean_decode_rows": decode_rows / steps,
        "mean_decode_context": kv_tokens / decode_rows if decode_rows else 0.0,
    }


def weight_bytes_per_step(c: dict, itemsize: int) -> int:
    """Every weight is read once per step, except an untied input embedding (a lookup)."""
    hidden, head_dim = (
        c["hidden_size"],
        c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
    )
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    layer = (
        hidden * (q + 2 * kv)
        + q * hidden
        + 3 * hidden * c["intermediate_size"]
        + 2 * hidden
        + 2 * head_dim
    )
    return itemsize * (c["num_hidden_layers"] * layer + hidden + c["vocab_size"] * hidden)


def kv_bytes_per_token(c: dict, itemsize: int) -> int:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * itemsize


# -- transformers ---------------------------------------------------------------------------


def run_hf(args, spec, workload) -> dict:
    """transformers generate() as its users batch it: fixed-size batches in request order,
    left-padded, max_new_tokens = the longest request of the batch. Only the requested
    tokens count as output; the rest of a batch's tokens are its padding cost."""
    import torch

    if args.tp != 1:
        return {"status": "unsupported", "error": "the hf peer runs on one device (--tp 1)"}
    model, device = _hf_model(args, spec)
    torch.manual_seed(args.seed)
    generate = _hf_generate(model, device, args.temperature)
    generate(warmup_prompts(workload), WARMUP_TOKENS)
    start, status, output_tokens = perf_counter(), "ok", 0
    with progress_bar(workload.num_output_tokens) as bar:
        try:
            for i in range(0, len(workload.prompts), args.hf_batch_size):
                lens = workload.output_lens[i : i + args.hf_batch_size]
                generate(workload.prompts[i : i + args.hf_batch_size], max(lens))
                output_tokens += sum(lens)
                bar.update(sum(lens))
        except KeyboardInterrupt:  # the batches done so far are the figures
            status = "interrupted"
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "status": status,
        "time_s": perf_counter() - start,
        "output_tokens": output_tokens,
        "peak_gpu_mib": _peak_gpu_mib(),
    }


def _hf_model(args, spec):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    config = AutoConfig.from_pretrained(spec.path)
    dtype = getattr(torch, spec.dtype)
    if spec.load_format == "dummy":
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype)
    model.generation_config.eos_token_id = None  # ignore_eos: always max_new_tokens
    return model.to(device).eval(), device


def _hf_generate(model, device, temperature: float):
    import torch

    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )

    def generate(prompts: list[list[int]], max_new_tokens: int) -> None:
        width = max(map(len, prompts))
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
            **sampling,
        )
        assert out.shape[1] == width + max_new_tokens, "generate stopped early"

    return generate


# -- vLLM -----------------------------------------------------------------------------------


def run_vllm(args, spec, workload) -> dict:
    """vllm.LLM with the same sampling parameters. Its CPU build sizes the KV cache from
    VLLM_CPU_KVCACHE_SPACE (whole GiB): --kv-cache-gib unless that is set."""
    try:
        import vllm
    except ImportError as e:
        return {"status": "not installed", "error": f"import vllm: {e}"}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(args.kv_cache_gib))))
    llm = vllm.LLM(
        model=spec.path,
        load_format=spec.load_format,
        dtype=spec.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        seed=args.seed,
    )
    try:
        generate = _vllm_generate(vllm, llm, args.temperature)
        warmup = warmup_prompts(workload)
        generate(warmup, [WARMUP_TOKENS] * len(warmup), progress=False)
        start = perf_counter()
        output_tokens = generate(workload.prompts, workload.output_lens, progress=True)
        elapsed = perf_counter() - start
    finally:
        # Its engine-core and worker processes otherwise keep the interpreter alive.
        llm.llm_engine.engine_core.shutdown()
    return {
        "status": "ok",
        "time_s": elapsed,
        "output_tokens": output_tokens,
        "peak_gpu_mib": None,
        "vllm_version": vllm.__version__,
    }


def _vllm_generate(vllm, llm, temperature: float):
    def generate(prompts: list[list[int]], output_lens: list[int], progress: bool) -> int:
        params = [
            vllm.SamplingParams(
                temperature=temperature, max_tokens=n, ignore_eos=True, detokenize=False
            )
            for n in output_lens
        ]
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress
        )
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return generate


RUNNERS = {"nanovllm": run_nanovllm, "hf": run_hf, "vllm": run_vllm}
