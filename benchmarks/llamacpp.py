"""nanovllm beside llama.cpp on a CPU, the same random weights in both, side by side and
alternating: single-stream prefill and decode tok/s (llama-bench's pp and tg), and batched decode
throughput (llama-batched-bench's S_TG).

    python benchmarks/llamacpp.py --llama-cpp ~/src/llama.cpp --preset qwen3-0.6b --threads 1
    python benchmarks/llamacpp.py --llama-cpp ~/src/llama.cpp --formats int4 --rounds 2

--formats picks the pairs: f32 (float32 in both), int8 (nanovllm's int8 against llama.cpp's q8_0)
and int4: llama.cpp's Q4_0 and Q4_K_M files (llama-quantize's, from its f32 file) against
nanovllm's own int4 (quantization="int4") and nanovllm reading those very files (a GGUF's Q4_0
and Q4_K tensors run our int4 kernel; the Q6_K ones llama-quantize leaves in a file are
dequantized to float at load).

It builds nothing of llama.cpp: give it a llama.cpp source tree whose binaries are built
(`--llama-cpp DIR`: DIR/convert_hf_to_gguf.py and DIR/build/bin/llama-bench, or --llama-bin) and a
Python that can run its converter (`--gguf-python`: one with gguf, sentencepiece, torch,
transformers, safetensors). One way to get them, as docs/benchmarks.md says:

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON \\
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
    cmake --build build -j --target llama-bench llama-batched-bench llama-quantize

The checkpoint (config of the preset, weights drawn by transformers, a small byte-level BPE
tokenizer: the runs feed token ids) and its GGUF files (f32, and q8_0 beside int8) are cached under
~/.cache/nanovllm/llamacpp/. Each engine runs in a process group of its own, killed afterwards.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CACHE = Path(os.path.expanduser("~/.cache/nanovllm/llamacpp"))
# llama.cpp's converter does not know our tokenizer's pre-tokenizer (its hash): it is tokenizers'
# ByteLevel with GPT-2's regex, so fall back to llama.cpp's "gpt-2" one.
CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import convert_hf_to_gguf
from conversion.base import TextModel
original = TextModel.get_vocab_base_pre
def vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = vocab_base_pre
convert_hf_to_gguf.main()
"""


def checkpoint(preset: str) -> Path:
    """The preset's config with random weights (float32) and a tokenizer, built once."""
    path = CACHE / f"{preset}-weights"
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench import PRESETS
    from nanovllm.demo import build_tokenizer

    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(
        json.dumps(dict(PRESETS[preset].config, torch_dtype="float32"))
    )
    build_tokenizer(tmp)
    config = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def gguf(ckpt: Path, outtype: str, llama_cpp: Path, python: str) -> Path:
    """The checkpoint converted by llama.cpp's own converter, once per type."""
    out = ckpt.with_name(f"{ckpt.name}-{outtype}.gguf")
    if not out.is_file():
        cmd = [python, "-c", CONVERT, str(llama_cpp), str(ckpt), "--outtype", outtype]
        subprocess.run([*cmd, "--outfile", str(out)], check=True, capture_output=True)
    return out


def quantized_gguf(f32: Path, kind: str, bin_dir: Path) -> Path:
    """llama-quantize's `kind` (Q4_0, Q4_K_M) of the f32 file, once; alone in a folder of its
    own (nanovllm takes the file's path)."""
    out = f32.with_name(f"{f32.stem}-{kind}") / "model.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(bin_dir / "llama-quantize"), str(f32), str(out), kind]
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def in_group(cmd: list[str], timeout: float) -> str:
    """`cmd`'s stdout, run in a process group of its own that is killed afterwards."""
    from benchmarks.compare import kill_group

    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc.pid)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
    return out


def llama_single(bin_dir: Path, model: Path, args) -> dict:
    """llama-bench's prefill of the prompt, then its decode after a prompt's worth of context
    (`-d`): nanovllm's decode steps attend over prompt + generated tokens too."""
    speed = {}
    for name, test in (
        ("prefill", ["-p", args.prompt, "-n", 0]),
        ("decode", ["-p", 0, "-n", args.gen, "-d", args.prompt]),
    ):
        cmd = [str(bin_dir / "llama-bench"), "-m", str(model), *map(str, test)]
        cmd += ["-t", str(args.threads), "-r", "3", "-o", "json"]
        speed[f"{name}_tok_s"] = json.loads(in_group(cmd, args.timeout))[0]["avg_ts"]
    return speed


def llama_batched(bin_dir: Path, model: Path, args) -> dict:
    context = args.batch * (args.prompt + args.gen) + 64
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(context), "-b", "2048"]
    cmd += ["-ub", "512", "-npp", str(args.prompt), "-ntg", str(args.gen)]
    cmd += ["-npl", str(args.batch), "-t", str(args.threads)]
    out = in_group(cmd, args.timeout)
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |: S_TG, the 8th
    row = next(line for line in out.splitlines() if re.match(rf"\|\s+{args.prompt}\s+\|", line))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return {"batched_decode_tok_s": float(cells[7])}


def nanovllm_run(ckpt: Path, args, quantization: str | None) -> dict:
    """One engine in a process of its own (this script with --child); `ckpt` a checkpoint
    folder or a GGUF file."""
    cmd = [sys.executable, __file__, "--child", str(ckpt), "--threads", str(args.threads)]
    cmd += ["--prompt", str(args.prompt), "--gen", str(args.gen), "--batch", str(args.batch)]
    if quantization:
        cmd += ["--quantization", quantization]
    if not args.cpu_decode_step:
        cmd += ["--no-cpu-decode-step"]
    return json.loads(in_group(cmd, args.timeout).strip().splitlines()[-1])


