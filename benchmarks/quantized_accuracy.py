"""How much each weight format moves a model's output, and that the engine computes each format
exactly: one random checkpoint of Qwen3's layout (hidden 256, 2 layers, head_dim 128), every
format of it, the same prompts, teacher-forced (every position of each prompt scored, through the
public API's prompt_logprobs).

    python benchmarks/quantized_accuracy.py [--prompts 8] [--length 96]

Per format, over every scored position:
- exact: max |our logprob - transformers' logprob| of the prompt's next token, transformers running
  the weights the format stands for (dequantized: our int8/int4 layers' own dequantize(); the
  GPTQ/AWQ values the file was written from; a GGUF through transformers' own GGUF reading);
- error: max and mean |our logprob - the float32 model's| (what quantizing costs);
- top-1: how often our most likely next token is the float32 model's.

The GPTQ, AWQ and GGUF files are written as the tests write them (random weights, each tool's
packing: tests/test_published_quantization.py, tests/gguf_files.py).
"""

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.demo import build_tiny_qwen3  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=128)


def ours(path: Path, prompts: list[list[int]], **kwargs) -> tuple[list[torch.Tensor], LLM]:
    """Per prompt: our logprob of each next prompt token, and our top-1 token, per position."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    llm = LLM(str(path), device="cpu", num_kvcache_blocks=64, **kwargs)
    scores = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        entries = out.prompt_logprobs[1:]  # the first token has none
        tokens = out.prompt_token_ids[1:]
        actual = torch.tensor([e[t].logprob for e, t in zip(entries, tokens)])
        top = torch.tensor([max(e, key=lambda t: e[t].logprob) for e in entries])
        scores.append((actual, top))
    return scores, llm


def reference(model, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' same figures."""
    found = []
    with torch.no_grad():
        for prompt in prompts:
            logprobs = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
            nxt = torch.tensor(prompt[1:])
            found.append((logprobs[torch.arange(len(nxt)), nxt], logprobs.argmax(-1)))
    return found


def dequantized_model(base: Path, llm: LLM):
    """transformers' model of `base` with each linear weight our layer's dequantize()."""
    from conftest import hf_model

    model = copy.deepcopy(hf_model(str(base)))
    params = dict(model.named_parameters())
    packed = llm.model_runner.model.packed_modules_mapping
    for name, module in llm.model_runner.model.named_modules():
        weight_format = getattr(module, "weight_format", None)
        if weight_format is None or not hasattr(weight_format, "dequantize"):
            continue
        weight = weight_format.dequantize()
        parts = [(c, s) for c, (p, s) in packed.items() if name.endswith(p)]
        if not parts:
            params[f"{name}.weight"].data.copy_(weight)
            continue
        offset = 0
        for checkpoint_part, _ in parts:  # q, k, v (or gate, up) in order
            target = params[f"{name.rsplit('.', 1)[0]}.{checkpoint_part}.weight"]
            target.data.copy_(weight[offset : offset + target.shape[0]])
            offset += target.shape[0]
    return model


def row(name: str, got, exact_ref, float_ref) -> str:
    exact = max(float((a - b).abs().max()) for (a, _), (b, _) in zip(got, exact_ref))
    errors = torch.cat([(a - b).abs() for (a, _), (b, _) in zip(got, float_ref)])
    agree = torch.cat([(a == b).float() for (_, a), (_, b) in zip(got, float_ref)])
    return (
        f"| {name} | {exact:.1e} | {float(errors.max()):.3f} | {float(errors.mean()):.4f} | "
        f"{100 * float(agree.mean()):.1f}% |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=96)
    args = p.parse_args()
    from conftest import hf_model
    from gguf_files import Q, write_gguf
    from test_published_quantization import hf_dequantized_model, quantized_checkpoint
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="quantized-accuracy-"))
    base = build_tiny_qwen3(tmp / "base", **SHAPE)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 500, (args.length,), generator=g).tolist() for _ in range(args.prompts)
    ]
    float_ref = reference(hf_model(str(base)), prompts)
    columns = ("exact: max vs its dequantized weights", "error: max vs float32", "mean")
    print(f"| format | {' | '.join(columns)} | top-1 as float32 |")
    print("|---|---|---|---|---|")
    got, llm = ours(base, prompts)
    print(row("float32", got, float_ref, float_ref))
    llm.close()
    for method in ("int8", "int4"):
        try:
            got, llm = ours(base, prompts, quantization=method)
        except ValueError as e:  # a method this tree does not have
            print(f"| {method} | {e} | | | |")
            continue
        exact_ref = reference(dequantized_model(base, llm), prompts)
        llm.close()
        print(row(method, got, exact_ref, float_ref))
    for method in ("gptq", "awq"):
        path, weights = quantized_checkpoint(base, tmp / method, method, group=128)
        got, llm = ours(path, prompts)
        llm.close()
        print(
            row(
                f"{method} (g128)",
                got,
                reference(hf_dequantized_model(base, weights), prompts),
                float_ref,
            )
        )
    for kind in ("Q4_0", "Q4_K", "Q8_0"):
        folder = tmp / kind
        folder.mkdir()
        file = write_gguf(base, folder / "model.gguf", Q[kind], lm_head=Q[kind])
        got, llm = ours(file, prompts)
        llm.close()
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file.name, dtype=torch.float32
        )
        print(row(f"GGUF {kind}", got, reference(model.eval(), prompts), float_ref))


if __name__ == "__main__":
    main()
