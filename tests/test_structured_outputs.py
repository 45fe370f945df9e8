"""Structured outputs offline (xgrammar): with random weights, every constrained output must
still parse, each against an oracle of its own: JSON against its schema with `jsonschema`, a
regex by `re.fullmatch`, a choice by membership, an EBNF grammar by a recognizer written here.
Unconstrained rows of the same batch still give transformers' greedy tokens."""

import json
import re

import jsonschema
import pytest
import torch
from conftest import hf_greedy, native_library
from invariants import check_scheduler
from xgrammar import allocate_token_bitmask, apply_token_bitmask_inplace

from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_bitmask
from nanovllm.structured import StructuredOutputsParams
from nanovllm.structured.grammars import Grammars

BLOCK = 16
ENGINE = dict(device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=160, max_model_len=1024)

# Objects, arrays, enums, required fields and nested $defs; every string, array and integer
# bounded, so the language is finite and a grammar-following output must end (with EOS).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
        "address": {"$ref": "#/$defs/address"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "$defs": {
        "tag": {"type": "string", "enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "city": {"type": "string", "maxLength": 6},
            },
            "required": ["zip", "city"],
        },
    },
}
# Small enough that whitespace between its tokens (up to 32 characters per gap) keeps a greedy
# random model's output short.
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
REGEX = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,3}(\.[0-9])?"
CHOICES = ["yes", "no", "it depends", 'say "hi"\n']
# Commands: `go left; wait 12; turn right`, then a word of 1-4 letters in one or two pairs of
# parentheses, or none.
COMMANDS = r"""
root ::= cmd ("; " cmd){0,3} group?
cmd ::= ("go" | "turn") " " dir | "wait " [0-9] [0-9]?
dir ::= "left" | "right" | "up" | "down"
group ::= " (" inner ")"
inner ::= letters | "(" letters ")"
letters ::= [a-z] [a-z]? [a-z]? [a-z]?
"""


def recognizes_commands(text: str) -> bool:
    """COMMANDS' language, recognized by hand (recursive descent, no regex engine)."""
    pos = 0

    def take(literal: str) -> bool:
        nonlocal pos
        if text.startswith(literal, pos):
            pos += len(literal)
            return True
        return False

    def letters() -> bool:
        nonlocal pos
        start = pos
        while pos < len(text) and "a" <= text[pos] <= "z" and pos - start < 4:
            pos += 1
        return pos > start

    def command() -> bool:
        nonlocal pos
        if take("go ") or take("turn "):
            return any(take(d) for d in ("left", "right", "up", "down"))
        if not take("wait "):
            return False
        digits = 0
        while pos < len(text) and text[pos].isdigit() and text[pos].isascii() and digits < 2:
            pos, digits = pos + 1, digits + 1
        return digits > 0

    if not command():
        return False
    for _ in range(3):
        if not take("; "):
            break
        if not command():
            return False
    if take(" ("):
        if take("("):
            if not (letters() and take(")")):
                return False
        elif not letters():
            return False
        if not take(")"):
            return False
    return pos == len(text)


def test_the_recognizer_tells_the_grammars_sentences_from_others():
    for good in ("go left", "wait 7; turn up; go down (abcd)", "wait 42 ((xy))", "turn up (q)"):
        assert recognizes_commands(good), good
    for bad in (
        "go",
        "wait 123",
        "go left;",
        "go up (",
        "go up ((a)",
        "go up (A)",
        "go up (abcde)",
    ):
        assert not recognizes_commands(bad), bad


def constrained(max_tokens: int = 160, temperature: float = 0.0, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=None if temperature == 0 else 7,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def check_output(kind: dict, text: str) -> None:
    """The oracle for each kind of constraint."""
    if "json" in kind:
        jsonschema.validate(json.loads(text), kind["json"])
    elif "json_object" in kind:
        assert isinstance(json.loads(text), dict)
    elif "regex" in kind:
        assert re.fullmatch(kind["regex"], text), text
    elif "choice" in kind:
        assert text in kind["choice"]
    else:
        assert recognizes_commands(text), text


KINDS = [
    dict(json=PERSON, disable_any_whitespace=True),
    dict(json=FLAGS),  # with whitespace between JSON's tokens
    dict(regex=REGEX),
    dict(choice=CHOICES),
    dict(grammar=COMMANDS),
]


def make_prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def path(checkpoints) -> str:
    return str(checkpoints["gqa"])


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, **ENGINE) as llm:
        yield llm


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_every_kind_of_constraint_holds_beside_unconstrained_rows_that_match_transformers(
    llm, path, temperature
):
    prompts = make_prompts([7, 12, 5, 9, 16, 6, 10], seed=1)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [constrained(200, temperature, **kind) for kind in KINDS] + [free, free]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for kind, out in zip(KINDS, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check_output(kind, out.outputs[0].text)
    for prompt, out in zip(prompts[len(KINDS) :], outs[len(KINDS) :]):
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), 12)
    check_scheduler(llm.scheduler)