def child(args) -> None:
    """Single stream: one request's prefill and decode timed step by step; then `batch`
    requests, decode throughput over the steps after every prompt is in."""
    import time

    import torch

    from nanovllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(0, 500, (args.prompt,), generator=g).tolist() for _ in range(n)]

    def timed(llm: LLM, n: int) -> tuple[float, float, int]:
        for prompt in prompts(n):
            llm.add_request(prompt, params)
        prefill = decode = 0.0
        decoded = 0
        while not llm.is_finished():
            start = time.perf_counter()
            out = llm.step()
            elapsed = time.perf_counter() - start
            if out.num_prefill_tokens:
                prefill += elapsed
            else:
                decode += elapsed
                decoded += out.num_decode_tokens
        return prefill, decode, decoded

    with LLM(
        args.child,
        device="cpu",
        dtype="float32",
        cpu_threads=args.threads,
        quantization=args.quantization,
        cpu_decode_step=args.cpu_decode_step,
        max_model_len=args.prompt + args.gen + 16,
        cpu_kvcache_space_gib=1.0,
    ) as llm:
        timed(llm, 1)  # warm-up
        prefill, decode, decoded = timed(llm, 1)
        result = {"prefill_tok_s": args.prompt / prefill, "decode_tok_s": decoded / decode}
        if args.batch > 1:
            _, decode, decoded = timed(llm, args.batch)
            result["batched_decode_tok_s"] = decoded / decode
    print(json.dumps(result))


def machine_line() -> str:
    from bench import machine

    m = machine()
    extensions = " ".join(m["cpu_extensions"])
    return f"{m['cpu']} ({m['cores']} cores; {extensions}), load {m['load_avg_1min']:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree with built binaries")
    p.add_argument(
        "--llama-bin", type=Path, help="where llama-bench is (default LLAMA_CPP/build/bin)"
    )
    p.add_argument("--gguf-python", default=sys.executable, help="runs llama.cpp's converter")
    p.add_argument(
        "--preset", default="cpu-small", help="bench.py's presets: cpu-small, qwen3-0.6b"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="requests of the batched run")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of every engine")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--quantization", default=None)
    p.add_argument(
        "--formats", default="f32,int8", help="pairs to run: f32, int8, int4 (default: f32,int8)"
    )
    p.add_argument(
        "--cpu-decode-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nanovllm's native decode step (default: on)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    bin_dir = args.llama_bin or args.llama_cpp / "build" / "bin"
    ckpt = checkpoint(args.preset)
    engines = {}  # name -> its run, every round
    formats = args.formats.split(",")
    if "f32" in formats or "int4" in formats:
        f32 = gguf(ckpt, "f32", args.llama_cpp, args.gguf_python)
    if "f32" in formats:
        engines["llama.cpp f32"] = lambda: llama_runs(bin_dir, f32, args)
        engines["nanovllm f32"] = lambda: nanovllm_run(ckpt, args, None)
    if "int8" in formats or "int4" in formats:
        q8_0 = gguf(ckpt, "q8_0", args.llama_cpp, args.gguf_python)
        engines["llama.cpp q8_0"] = lambda: llama_runs(bin_dir, q8_0, args)
        engines["nanovllm int8"] = lambda: nanovllm_run(ckpt, args, "int8")
    if "int4" in formats:
        files = {kind: quantized_gguf(f32, kind, bin_dir) for kind in ("Q4_0", "Q4_K_M")}
        engines["nanovllm int4"] = lambda: nanovllm_run(ckpt, args, "int4")
        for kind, file in files.items():
            engines[f"llama.cpp {kind}"] = lambda file=file: llama_runs(bin_dir, file, args)
            engines[f"nanovllm {kind}"] = lambda file=file: nanovllm_run(file, args, None)
    print(
        f"CPU: {machine_line()}; {args.preset}, {args.threads} thread(s), prompt {args.prompt}, "
        f"{args.gen} generated, batch {args.batch}"
    )
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, run in engines.items():
            results[name].append(run())
    report(results)


def llama_runs(bin_dir: Path, model: Path, args) -> dict:
    result = llama_single(bin_dir, model, args)
    if args.batch > 1:
        result.update(llama_batched(bin_dir, model, args))
    return result


def report(results: dict[str, list[dict]]) -> None:
    figures = [  # the batched one only with --batch > 1
        f
        for f in ("prefill_tok_s", "decode_tok_s", "batched_decode_tok_s")
        if all(f in r for runs in results.values() for r in runs)
    ]
    medians = {
        n: {f: statistics.median(r[f] for r in runs) for f in figures}
        for n, runs in results.items()
    }
    print(f"{'engine':<20}" + "".join(f"{f:>22}" for f in figures) + "   (medians of the rounds)")
    for name, m in medians.items():
        print(f"{name:<20}" + "".join(f"{m[f]:>22.1f}" for f in figures))
    for ours, theirs in RATIOS:
        if ours in medians and theirs in medians:
            ratios = "".join(f"{medians[ours][f] / medians[theirs][f]:>21.2f}x" for f in figures)
            print(f"{ours.removeprefix('nanovllm ')} / {theirs:<24}{ratios}")


RATIOS = (  # (ours, theirs): the lines of ratios under the table
    ("nanovllm f32", "llama.cpp f32"),
    ("nanovllm int8", "llama.cpp q8_0"),
    ("nanovllm int4", "llama.cpp Q4_0"),
    ("nanovllm int4", "llama.cpp Q4_K_M"),
    ("nanovllm Q4_0", "llama.cpp Q4_0"),
    ("nanovllm Q4_K_M", "llama.cpp Q4_K_M"),
    ("nanovllm int4", "nanovllm int8"),
)


if __name__ == "__main__":
    main()
