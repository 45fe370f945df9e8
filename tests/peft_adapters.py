"""Random LoRA adapters built offline with PEFT itself (as PeftModel.save_pretrained writes
them), and PEFT's greedy tokens under them: the oracle of the LoRA tests."""

from functools import cache
from pathlib import Path

import peft
import torch
from conftest import hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base: Path, out: Path, rank: int, targets: list[str], seed: int, **config
) -> Path:
    """A random LoRA of `base` saved by PEFT; B scaled up so the adapter changes the tokens."""
    torch.manual_seed(seed)
    model = load_base(base)
    lora = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **config
    )
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(5.0)
    model.save_pretrained(out)
    return out


def load_base(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@cache
def peft_model(base: Path, adapter: Path | None):
    """transformers' model of `base`, with PEFT applying `adapter` (None: the base alone)."""
    if adapter is None:
        return hf_model(str(base))
    model = peft.PeftModel.from_pretrained(load_base(base), adapter).eval()
    model.generation_config.eos_token_id = None  # runs the full length, as ignore_eos does
    return model


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int = 12) -> list[int]:
    out = peft_model(base, adapter).generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()