def test_each_of_n_sampled_completions_follows_the_grammar_on_its_own(llm):
    kind = dict(json=PERSON, disable_any_whitespace=True)
    params = SamplingParams(
        n=4, temperature=1.0, max_tokens=200, structured_outputs=StructuredOutputsParams(**kind)
    )
    [out] = llm.generate(make_prompts([8], seed=2), params, use_tqdm=False)
    texts = [c.text for c in out.outputs]
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        check_output(kind, completion.text)
    assert len(set(texts)) > 1  # sampled apart: each sequence had a matcher of its own


def test_preempted_constrained_sequences_resume_where_their_grammar_was(path, llm):
    """Greedy, so the outputs are fixed: a cache too small for the batch preempts and
    recomputes sequences mid-output, and each must come back to the same tokens."""
    prompts = make_prompts([30, 25, 28, 33], seed=3)
    kinds = [KINDS[0], KINDS[2], KINDS[4], KINDS[0]]
    params = [constrained(120, **kind) for kind in kinds]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **dict(ENGINE, num_kvcache_blocks=12)) as small:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for kind, out in zip(kinds, outs):
        check_output(kind, out.outputs[0].text)


def test_max_tokens_before_the_grammar_completes_ends_with_length(llm):
    params = constrained(6, **KINDS[0])
    [out] = llm.generate(make_prompts([9], seed=4), params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    with pytest.raises(ValueError):
        json.loads(completion.text)


def test_special_tokens_are_never_part_of_a_constrained_output(llm):
    """The chat template's markers and EOS are not text: a grammar allowing any character
    must still never sample them (only EOS, once, to end), however likely they are."""
    specials = set(llm.tokenizer.all_special_ids)
    params = SamplingParams(
        n=3,
        temperature=1.0,
        max_tokens=60,
        skip_special_tokens=False,
        logit_bias=dict.fromkeys(specials - llm.eos_token_ids, 20.0),
        structured_outputs=StructuredOutputsParams(regex=r"(.|\n){40}"),
    )
    [out] = llm.generate(make_prompts([5], seed=5), params, use_tqdm=False)
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        assert not specials & set(completion.token_ids[:-1])
        assert completion.token_ids[-1] in llm.eos_token_ids


def test_a_stop_string_or_an_abort_ends_a_constrained_sequence_and_its_matcher(llm):
    """Two constrained requests step together; one ends on a stop string, one is aborted
    mid-way; the third still follows its grammar and their matchers are forgotten."""
    prompts = make_prompts([6, 8, 10], seed=6)
    stopped = SamplingParams(
        temperature=0,
        max_tokens=50,
        stop=[" is", " was"],
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )
    aborted = constrained(300, **KINDS[2])
    kept = constrained(300, **KINDS[0])
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, [stopped, aborted, kept])]
    finished = {}
    for _ in range(4):
        finished.update({o.request_id: o for o in llm.step().finished_requests})
    llm.abort_request(ids[1])
    while not llm.is_finished():
        finished.update({o.request_id: o for o in llm.step().finished_requests})
    stop_out, kept_out = finished[str(ids[0])].outputs[0], finished[str(ids[2])].outputs[0]
    assert stop_out.stop_reason in (" is", " was")
    assert re.fullmatch(r"[A-Z][a-z]{1,6}", stop_out.text)
    check_output(KINDS[0], kept_out.text)
    llm.generate(prompts[:1], constrained(4, regex="[0-9]{4}"), use_tqdm=False)  # forgets
    tracked = llm.structured_outputs.matchers.tracked.values()
    assert not {entry.seq.request_id for entry in tracked} & set(ids)


