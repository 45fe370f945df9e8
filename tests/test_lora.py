"""LoRA adapters (nanovllm/lora/) against transformers + PEFT: random PEFT adapters of two ranks,
built offline with PEFT itself and saved as PeftModel.save_pretrained writes them, must give
PEFT's greedy tokens and logprobs, alone and mixed in one batch; prefix caching must keep each
adapter's KV apart; bad adapters are refused by name and the engine stays usable."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm.lora.mapping import map_rows
from nanovllm.lora.request import LoRARequest
from nanovllm.lora.scheduling import AdapterSlots

peft = pytest.importorskip("peft")
from peft_adapters import ALL, build_adapter, peft_greedy, peft_model  # noqa: E402

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [300, 301, 7]]
TOL = 1e-4  # test_logprobs.py's


@pytest.fixture(scope="module")
def adapters(checkpoints, families, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """base name -> {"a": rank 8 on every target, "b": rank 4 on q, v and down}, for Qwen3
    (gqa) and Llama."""
    root = tmp_path_factory.mktemp("adapters")
    bases = {"qwen3": checkpoints["gqa"], "llama": families["llama"]}
    return {
        name: {
            "base": base,
            "a": build_adapter(base, root / name / "a", 8, ALL, seed=1),
            "b": build_adapter(base, root / name / "b", 4, ["q_proj", "v_proj", "down_proj"], 2),
        }
        for name, base in bases.items()
    }


def engine(base: Path, **kwargs) -> LLM:
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8, kvcache_block_size=BLOCK)
    return LLM(
        str(base), num_kvcache_blocks=kwargs.pop("num_kvcache_blocks", 64), **options | kwargs
    )


def requests(paths: dict[str, Path]) -> dict[str, LoRARequest | None]:
    return {
        "a": LoRARequest("a", 1, str(paths["a"])),
        "b": LoRARequest("b", 2, str(paths["b"])),
        "none": None,
    }


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# -- against PEFT -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_each_adapter_and_the_base_give_pefts_greedy_tokens_alone_and_mixed(adapters, family):
    paths = adapters[family]
    loras = requests(paths)
    expected = {
        name: [peft_greedy(paths["base"], paths.get(name), p) for p in PROMPTS] for name in loras
    }
    with engine(paths["base"]) as llm:
        for name, lora in loras.items():  # each alone
            got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora))
            assert got == expected[name], name
        # one batch: every prompt under every adapter and none, interleaved
        mixed = [(p, name) for p in PROMPTS for name in loras]
        outs = llm.generate(
            [p for p, _ in mixed],
            GREEDY,
            use_tqdm=False,
            lora_request=[loras[name] for _, name in mixed],
        )
        for (prompt, name), got in zip(mixed, tokens(outs)):
            assert got == expected[name][PROMPTS.index(prompt)], name
    assert expected["a"] != expected["none"] and expected["b"] != expected["none"]


def test_logprobs_under_an_adapter_are_pefts(adapters):
    paths = adapters["qwen3"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompt = PROMPTS[1]
    with engine(paths["base"]) as llm:
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=requests(paths)["a"])
    completion = out[0].outputs[0]
    ids = prompt + completion.token_ids
    with torch.inference_mode():
        logits = peft_model(paths["base"], paths["a"])(torch.tensor([ids])).logits[0]
    rows = logits.float().log_softmax(-1)[len(prompt) - 1 : -1]
    for row, entry, token in zip(rows, completion.logprobs, completion.token_ids):
        assert abs(entry[token].logprob - row[token].item()) < TOL
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < TOL


def test_prefix_caching_on_and_off_and_preemption_give_the_same_tokens(adapters):
    paths = adapters["qwen3"]
    loras = list(requests(paths).values())
    shared = list(range(100, 140))  # 2.5 blocks every request shares, under each adapter
    prompts = [shared + [7 + i] for i in range(6)]
    lora_of = [loras[i % 3] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for name, kwargs in {
        "cached": dict(),
        "uncached": dict(enable_prefix_caching=False),
        "preempted": dict(num_kvcache_blocks=10, max_num_seqs=6),
    }.items():
        with engine(paths["base"], **kwargs) as llm:
            runs[name] = tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=lora_of))
            if name == "preempted":
                assert llm.scheduler.num_preemptions > 0
    assert runs["cached"] == runs["uncached"] == runs["preempted"]
    for prompt, lora, got in zip(prompts, ["a", "b", "none"] * 2, runs["cached"]):
        assert got == peft_greedy(paths["base"], paths.get(lora), prompt, 24), lora


def test_an_adapters_kv_is_not_another_adapters_prefix_hit():
    """Block hashes are salted by the adapter: the same tokens hit only under the same one."""
    manager = BlockManager(16, 4)
    first = Sequence(list(range(12)), None, 4, lora_int_id=1)
    manager.allocate(first, manager.get_cached_blocks(first))
    manager.cache_blocks(first, 0, 12)
    for lora_int_id, hits in ((1, 3), (2, 0), (0, 0)):
        seq = Sequence(list(range(12)), None, 4, lora_int_id=lora_int_id)
        assert len(manager.get_cached_blocks(seq)) == hits, lora_int_id


@pytest.mark.slow
def test_tensor_parallel_splits_the_adapters_as_their_layers(adapters):
    paths = adapters["qwen3"]
    loras = requests(paths)
    with engine(paths["base"], tensor_parallel_size=2) as llm:
        outs = llm.generate(
            PROMPTS * 3,
            GREEDY,
            use_tqdm=False,
            lora_request=[lo for lo in loras.values() for _ in PROMPTS],
        )
    expected = [peft_greedy(paths["base"], paths.get(n), p) for n in loras for p in PROMPTS]
    assert tokens(outs) == expected


# -- slots and scheduling -----------------------------------------------------------------------


def test_with_one_slot_requests_of_two_adapters_take_turns_and_both_are_right(adapters):
    paths = adapters["qwen3"]
    loras = requests(paths)
    with engine(paths["base"], max_loras=1) as llm:
        outs = llm.generate(
            PROMPTS[:2] * 2,
            GREEDY,
            use_tqdm=False,
            lora_request=[loras["a"]] * 2 + [loras["b"]] * 2,
        )
        assert llm.list_loras() == {1, 2}
    expected = [peft_greedy(paths["base"], paths[n], p) for n in "ab" for p in PROMPTS[:2]]
    assert tokens(outs) == expected


def test_a_request_waits_while_every_slot_holds_a_running_adapter():
    slots = AdapterSlots(max_loras=2)
    running = [Sequence([1], None, 4, lora_int_id=i) for i in (1, 2, 0)]
    admitted = {i: slots.admits(Sequence([1], None, 4, lora_int_id=i), running) for i in (0, 1, 3)}
    assert admitted == {0: True, 1: True, 3: False}  # the base and a running adapter need no slot
    assert slots.admits(Sequence([1], None, 4, lora_int_id=3), running[1:])


def test_the_rows_map_to_their_slots_and_groups():
    mapping = map_rows([0, 0, -1, 1, 0])
    assert mapping.slots.tolist() == [0, 0, -1, 1, 0]
    assert [(g.slot, g.rows.tolist()) for g in mapping.groups] == [(0, [0, 1, 4]), (1, [3])]
    assert map_rows([-1, -1]) is None
    assert [(g.slot, g.rows) for g in map_rows([1, 1]).groups] == [(1, None)]  # all rows


# -- bad adapters -------------------------------------------------------------------------------


def edited(source: Path, tmp_path: Path, **config) -> Path:
    """A copy of an adapter with adapter_config.json's keys changed."""
    out = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
    shutil.copytree(source, out)
    path = out / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return out


