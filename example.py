"""nano-vLLM's example: two chat prompts, sampled, printed with their completions.

    python example.py [MODEL_DIR]

MODEL_DIR defaults to ~/huggingface/Qwen3-0.6B/. When that does not exist, a tiny
random Qwen3 checkpoint is built once under ~/.cache/nanovllm/ and used instead, so
the example runs on a fresh machine with no download (its text is noise).
"""

import os
import sys

from nanovllm import SamplingParams
from nanovllm.demo import DEMO_DIR, DOWNLOAD_COMMAND, demo_checkpoint

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B/")


def pick_model() -> str:
    """MODEL_DIR if given (checked at once), else the default model, else the demo checkpoint."""
    if len(sys.argv) > 1:
        path = os.path.expanduser(sys.argv[1])
        if not os.path.isfile(os.path.join(path, "config.json")):
            sys.exit(
                f"example.py: no model at {path!r} (no config.json). Run `python example.py` "
                f"for the tiny random demo, or download Qwen3-0.6B:\n  {DOWNLOAD_COMMAND}"
            )
        return path
    if os.path.isdir(DEFAULT_MODEL):
        return DEFAULT_MODEL
    # Said before the demo is built: the build prints a progress bar of its own.
    print(
        f"No model at {DEFAULT_MODEL}: running a tiny RANDOM demo checkpoint ({DEMO_DIR}).\n"
        "Its output is meaningless. For real text, download Qwen3-0.6B, e.g.\n"
        f"  {DOWNLOAD_COMMAND}\n",
        flush=True,
    )
    return str(demo_checkpoint())


def main() -> None:
    model = pick_model()
    from nanovllm import LLM  # after the model is checked: the engine imports torch, seconds

    llm = LLM(model, enforce_eager=True, tensor_parallel_size=1)
    sampling_params = SamplingParams(temperature=0.6, max_tokens=256)
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        for prompt in prompts
    ]
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        print("\n")
        print(f"Prompt: {prompt!r}")
        print(f"Completion: {output['text']!r}")
    llm.close()


if __name__ == "__main__":
    main()