def test_each_distinct_constraint_is_compiled_once(llm, monkeypatch):
    compiled = []
    compile_grammar = Grammars._compile

    def counted(self, params):
        compiled.append(params.key())
        return compile_grammar(self, params)

    monkeypatch.setattr(Grammars, "_compile", counted)
    params = [constrained(8, regex="[0-9]{5}"), constrained(8, regex="[0-9]{5}")]
    params.append(constrained(8, regex="[a-z]{5}"))
    outs = llm.generate(make_prompts([4, 5, 6], seed=8), params, use_tqdm=False)
    llm.generate(make_prompts([7], seed=8), params[0], use_tqdm=False)  # a later request too
    assert compiled == [("regex", "[0-9]{5}", False), ("regex", "[a-z]{5}", False)]
    assert all(re.fullmatch("[0-9]{5}|[a-z]{5}", out.outputs[0].text) for out in outs)


@pytest.mark.parametrize(
    "kind, field",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": 5}}}), "json"),
        (dict(json="{not json"), "json"),
        (dict(json={"type": "object", "properties": {"a": {"not": {"type": "null"}}}}), "json"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar='root ::= "a" missing'), "grammar"),
    ],
)
def test_an_invalid_constraint_is_refused_before_anything_is_queued(llm, kind, field):
    prompts = make_prompts([5, 6], seed=9)
    good = constrained(8, regex="[0-9]{4}")
    with pytest.raises(ValueError, match=rf"^prompt 1: structured_outputs\.{field}"):
        llm.generate(prompts, [good, constrained(8, **kind)], use_tqdm=False)
    assert llm.is_finished()  # nothing was queued, not even the good prompt
    [out] = llm.generate(prompts[:1], good, use_tqdm=False)  # still usable
    assert re.fullmatch("[0-9]{4}", out.outputs[0].text)


def test_a_bad_structured_outputs_is_refused_with_the_field_named(llm):
    with pytest.raises(ValueError, match="exactly one of json, regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(TypeError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="structured_outputs.structural_tag"):
        StructuredOutputsParams(structural_tag="{}")
    prompt = make_prompts([5], seed=10)
    regex = StructuredOutputsParams(regex="a")
    for params, error in (
        (SamplingParams(structured_outputs={"regex": "a"}), TypeError),
        (SamplingParams(ignore_eos=True, structured_outputs=regex), ValueError),
        (SamplingParams(min_tokens=2, structured_outputs=regex), ValueError),
    ):
        with pytest.raises(error, match="structured_outputs"):
            llm.generate(prompt, params, use_tqdm=False)
    assert llm.is_finished()


def test_async_scheduling_gives_the_synchronous_engines_constrained_outputs(path, llm):
    prompts = make_prompts([9, 14, 6], seed=11)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params = [constrained(120, **KINDS[0]), free, constrained(120, **KINDS[4])]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **dict(ENGINE, async_scheduling=True)) as overlapped:
        outs = overlapped.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.slow
def test_tensor_parallel_engines_give_one_ranks_constrained_outputs(path, llm):
    """Rank 0 samples, with its matchers; the spawned rank never sees a grammar."""
    prompts = make_prompts([9, 13], seed=12)
    params = [constrained(100, **KINDS[0]), constrained(100, 0.9, **KINDS[2])]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **dict(ENGINE, tensor_parallel_size=2)) as sharded:
        assert [o.outputs[0].text for o in sharded.generate(prompts, params, use_tqdm=False)] == (
            expected
        )


@pytest.mark.parametrize("vocab", [512, 1000, 4099])
def test_the_cpu_bitmask_kernel_masks_what_xgrammar_and_a_plain_reference_mask(vocab):
    """Words all 0, all 1 and mixed, a vocabulary that ends inside a word, some rows only:
    against xgrammar's own kernel and the bits read one by one in torch."""
    library = native_library(cpu_bitmask.load)
    g = torch.Generator().manual_seed(vocab)
    bitmask = allocate_token_bitmask(6, vocab)
    bitmask.random_(-(2**31), 2**31 - 1, generator=g)
    bitmask[1] = 0
    bitmask[2, ::2] = -1
    bitmask[2, 1::2] = 0
    logits = torch.randn(6, vocab, generator=g)
    rows = [0, 1, 2, 4]
    bits = (bitmask.view(-1, 1).long() >> torch.arange(32)) & 1  # [6 * words, 32]
    allowed = bits.view(6, -1)[:, :vocab].bool()
    expected = logits.clone()
    expected[rows] = torch.where(allowed[rows], logits[rows], float("-inf"))
    ours, theirs = logits.clone(), logits.clone()
    cpu_bitmask.apply_bitmask(library, ours, bitmask, torch.tensor(rows))
    apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    assert torch.equal(ours, expected) and torch.equal(theirs, expected)
