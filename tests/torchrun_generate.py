"""Run by tests/test_multinode.py under torchrun: every rank builds the same LLM, generates
the same prompts, and writes what it got to OUT_DIR/rank<RANK>.json.

    torchrun ... tests/torchrun_generate.py MODEL OUT_DIR TP DP [--die-rank R]
"""

import json
import os
import sys
import time

from nanovllm import LLM, SamplingParams


def main(model: str, out_dir: str, tp: int, dp: int, die_rank: int | None) -> None:
    prompts = json.load(open(os.path.join(out_dir, "prompts.json")))
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=8 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    rank = int(os.environ["RANK"])
    with LLM(
        model,
        device="cpu",
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        kvcache_block_size=16,
        num_kvcache_blocks=64,
    ) as llm:
        if rank == die_rank:
            os._exit(3)  # a rank that dies once the engine is up
        start = time.monotonic()
        try:
            result = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        except Exception as e:
            result = {"error": type(e).__name__, "seconds": time.monotonic() - start}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    args = sys.argv[1:]
    die = int(args[args.index("--die-rank") + 1]) if "--die-rank" in args else None
    main(args[0], args[1], int(args[2]), int(args[3]), die)
