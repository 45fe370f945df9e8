"""nano-vLLM's example: two chat prompts, sampled, printed with their completions.

    python example.py [MODEL_DIR]

MODEL_DIR defaults to ~/huggingface/Qwen3-0.6B/. When that does not exist, a tiny
random Qwen3 checkpoint is built once under ~/.cache/nanovllm/ and used instead, so
the example runs on a fresh machine with no download (its text is noise).
"""

import os
import sys

from nanovllm import LLM, SamplingParams

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B/")


def pick_model() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    if os.path.isdir(DEFAULT_MODEL):
        return DEFAULT_MODEL
    from nanovllm.demo import demo_checkpoint

    path = str(demo_checkpoint())
    print(
        f"No model at {DEFAULT_MODEL}: running a tiny RANDOM demo checkpoint ({path}).\n"
        "Its output is meaningless. For real text, download Qwen3-0.6B, e.g.\n"
        "  huggingface-cli download Qwen/Qwen3-0.6B --local-dir ~/huggingface/Qwen3-0.6B/\n"
    )
    return path


def main() -> None:
    llm = LLM(pick_model(), enforce_eager=True, tensor_parallel_size=1)
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
