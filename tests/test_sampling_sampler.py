"""The sampler on constructed logits, through the same metadata builder the model runner
uses. References: plain-Python arithmetic for the filtered distributions and the
presence/frequency penalties (transformers has no processor for those two), and
transformers' own logits processors for top-k, top-p, min-p and the repetition penalty.

Distribution checks use Pearson's chi-square with a fixed threshold: the 0.999 quantile
of the chi-square distribution (p = 0.001) for the number of kept tokens minus one. The
draws come from fixed seeds, so each check is deterministic.
"""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanovllm.core.sequence import Sequence
from nanovllm.sampling.filters import apply_min_p, apply_top_k_top_p
from nanovllm.sampling.metadata import SamplingMetadata, SamplingMetadataBuilder
from nanovllm.sampling.penalties import TokenCounts, apply_penalties
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.seeded import seed_key
from nanovllm.sampling_params import SamplingParams

CHI2_999 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
}
N_DRAWS = 12_000
# Probabilities with no near-ties at any filter boundary used below, in a shuffled
# token order so that "most likely" is not "lowest id".
PROBS = [0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005]
ORDER = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]  # token id of the i-th most likely
TOKEN_PROBS = [PROBS[ORDER.index(t)] for t in range(len(PROBS))]
LOGITS = [math.log(p) for p in TOKEN_PROBS]


def make_seq(params: SamplingParams, prompt=(1, 2, 3), completion=(), eos=()) -> Sequence:
    seq = Sequence(list(prompt), params, block_size=16, eos_token_ids=eos)
    for token in completion:
        seq.append_token(token)
    return seq


def metadata(seqs, vocab: int, builder: SamplingMetadataBuilder | None = None) -> SamplingMetadata:
    builder = builder or SamplingMetadataBuilder(vocab, torch.device("cpu"))
    return builder.build(seqs)


def sample(logits: torch.Tensor, seqs) -> list[int]:
    return Sampler()(logits.clone(), metadata(seqs, logits.shape[1])).tolist()


# -- plain-Python reference ----------------------------------------------------------


def reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The renormalized filtered softmax, in the order temperature, top-k, top-p, min-p."""
    probs = softmax([x / temperature for x in logits])
    ranked = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = ranked[:top_k] if top_k > 0 else ranked
    kept = _top_p(kept, probs, top_p)
    total = sum(probs[t] for t in kept)
    top = probs[kept[0]] / total
    kept = [t for t in kept if probs[t] / total >= min_p * top]
    total = sum(probs[t] for t in kept)
    return {t: probs[t] / total for t in kept}


def _top_p(ranked, probs, top_p):
    total = sum(probs[t] for t in ranked)
    kept, mass = [], 0.0
    for t in ranked:
        kept.append(t)
        mass += probs[t] / total
        if mass >= top_p:
            break
    return kept


def softmax(xs):
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


def assert_matches_distribution(tokens: list[int], expected: dict[int, float]):
    counts = [0] * len(LOGITS)
    for t in tokens:
        counts[t] += 1
    assert all(counts[t] == 0 for t in range(len(counts)) if t not in expected), counts
    chi2 = sum((counts[t] - len(tokens) * p) ** 2 / (len(tokens) * p) for t, p in expected.items())
    assert chi2 < CHI2_999[len(expected) - 1], (chi2, counts, expected)


FILTER_SETTINGS = [
    dict(temperature=0.8),
    dict(top_k=4),
    dict(top_p=0.6),  # cumulative 0.30, 0.50, 0.65: the third token crosses 0.6 and stays
    dict(min_p=0.25),  # keeps p >= 0.075
    dict(temperature=0.9, top_k=7, top_p=0.8, min_p=0.1),
]


# -- distributions -------------------------------------------------------------------

# One batch mixes settings, so each row is also checked beside rows with other filters:
# all settings (top-p present: the full-sort path), or those without top-p (top-k alone:
# the partial-sort path).
BATCH_MIXES = {
    "all filters": FILTER_SETTINGS,
    "no top-p": [s for s in FILTER_SETTINGS if "top_p" not in s],
}


def draw_mixed_batch(settings, seeded: bool) -> list[list[int]]:
    """N_DRAWS draws per setting, rows interleaved; returns the tokens of each setting."""
    params = [
        SamplingParams(seed=i if seeded else None, **settings[i % len(settings)])
        for i in range(N_DRAWS * len(settings))
    ]
    tokens = sample(torch.tensor([LOGITS] * len(params)), [make_seq(p) for p in params])
    return [tokens[i :: len(settings)] for i in range(len(settings))]


@pytest.mark.parametrize("mix", BATCH_MIXES)
def test_unseeded_draws_follow_the_filtered_softmax(mix):
    torch.manual_seed(1234)
    for setting, tokens in zip(BATCH_MIXES[mix], draw_mixed_batch(BATCH_MIXES[mix], False)):
        assert_matches_distribution(tokens, reference_distribution(LOGITS, **setting))


@pytest.mark.parametrize("mix", BATCH_MIXES)
def test_draws_over_many_seeds_follow_the_filtered_softmax(mix):
    for setting, tokens in zip(BATCH_MIXES[mix], draw_mixed_batch(BATCH_MIXES[mix], True)):
        assert_matches_distribution(tokens, reference_distribution(LOGITS, **setting))


@pytest.mark.parametrize("setting", FILTER_SETTINGS[::2], ids=str)
def test_one_seed_over_many_steps_follows_the_filtered_softmax(setting):
    params = SamplingParams(seed=7, **setting)
    m = metadata([make_seq(params)] * N_DRAWS, len(LOGITS))
    # As one request sees it: step n draws with the key of (seed, n).
    m.seeds.keys = torch.tensor([seed_key(7, step) for step in range(N_DRAWS)])
    tokens = Sampler()(torch.tensor([LOGITS] * N_DRAWS), m).tolist()
    assert_matches_distribution(tokens, reference_distribution(LOGITS, **setting))


def test_top_p_keeps_the_token_that_crosses_p():
    # nano-vLLM PR #196: masking where the cumulative sum exceeds p dropped this token.
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]])
    kept = apply_top_k_top_p(logits.clone(), None, 0, torch.tensor([0.6])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    torch.manual_seed(0)
    tokens = sample(logits.repeat(2000, 1), [make_seq(SamplingParams(top_p=0.6))] * 2000)
    assert set(tokens) == {0, 1}


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.tensor([[math.log(p) for p in (0.4, 0.25, 0.2, 0.09, 0.06)]])
    # threshold 0.25 * 0.4 = 0.1: 0.09 and 0.06 go
    assert apply_min_p(logits.clone(), torch.tensor([0.25])).isfinite().tolist() == [
        [True, True, True, False, False]
    ]
    assert apply_min_p(logits.clone(), torch.tensor([0.0])).isfinite().all()


def test_filters_match_transformers_warpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 300, generator=g) * 3
    settings = [
        dict(temperature=t, top_k=k, top_p=p, min_p=m)
        for t, k, p, m in [
            (1.0, 5, 1.0, 0.0),
            (0.7, 0, 0.9, 0.0),
            (1.3, 0, 1.0, 0.05),
            (0.8, 40, 0.95, 0.02),
            (1.0, 1, 0.5, 0.3),
            (2.0, 0, 0.3, 0.0),
            (0.5, 100, 1.0, 0.1),
            (1.0, 0, 1.0, 0.0),
            (1.0, 299, 0.99, 0.0),
            (0.9, 3, 0.2, 0.0),
            (1.1, 0, 0.7, 0.2),
            (1.0, 10, 1.0, 0.5),
        ]
    ]
    m = metadata([make_seq(SamplingParams(**s)) for s in settings], logits.shape[1])
    ours = logits.clone() / m.temperatures[:, None]
    f = m.filters
    ours = apply_min_p(apply_top_k_top_p(ours, f.top_k, f.max_top_k, f.top_p), f.min_p)
    for row, s in enumerate(settings):
        theirs = TemperatureLogitsWarper(s["temperature"])(None, logits[row : row + 1].clone())
        if s["top_k"]:
            theirs = TopKLogitsWarper(s["top_k"])(None, theirs)
        if s["top_p"] < 1:
            theirs = TopPLogitsWarper(s["top_p"])(None, theirs)
        if s["min_p"]:
            theirs = MinPLogitsWarper(s["min_p"])(None, theirs)
        assert torch.equal(ours[row].isfinite(), theirs[0].isfinite()), s


# -- greedy rows ---------------------------------------------------------------------


def test_greedy_rows_are_the_exact_argmax_beside_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 1000, generator=g)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05)
    params = [SamplingParams(temperature=0) if i % 2 else sampled for i in range(32)]
    tokens = sample(logits, [make_seq(p) for p in params])
    assert tokens[1::2] == logits.argmax(dim=-1)[1::2].tolist()


def test_top_k_1_is_the_argmax_seeded_or_not():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 1000, generator=g)
    params = [
        SamplingParams(temperature=1.5, top_k=1, seed=i if i % 2 else None) for i in range(16)
    ]
    assert sample(logits, [make_seq(p) for p in params]) == logits.argmax(dim=-1).tolist()


def test_work_no_row_asks_for_is_skipped_on_the_host():
    vocab = 100
    greedy_with_filters = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2, seed=1)
    m = metadata([make_seq(greedy_with_filters)] * 3, vocab)
    assert m.all_greedy and (m.filters, m.seeds) == (None, None)
    m = metadata(
        [make_seq(SamplingParams(top_k=vocab + 5)), make_seq(SamplingParams(top_k=-1))], vocab
    )
    assert not m.all_greedy and m.greedy is None and m.filters is None and m.penalties is None
    m = metadata([make_seq(SamplingParams(top_k=5)), make_seq(SamplingParams())], vocab)
    assert m.filters.top_k.tolist() == [5, vocab] and m.filters.max_top_k == 5
    assert m.filters.top_p is None


# -- seeds ---------------------------------------------------------------------------


def test_a_seeded_row_draws_the_same_token_in_any_batch_and_position():
    g = torch.Generator().manual_seed(3)
    vocab, n = 1000, 12
    logits = torch.randn(n, vocab, generator=g)
    seeded = [
        make_seq(
            SamplingParams(seed=100 + i, temperature=1.0 + i / 10, top_p=0.95), completion=[5] * i
        )
        for i in range(n)
    ]
    alone = [sample(logits[i : i + 1], [seeded[i]])[0] for i in range(n)]
    others = [
        make_seq(p, completion=[9, 9])
        for p in (
            SamplingParams(temperature=0),
            SamplingParams(),
            SamplingParams(top_k=3, min_p=0.1),
            SamplingParams(repetition_penalty=1.5, seed=5),
        )
    ]
    other_logits = torch.randn(len(others), vocab, generator=g)
    for _ in range(3):  # three orders of the batch
        rows = torch.randperm(n + len(others), generator=g).tolist()
        seqs = [(seeded + others)[r] for r in rows]
        batch_logits = torch.cat([logits, other_logits])[rows]
        tokens = sample(batch_logits, seqs)
        assert [tokens[rows.index(i)] for i in range(n)] == alone
    assert len(set(alone)) > 1


def test_a_seeded_row_changes_token_from_step_to_step():
    logits = torch.zeros(1, 50)  # uniform: every step is a fresh draw
    tokens = [
        sample(logits, [make_seq(SamplingParams(seed=3), completion=[1] * step)])[0]
        for step in range(20)
    ]
    assert len(set(tokens)) > 5
    again = [
        sample(logits, [make_seq(SamplingParams(seed=3), completion=[1] * step)])[0]
        for step in range(20)
    ]
    assert tokens == again


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_and_greedy_rows_draw_the_same_tokens_on_cuda_as_on_the_cpu():
    vocab, n = 151936, 32
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(n, vocab, generator=g) * 3
    sampled = dict(
        temperature=0.9, top_p=0.9, min_p=0.02, repetition_penalty=1.2, frequency_penalty=0.5
    )
    params = [
        SamplingParams(temperature=0, presence_penalty=1.0)
        if i % 4 == 0
        else SamplingParams(seed=i, top_k=50 if i % 2 else 0, **sampled)
        for i in range(n)
    ]
    seqs = [
        make_seq(
            p,
            prompt=torch.randint(0, vocab, (40,), generator=g).tolist(),
            completion=torch.randint(0, vocab, (9,), generator=g).tolist(),
        )
        for p in params
    ]
    on_cpu = Sampler()(logits.clone(), metadata(seqs, vocab))
    m = SamplingMetadataBuilder(vocab, torch.device("cuda")).build(seqs)
    on_cuda = Sampler()(logits.cuda(), m).cpu()
    # The seeded noise is integer arithmetic, the same bits on both devices.
    assert on_cuda.tolist() == on_cpu.tolist()


# -- penalties -----------------------------------------------------------------------


def reference_presence_frequency(
    logits: list[float], completion: list[int], presence: float, frequency: float
) -> list[float]:
    return [
        x - frequency * completion.count(t) - presence * (t in completion)
        for t, x in enumerate(logits)
    ]


def test_penalties_match_transformers_and_a_plain_reference_as_tokens_arrive():
    vocab = 40
    g = torch.Generator().manual_seed(4)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
        SamplingParams(
            temperature=0, repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=1.1
        ),
        SamplingParams(),
    ]  # no penalty: not tracked
    seqs = [
        make_seq(p, prompt=torch.randint(0, vocab, (n,), generator=g).tolist())
        for p, n in zip(params, (5, 9, 1, 4))
    ]
    builder = SamplingMetadataBuilder(vocab, torch.device("cpu"))
    for _ in range(6):
        logits = torch.randn(len(seqs), vocab, generator=g) * 2
        logits[:, :3] = 0.0  # a logit of exactly 0 is unchanged by either rule
        m = metadata(seqs, vocab, builder)
        assert m.penalties.rows.tolist() == [0, 1, 2]
        pen = m.penalties
        ours = apply_penalties(
            logits[pen.rows],
            pen.output_counts,
            pen.in_prompt,
            pen.repetition,
            pen.presence,
            pen.frequency,
        )
        for row, seq in enumerate(seqs[:3]):
            p = seq.sampling_params
            theirs = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
                torch.tensor([seq.token_ids]), logits[row : row + 1].clone()
            )[0].tolist()
            theirs = reference_presence_frequency(
                theirs, seq.completion_token_ids, p.presence_penalty, p.frequency_penalty
            )
            assert ours[row].tolist() == pytest.approx(theirs, rel=1e-6, abs=1e-6)
        for seq in seqs:  # repeats make the frequency counts above 1
            seq.append_token(int(torch.randint(0, 6, (1,), generator=g)))


def test_token_counts_free_finished_sequences_and_reuse_their_slots_clean():
    vocab = 20
    counts = TokenCounts(vocab, torch.device("cpu"))
    penalized = SamplingParams(frequency_penalty=1.0)
    first = make_seq(penalized, prompt=[1, 2], completion=[3, 3])
    (slot,) = counts.update([first]).tolist()
    assert counts.output_counts[slot, 3] == 2 and counts.in_prompt[slot, 1]
    first.status = first.status.FINISHED
    second = make_seq(penalized, prompt=[4], completion=[5])
    assert counts.update([second]).tolist() == [slot]
    assert counts.output_counts[slot].tolist() == [1.0 if t == 5 else 0.0 for t in range(vocab)]
    assert counts.in_prompt[slot].nonzero().flatten().tolist() == [4]
    many = [make_seq(penalized, prompt=[i]) for i in range(20)]  # grows past 8 slots
    slots = counts.update(many).tolist()
    assert len(set(slots)) == 20 and all(counts.in_prompt[s, i] for s, i in zip(slots, range(20)))


# -- min_tokens ----------------------------------------------------------------------


def test_min_tokens_keeps_eos_and_stop_ids_from_being_drawn():
    eos, stop_id, vocab = 3, 5, 10
    logits = torch.zeros(1, vocab)
    logits[0, eos], logits[0, stop_id], logits[0, 7] = 9.0, 8.0, 7.0
    greedy = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop_id])
    assert sample(logits, [make_seq(greedy, completion=[1], eos=[eos])]) == [7]
    assert sample(logits, [make_seq(greedy, completion=[1, 1], eos=[eos])]) == [eos]
    ignoring = SamplingParams(
        temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[stop_id]
    )
    assert sample(logits, [make_seq(ignoring, eos=[eos])]) == [eos]
    torch.manual_seed(0)
    sampled = SamplingParams(temperature=5.0, min_tokens=1, stop_token_ids=[stop_id])
    tokens = sample(logits.repeat(2000, 1), [make_seq(sampled, eos=[eos])] * 2000)
    assert eos not in tokens and stop_id not in tokens and len(set(tokens)) == vocab - 2
