"""The batches of a profile run (ModelRunner.profile_run): the largest prefill a step can hold
and the sampler at its most rows, with every option on. A platform that sizes the KV cache by
measuring (CUDA) reads its peak memory over them; compiled ops compile on them, not in a step."""

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def largest_prefill(config: Config, block_size: int) -> list[Sequence]:
    """As many whole prompts of the longest length as one step's token budget holds."""
    max_len = min(config.max_model_len, config.max_num_batched_tokens)
    num_seqs = min(config.max_num_batched_tokens // max_len, config.max_num_seqs)  # >= 1
    seqs = [Sequence([0] * max_len, None, block_size) for _ in range(num_seqs)]
    for seq in seqs:
        seq.num_scheduled_tokens = max_len
        # Slots are computed but never written: there is no KV cache yet.
        seq.block_table.extend([0] * seq.num_blocks)
    return seqs


def sampler_batches(config: Config, block_size: int) -> list[list[Sequence]]:
    """Every option at the most rows, then plain sampling at that many, one fewer and one: a
    compiled sampler compiles its static, dynamic and size-1 versions on them."""
    rows = min(config.max_num_seqs, config.max_num_batched_tokens)
    vocab_size = config.hf_config.vocab_size
    everything = SamplingParams(
        top_k=max(1, vocab_size // 2),
        top_p=0.9,
        min_p=0.01,
        seed=0,
        min_tokens=1,
        stop_token_ids=[0],
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        logit_bias={0: 1},
    )
    plain = SamplingParams()
    batches = ((everything, rows), (plain, rows), (plain, max(1, rows - 1)), (plain, 1))
    return [[Sequence([0], p, block_size) for _ in range(n)] for p, n in batches]
