"""Shared by the CUDA-graph tests (the CPU stand-in in test_cuda_graph.py and the real
graphs in test_cuda.py): the decode workload and a replay recorder."""

import torch

from nanovllm import SamplingParams
from nanovllm.platforms.cuda.graphs import CUDAGraphRunner

BLOCK = 16


def graph_workload(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """32 greedy requests: ragged prompts, six identical ones (nano-vLLM issue #89; with a
    small token budget the later ones hit the earlier ones' cached blocks), and staggered
    max_tokens, so that as requests finish the decode batch shrinks through sizes
    between the captured ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4 * BLOCK, (26,), generator=g).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    same = torch.randint(3, 500, (2 * BLOCK + 3,), generator=g).tolist()
    prompts[3:3] = [same] * 6
    params = [
        SamplingParams(temperature=0, max_tokens=1 + (7 * i) % 37, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


def record_replays(graphs: CUDAGraphRunner) -> list[int]:
    """The batch size of every decode step `graphs` runs from now on."""
    sizes: list[int] = []
    run = graphs.run

    def recording_run(input_ids, positions, metadata):
        sizes.append(input_ids.shape[0])
        return run(input_ids, positions, metadata)

    graphs.run = recording_run
    return sizes


# A decode at position 64 needs a fifth block of 16: the block-table buffer's full width.
EDGE_MAX_MODEL_LEN = 4 * BLOCK + 2


def edge_of_max_model_len() -> tuple[list[list[int]], list[int]]:
    """Prompts at the end of max_model_len and how many tokens each gets: generation stops
    at max_model_len tokens, so a prompt of max_model_len - 1 gets one (from its prefill)
    and one of max_model_len - 2 gets a second from a decode step at the last position."""
    g = torch.Generator().manual_seed(1)
    lengths = [EDGE_MAX_MODEL_LEN - 1, EDGE_MAX_MODEL_LEN - 2, EDGE_MAX_MODEL_LEN - 3]
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    return prompts, [EDGE_MAX_MODEL_LEN - n for n in lengths]
