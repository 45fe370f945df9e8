"""SamplingParams.logit_bias and min_tokens, as one sparse add to the logits before anything
else (imported only once a request has either): logit_bias's values, and -inf on the stop ids
(EOS unless ignored) that min_tokens still forbids, which outranks any bias."""

from itertools import chain

import numpy as np
import torch

from nanovllm.core.sequence import Sequence


def build_bias(seqs: list[Sequence], put) -> tuple[torch.Tensor, ...] | None:
    """(rows, token ids, values) to add to the logits, one entry per (row, id): logit_bias, and
    -inf for the stop ids that min_tokens forbids (each sequence's, EOS unless ignored)."""
    biases = [
        seq.sampling_params.logit_bias | dict.fromkeys(seq.stop_token_ids, float("-inf"))
        if seq.num_completion_tokens < seq.sampling_params.min_tokens
        else seq.sampling_params.logit_bias
        for seq in seqs
    ]
    lens = [len(bias) for bias in biases]
    total = sum(lens)
    if total == 0:
        return None
    ids = np.fromiter(chain.from_iterable(biases), np.int64, total)  # faster than lists
    values = np.fromiter(chain.from_iterable(b.values() for b in biases), np.float32, total)
    return *put(np.stack([np.repeat(np.arange(len(seqs)), lens), ids])), put(values)
