"""Speculative decoding's parts without a model: the config, the n-gram proposer, the
scheduler's drafts and rollback on the block manager (its invariants after each step), and the
rejection sampler's output distribution against the target's (a chi-square test)."""

import math
from collections import Counter

import numpy as np
import pytest
import torch
from invariants import check_scheduler

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import FinishReason, Sequence
from nanovllm.sampling.metadata import SamplingMetadataBuilder
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.verify import sample_positions
from nanovllm.sampling_params import SamplingParams
from nanovllm.speculative.config import SpeculativeConfig, parse_speculative_config
from nanovllm.speculative.ngram import NgramProposer, find_drafts
from nanovllm.speculative.scheduler import SpeculativeScheduler, num_accepted_drafts

# -- config ----------------------------------------------------------------------------------


def test_config_takes_vllms_dict_and_its_json_text():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert parse_speculative_config(text, False) == SpeculativeConfig(3, "ngram", 4, 4)
    assert parse_speculative_config({"num_speculative_tokens": 2}, False) == (
        SpeculativeConfig(2, "ngram", 5, 5)
    )
    got = parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 2}, False)
    assert (got.prompt_lookup_min, got.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(
    "value, key",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "exceed"),
        ({"num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ("{not json", "JSON"),
    ],
)
def test_a_bad_config_is_a_value_error_naming_the_key(value, key):
    with pytest.raises(ValueError, match=key):
        parse_speculative_config(value, False)


def test_a_config_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="speculative_config"):
        parse_speculative_config(4, False)
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        parse_speculative_config({"num_speculative_tokens": "4"}, False)


def test_speculation_is_refused_beside_async_scheduling():
    with pytest.raises(ValueError, match="async_scheduling"):
        parse_speculative_config({"num_speculative_tokens": 2}, async_scheduling=True)


# -- the proposer ----------------------------------------------------------------------------


def drafts_of(tokens, min_n=1, max_n=3, k=3):
    return find_drafts(np.array(tokens, np.int64), tokens, min_n, max_n, k)


def test_the_longest_matching_ngram_wins_and_its_continuation_is_proposed():
    # "8 1 2" occurred once (followed by 5 6 7); "2" alone occurred later, followed by 9.
    tokens = [8, 1, 2, 5, 6, 7, 2, 9, 3, 8, 1, 2]
    assert drafts_of(tokens) == [5, 6, 7]
    assert drafts_of(tokens, max_n=1) == [9, 3, 8]  # only 1-grams: the latest "2"


def test_no_draft_below_prompt_lookup_min_or_without_an_earlier_occurrence():
    assert drafts_of([4, 1, 2, 7, 1, 2], min_n=3) == []  # "1 2" matches, "7 1 2" does not
    assert drafts_of([4, 1, 2, 7, 1, 2], min_n=2) == [7, 1, 2]
    assert drafts_of([1, 2, 3, 4]) == []


def test_drafts_stop_at_the_end_of_the_history_and_at_k():
    assert drafts_of([5, 6, 5], k=4) == [6, 5]  # the only occurrence has 2 tokens after it
    assert drafts_of([3, 3, 3, 3, 3, 3], max_n=2, k=2) == [3, 3]


def test_the_proposer_follows_a_growing_sequence():
    proposer = NgramProposer(num_speculative_tokens=2, min_n=2, max_n=2)
    seq = Sequence([1, 2, 3], SamplingParams(), block_size=4)
    assert proposer.propose(seq, limit=5) == []
    for token in [4, 1, 2] + list(range(100, 200)) + [100, 101]:
        seq.append_token(token)
    assert proposer.propose(seq, limit=5) == [102, 103]
    assert proposer.propose(seq, limit=1) == [102]
    proposer.forget(seq.seq_id)
    assert proposer.histories == {}


# -- drafts and rollback in the scheduler ------------------------------------------------------


class FixedProposer:
    """Proposes `drafts` (cut to the limit) for every decoding sequence."""

    def __init__(self):
        self.drafts: list[int] = []
        self.limits: list[int] = []

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        self.limits.append(limit)
        return self.drafts[:limit]

    def forget(self, seq_id: int) -> None:
        pass


def speculative_scheduler(num_blocks=16, budget=32):
    proposer = FixedProposer()
    scheduler = SpeculativeScheduler(
        BlockManager(num_blocks, 4, True),
        proposer=proposer,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=64,
    )
    return scheduler, proposer


def prefilled(scheduler, params=None, prompt=(10, 11, 12, 13, 14, 15)) -> Sequence:
    """A sequence whose 6-token prompt is computed and whose first token (100) is taken."""
    params = params or SamplingParams(max_tokens=20, ignore_eos=True)
    seq = Sequence(list(prompt), params, block_size=4)
    scheduler.add(seq)
    assert scheduler.schedule() == [seq] and seq.num_scheduled_tokens == 6
    scheduler.postprocess([seq], [100])
    return seq


def test_a_row_with_drafts_schedules_them_all_with_slots():
    scheduler, proposer = speculative_scheduler()
    seq = prefilled(scheduler)
    proposer.drafts = [101, 102, 103, 104, 105]
    assert scheduler.schedule() == [seq]
    assert not seq.is_prefill and seq.num_scheduled_tokens == 6  # its last token + 5 drafts
    assert seq.token_ids[-6:] == [100, 101, 102, 103, 104, 105]
    assert len(seq.block_table) * 4 >= seq.num_tokens == 12  # slots up to the last draft
    check_scheduler(scheduler)


def test_rejected_drafts_are_rolled_back_and_only_accepted_blocks_hashed():
    scheduler, proposer = speculative_scheduler()
    seq = prefilled(scheduler)
    blocks = scheduler.block_manager
    proposer.drafts = [101, 102, 103, 104, 105]
    scheduler.schedule()
    # The target agrees with 101 and 102, not 103: it says 999 there.
    taken, num_accepted = scheduler.verify(seq, [101, 102, 999, 7, 7, 7])
    assert (taken, num_accepted) == ([101, 102, 999], 2)
    assert seq.completion_token_ids == [100, 101, 102, 999] and seq.num_scheduled_tokens == 0
    assert seq.num_cached_tokens == 9 == seq.num_tokens - 1  # KV of 10..15 100 101 102
    assert len(seq.block_table) == 3  # block 3 (positions 12..) was for drafts only: freed
    hashed = [blocks.blocks[b].hash is not None for b in seq.block_table]
    assert hashed == [True, True, False]  # block 2 holds accepted 102, then rejected KV
    assert next(iter(blocks.free_block_ids)) not in seq.block_table  # freed ones go first
    check_scheduler(scheduler)
    # A draft rejected at once: one token taken, the drafts' blocks all given back.
    proposer.drafts = [5, 6, 7, 8, 9]
    scheduler.schedule()
    assert scheduler.verify(seq, [42, 1, 1, 1, 1, 1]) == ([42], 0)
    assert seq.num_cached_tokens == 10 and len(seq.block_table) == 3
    check_scheduler(scheduler)


def test_a_stop_token_inside_the_accepted_drafts_ends_the_sequence_there():
    scheduler, proposer = speculative_scheduler()
    params = SamplingParams(max_tokens=20, stop_token_ids=[102])
    seq = prefilled(scheduler, params)
    proposer.drafts = [101, 102, 103]
    scheduler.schedule()
    assert scheduler.verify(seq, [101, 102, 103, 104]).taken == [101, 102]
    assert seq.is_finished and seq.finish_reason is FinishReason.STOP
    assert seq.completion_token_ids == [100, 101, 102] and not seq.block_table
    assert scheduler.is_finished()
    check_scheduler(scheduler)
    assert scheduler.block_manager.num_free_blocks == 16  # nothing leaked


def test_drafts_never_run_past_max_tokens_nor_the_step_budget():
    scheduler, proposer = speculative_scheduler(budget=8)
    seq = prefilled(scheduler, SamplingParams(max_tokens=4, ignore_eos=True))
    proposer.drafts = [1, 2, 3, 4, 5, 6]
    scheduler.schedule()
    # 1 token of 4 taken: the row may take 3 more, its own token and 2 drafts.
    assert proposer.limits[-1] == 2 and seq.num_scheduled_tokens == 3
    assert scheduler.verify(seq, [1, 2, 9]).taken == [1, 2, 9]
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_completion_tokens == 4
    other = prefilled(scheduler, SamplingParams(max_tokens=40), prompt=(60, 61, 62, 63, 64, 65))
    late = Sequence(list(range(30, 50)), SamplingParams(max_tokens=2), block_size=4)
    scheduler.add(late)
    seqs = scheduler.schedule()
    # Budget 8: the decode row's token and 6 drafts leave one prompt token for `late`.
    assert proposer.limits[-1] == 7 and other.num_scheduled_tokens == 7
    assert seqs == [other, late] and late.num_scheduled_tokens == 1
    check_scheduler(scheduler)


def test_drafts_take_only_free_blocks_and_never_preempt():
    scheduler, proposer = speculative_scheduler(num_blocks=3)
    seq = prefilled(scheduler)  # 2 blocks, position 6 in the second
    proposer.drafts = list(range(200, 210))
    scheduler.schedule()
    assert seq.num_scheduled_tokens == 6  # the third block holds positions 8..11: 5 drafts
    assert scheduler.num_preemptions == 0 and scheduler.block_manager.num_free_blocks == 0
    scheduler.verify(seq, [200, 201, 202, 203, 204, 205])  # all accepted, bonus 205
    assert seq.num_cached_tokens == 12 and seq.last_token == 205
    check_scheduler(scheduler)


def test_preemption_holds_as_without_drafts():
    scheduler, proposer = speculative_scheduler(num_blocks=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    first, second = (Sequence(list(range(s, s + 8)), params, block_size=4) for s in (10, 30))
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.schedule() == [first, second]  # both prompts: all 4 blocks
    scheduler.postprocess([first, second], [100, 200])
    proposer.drafts = [1, 2]
    # first's token needs a block: second (the newest) is preempted, as without drafts, and
    # first's drafts fit in the block it got.
    assert scheduler.schedule() == [first] and scheduler.num_preemptions == 1
    assert first.num_scheduled_tokens == 3 and second.status.name == "WAITING"
    assert second.token_ids == list(range(30, 38)) + [200] and not second.block_table
    assert scheduler.verify(first, [1, 5, 5]).taken == [1, 5]
    check_scheduler(scheduler)


def test_a_row_whose_drafts_keep_failing_backs_off_until_one_is_accepted():
    scheduler, proposer = speculative_scheduler()
    seq = prefilled(scheduler, SamplingParams(max_tokens=60, ignore_eos=True))
    proposer.drafts = [1, 2]
    verified_at = []
    for step in range(1, 16):
        scheduler.schedule()
        if seq.seq_id in scheduler.drafts:
            verified_at.append(step)
            scheduler.verify(seq, [9, 9, 9])  # every draft wrong
        else:
            scheduler.postprocess([seq], [9])
        check_scheduler(scheduler)
    assert verified_at == [1, 3, 7, 15]  # then 2, 4, 8 steps without drafts
    scheduler.schedule()  # step 16: still backing off
    assert seq.seq_id not in scheduler.drafts
    scheduler.postprocess([seq], [9])
    for _ in range(16):  # at step 31 it proposes again; an accepted draft ends the back-off
        scheduler.schedule()
        if seq.seq_id in scheduler.drafts:
            break
        scheduler.postprocess([seq], [9])
    scheduler.verify(seq, [1, 9, 9])
    scheduler.schedule()
    assert seq.seq_id in scheduler.drafts


# -- the rejection sampler -----------------------------------------------------------------------


def chi_square_p_value(observed: Counter, expected: dict, n: int) -> float:
    """P(chi2 >= statistic) over the categories of `expected` (probabilities)."""
    statistic = sum((observed[c] - n * p) ** 2 / (n * p) for c, p in expected.items())
    assert sum(observed.values()) == sum(observed[c] for c in expected)  # no impossible outcome
    df = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, torch.tensor(statistic / 2, dtype=torch.float64)).item()


def test_speculative_sampling_draws_exactly_from_the_target_distribution():
    """Two drafts verified at temperature 0.7: the first two tokens a row yields must be
    distributed as the target's, p0(t0) * p1(t1), whatever the drafts: t0 != d1 ends the row
    there (the residual), t0 == d1 (accepted, with probability p0(d1)) goes on to t1 ~ p1."""
    torch.manual_seed(0)
    vocab, n, drafts = 6, 6000, [2, 4]
    logits = torch.randn(3, vocab) * 1.5  # the target's logits at the row's three positions
    params = SamplingParams(temperature=0.7)
    seqs = []
    for _ in range(n):
        seq = Sequence([1, 2, 3] + drafts, params, block_size=4)
        seq.num_prompt_tokens = 3  # the drafts follow the prompt
        seqs.append(seq)
    sampled, _ = sample_positions(
        Sampler(),
        SamplingMetadataBuilder(vocab, torch.device("cpu")),
        seqs,
        {seq.seq_id: drafts for seq in seqs},
        logits.repeat(n, 1),
    )
    rows = sampled.view(n, 3).tolist()
    yields = Counter()
    for row in rows:
        k = num_accepted_drafts(drafts, row)
        yields[tuple(row[: min(k + 1, 2)])] += 1
    p = torch.softmax(logits.double() / 0.7, dim=-1)
    expected = {(t,): p[0, t].item() for t in range(vocab) if t != drafts[0]}
    expected |= {(drafts[0], u): (p[0, drafts[0]] * p[1, u]).item() for u in range(vocab)}
    assert 0.1 < p[0, drafts[0]] < 0.9  # both branches are exercised
    assert chi_square_p_value(yields, expected, n) > 1e-3
    assert not math.isclose(p[0, 4].item(), p[1, 4].item(), rel_tol=0.2)  # p1 differs from p0


def test_greedy_verification_accepts_while_drafts_equal_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    seq = Sequence([0, 1, 0], SamplingParams(temperature=0), block_size=4)
    seq.num_prompt_tokens = 1
    sampled, _ = sample_positions(
        Sampler(),
        SamplingMetadataBuilder(3, torch.device("cpu")),
        [seq],
        {seq.seq_id: [1, 0]},
        logits,
    )
    assert sampled.tolist() == [1, 0, 2]
    assert num_accepted_drafts([1, 0], sampled.tolist()) == 2
    assert num_accepted_drafts([1, 2], sampled.tolist()) == 1


# -- metrics and options ---------------------------------------------------------------------


def test_the_server_exports_vllms_spec_decode_counters():
    from types import SimpleNamespace

    from nanovllm.engine import EngineStats
    from nanovllm.entrypoints.metrics import EngineMetrics
    from nanovllm.speculative.metrics import SpecDecodeStats

    spec = SpecDecodeStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=9)
    assert (spec.acceptance_rate, spec.mean_acceptance_length) == (0.75, 3.25)
    front = SimpleNamespace(
        num_prompt_tokens=0,
        num_generation_tokens=0,
        num_prefix_cache_queries=0,
        num_prefix_cache_hits=0,
    )
    front.stats = EngineStats(0, 0, 0.0, spec)
    figures = {m.name: m.samples[0].value for m in EngineMetrics(front, "m").collect()}
    assert figures["nanovllm:spec_decode_num_drafts"] == 4
    assert figures["nanovllm:spec_decode_num_draft_tokens"] == 12
    assert figures["nanovllm:spec_decode_num_accepted_tokens"] == 9
    front.stats = EngineStats(0, 0, 0.0)  # without speculation: no such counters
    names = {m.name for m in EngineMetrics(front, "m").collect()}
    assert not any("spec_decode" in name for name in names)


def test_serve_and_bench_take_the_config_as_json_text():
    import sys
    from pathlib import Path

    from nanovllm.entrypoints.cli import build_parser

    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = build_parser().parse_args(["serve", "m", "--speculative-config", text])
    assert args.speculative_config == text
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import bench
    from benchmarks.engines import spec_decode_figures

    args = bench.parse_args(["--preset", "cpu-small", "--speculative-config", text])
    argv = bench.child_argv(args, "nanovllm", "x.json")
    assert argv[argv.index("--speculative-config") + 1] == text
    before = SpeculativeStatsLike(1, 4, 1)
    after = SpeculativeStatsLike(5, 20, 13)
    assert spec_decode_figures(before, after) == {
        "num_drafts": 4,
        "num_draft_tokens": 16,
        "num_accepted_tokens": 12,
        "acceptance_rate": 0.75,
        "mean_acceptance_length": 4.0,
    }


class SpeculativeStatsLike:
    def __init__(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int):
        self.num_drafts, self.num_draft_tokens = num_drafts, num_draft_tokens
        self.num_accepted_tokens = num_accepted_tokens
