"""Property-based tests: the real Scheduler and BlockManager, driven by a fake runner
through random workloads (arrivals at random steps, shared prefixes, tiny block pools and
token budgets, EOS, aborts). Invariants are checked after every step, what the KV cache
holds on every step (the fake runner reads each sequence's context back from its slots),
and every completion against a replay in plain Python."""

from fake_runner import FakeRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import check_scheduler

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 0
MAX_STEPS = 5000

tokens = st.lists(st.integers(1, 4), max_size=14)  # a tiny alphabet: many equal blocks
request = st.fixed_dictionaries(
    {
        "arrival": st.integers(0, 25),
        "prefix": st.integers(0, 2),
        "own": tokens,
        "max_tokens": st.integers(1, 16),
        "ignore_eos": st.booleans(),
        "eos_at": st.one_of(st.none(), st.integers(1, 40)),  # runner emits EOS at this length
        "abort_at": st.one_of(st.none(), st.integers(0, 60)),  # step at which it is aborted
    }
)
workload = st.fixed_dictionaries(
    {
        "block_size": st.integers(1, 6),
        "num_blocks": st.integers(1, 16),
        "max_num_seqs": st.integers(1, 5),
        "budget": st.integers(1, 24),
        "max_model_len": st.integers(2, 48),
        "prefix_caching": st.booleans(),
        "prefixes": st.lists(tokens, min_size=3, max_size=3),
        "requests": st.lists(request, min_size=1, max_size=10),
    }
)


def expected_length(prompt_len: int, r: dict, max_model_len: int) -> int:
    """Completion tokens a request must end with, by the stop rules alone."""
    n = min(r["max_tokens"], max(max_model_len, prompt_len + 1) - prompt_len)
    if not r["ignore_eos"] and r["eos_at"] is not None:
        n = min(n, max(1, r["eos_at"] - prompt_len))
    return n


def next_token(context: tuple[int, ...]) -> int:
    """The fake model: a token of the tiny alphabet (never EOS) that depends on every token
    of the context and its order, so KV or tokens mixed up between sequences change it."""
    return 1 + sum(i * t for i, t in enumerate(context, 1)) % 4


def expected_completion(prompt: list[int], r: dict, max_model_len: int) -> list[int]:
    """What the fake model must have generated for a request: its tokens one at a time."""
    tokens = list(prompt)
    for _ in range(expected_length(len(prompt), r, max_model_len)):
        eos_due = r["eos_at"] is not None and len(tokens) + 1 >= r["eos_at"]
        tokens.append(EOS if eos_due else next_token(tuple(tokens)))
    return tokens[len(prompt) :]


def never_fits(prompt_len: int, r: dict, w: dict) -> bool:
    if prompt_len > w["max_model_len"]:
        return True
    final_len = prompt_len + expected_length(
        prompt_len, dict(r, ignore_eos=True), w["max_model_len"]
    )
    kv_tokens = final_len - 1  # the last sampled token never needs a slot
    return -(-kv_tokens // w["block_size"]) > w["num_blocks"]


def check_decode_first(decoding: list[Sequence], seqs: list[Sequence], w: dict) -> None:
    """Every sequence that was decoding gets its token this step (decode rows first), unless
    it was preempted or the step's rows ran out."""
    decode_rows = [s for s in seqs if not s.is_prefill]
    assert seqs[: len(decode_rows)] == decode_rows
    assert all(s.num_scheduled_tokens == 1 for s in decode_rows)
    full = len(decode_rows) == min(w["max_num_seqs"], w["budget"])
    for seq in decoding:
        assert seq in decode_rows or seq.status == SequenceStatus.WAITING or full


def check_step(
    scheduler: Scheduler,
    batch_seqs: list[Sequence],
    num_tokens: int,
    w: dict,
    all_seqs: list[Sequence],
) -> None:
    check_scheduler(scheduler)  # free xor referenced, ref counts, coverage, hash entries
    assert batch_seqs, "an empty batch while work was pending"
    assert len(batch_seqs) <= w["max_num_seqs"]
    assert num_tokens <= w["budget"]
    assert len(scheduler.running) <= w["max_num_seqs"]
    for seq in all_seqs:
        if seq.status != SequenceStatus.RUNNING:
            assert not seq.block_table, f"sequence {seq.seq_id} holds blocks while {seq.status}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_random_workloads_keep_invariants_and_finish(w):
    bm = BlockManager(w["num_blocks"], w["block_size"], enable_prefix_caching=w["prefix_caching"])
    scheduler = Scheduler(
        bm,
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["budget"],
        max_model_len=w["max_model_len"],
    )
    runner = FakeRunner(eos=EOS, next_token=next_token)
    admitted: list[tuple[Sequence, dict]] = []
    aborted: set[int] = set()
    last_arrival = max(r["arrival"] for r in w["requests"])
    for step in range(MAX_STEPS):
        for r in (r for r in w["requests"] if r["arrival"] == step):
            prompt = (w["prefixes"][r["prefix"]] + r["own"]) or [1]
            seq = Sequence(
                prompt,
                SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]),
                w["block_size"],
                [EOS],
            )
            if r["eos_at"] is not None:
                runner.eos_after[seq.seq_id] = r["eos_at"]
            try:
                scheduler.check_fits(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
            except ValueError:
                assert never_fits(len(prompt), r, w)
                continue
            assert not never_fits(len(prompt), r, w)
            scheduler.add(seq)
            admitted.append((seq, r))
        for seq, r in admitted:
            if r["abort_at"] == step and not seq.is_finished:
                assert scheduler.abort(seq.seq_id)
                aborted.add(seq.seq_id)
        if scheduler.is_finished():
            if step >= last_arrival:
                break
            continue
        decoding = [s for s in scheduler.running if not s.is_prefill]
        seqs = scheduler.schedule()
        check_decode_first(decoding, seqs, w)
        num_tokens = sum(s.num_scheduled_tokens for s in seqs)
        tokens = runner.run(seqs)
        scheduler.postprocess(seqs, tokens)
        check_step(scheduler, seqs, num_tokens, w, [s for s, _ in admitted])
    else:
        raise AssertionError("the workload did not finish: a livelock")
    for seq, r in admitted:
        assert seq.is_finished
        if seq.seq_id not in aborted:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            assert seq.completion_token_ids == expected_completion(prompt, r, w["max_model_len"])
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
