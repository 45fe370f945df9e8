"""Requests that arrive while others decode, driven through add_request / step as a
server would: shared by the mixed-step tests (CPU, TP, Triton under the interpreter)."""

from nanovllm import SamplingParams
from nanovllm.engine import LLMEngine, StepOutput


def run_with_arrivals(
    llm: LLMEngine, early: list[list[int]], late: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[StepOutput]]:
    """Queue `early`, step until all of them decode, then queue `late` and step until
    the engine is idle. Returns each prompt's completion (early, then late) and every
    step's output after the arrival."""
    ids = [llm.add_request(p, params) for p in early]
    done: dict[int, list[int]] = {}
    for _ in range(1000):
        out = llm.step()
        done.update({o.seq_id: o.token_ids for o in out.finished})
        if out.num_decode_tokens == len(early) and not out.num_prefill_tokens:
            break
    assert not done, "an early request finished before the others arrived: make it longer"
    ids += [llm.add_request(p, params) for p in late]
    steps = []
    while not llm.is_finished():
        steps.append(llm.step())
        done.update({o.seq_id: o.token_ids for o in steps[-1].finished})
    return [done[i] for i in ids], steps


def mixed_steps(steps: list[StepOutput]) -> int:
    """Steps that decoded and prefilled at once."""
    return sum(1 for s in steps if s.num_prefill_tokens and s.num_decode_tokens)