def test_bad_adapters_are_refused_by_name_and_the_engine_stays_usable(
    adapters, checkpoints, tmp_path
):
    paths = adapters["qwen3"]
    other = build_adapter(checkpoints["mqa"], tmp_path / "other", 4, ["q_proj"], 3)  # mqa's shape
    embedding = build_adapter(paths["base"], tmp_path / "embedding", 4, ["embed_tokens"], 4)
    bad = {
        "no adapter_config.json": (str(tmp_path / "missing"), "no adapter_config.json"),
        "a rank above max_lora_rank": (str(paths["a"]), "above max_lora_rank=4"),
        "another model's shape": (str(other), "do not fit the base model's layer"),
        "an embedding target": (str(embedding), "not the lora_A or lora_B weight"),
        "modules_to_save": (
            str(edited(paths["b"], tmp_path, modules_to_save=["lm_head"])),
            "modules_to_save",
        ),
        "DoRA": (str(edited(paths["b"], tmp_path, use_dora=True)), "use_dora"),
    }
    with engine(paths["base"], max_lora_rank=4) as llm:
        for i, (case, (path, message)) in enumerate(bad.items(), start=10):
            with pytest.raises(ValueError, match=message):
                llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest(case, i, path))
            assert llm.list_loras() == set(), case
        good = LoRARequest("b", 2, str(paths["b"]))
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=good)
        assert tokens(out) == [peft_greedy(paths["base"], paths["b"], PROMPTS[0])]
        with pytest.raises(ValueError, match="lora_int_id 2 is adapter 'b'"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", 2, str(paths["a"])))
        with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request="b")
        assert llm.remove_lora(2) and not llm.remove_lora(2) and llm.list_loras() == set()


def test_lora_needs_enable_lora_and_an_adapter_in_use_is_not_removed(adapters, checkpoints):
    paths = adapters["qwen3"]
    request = LoRARequest("a", 1, str(paths["a"]))
    with LLM(str(paths["base"]), num_kvcache_blocks=16) as llm:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=request)
    with engine(paths["base"]) as llm:
        llm.add_request(llm.make_request(PROMPTS[0], GREEDY, lora_request=request))
        with pytest.raises(ValueError, match="in use by 1 sequence"):
            llm.remove_lora(1)
        while not llm.is_finished():
            llm.step()
        assert llm.remove_lora(1)
    with pytest.raises(TypeError, match="lora_int_id must be an int"):
        LoRARequest("a", "1", str(paths["a"]))
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("a", 0, str(paths["a"]))


def test_the_native_cpu_step_is_off_with_adapters(adapters):
    """Its GEMMs read the weights alone; the LoRA layers' formats would be left out."""
    with engine(adapters["qwen3"]["base"]) as llm:
        assert llm.model_runner.fast_decode is None
