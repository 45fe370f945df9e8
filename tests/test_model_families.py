"""Qwen2, Llama, Mistral and Qwen3-MoE against Hugging Face `transformers`, on tiny random
checkpoints written as published ones are (tests/families.py): greedy tokens identical
and prefill logits within 1e-5 (float32, CPU), through chunked prefill and prefix-cache
hits; tensor parallelism (2 ranks over gloo) for Llama and Qwen3-MoE; a sharded
checkpoint with its index; every unsupported option refused by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, hf_model
from families import (
    FAMILIES,
    LLAMA3_ROPE,
    edit_config,
)
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.runner.step_inputs import prepare_inputs

BLOCK = 16
NEW_TOKENS = 16
# 1 token, a block + 1, several blocks, and 100: past the llama3 checkpoint's
# original_max_position_embeddings (32), where its RoPE scaling matters most.
PROMPT_LENGTHS = (1, BLOCK + 1, 40, 100)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def expected(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(str(path), tuple(p), NEW_TOKENS) for p in prompts]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """[num_prompts, vocab]: the last position's logits of one prefill of all prompts."""
    runner, block_manager = llm.model_runner, llm.scheduler.block_manager
    seqs = []
    for prompt in prompts:
        seq = Sequence(prompt, GREEDY, BLOCK)
        block_manager.allocate(seq, [])
        seq.num_scheduled_tokens = len(prompt)
        seqs.append(seq)
    with torch.inference_mode():
        return runner.forward(prepare_inputs(seqs, BLOCK))


# -- each family against transformers -------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_batch_matches_transformers(families, name):
    prompts = make_prompts()
    with LLM(str(families[name]), kvcache_block_size=BLOCK, num_kvcache_blocks=64) as llm:
        assert generate(llm, prompts) == expected(families[name], prompts)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_logits_match_transformers(families, name):
    path = families[name]
    prompts = make_prompts()
    with LLM(str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=64) as llm:
        ours = prefill_logits(llm, prompts)
    with torch.inference_mode():
        theirs = torch.stack(
            [hf_model(str(path))(torch.tensor([p])).logits[0, -1] for p in prompts]
        )
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_chunked_prefill_then_prefix_hits_match_transformers(families, name):
    """The prompts in chunks of at most 24 tokens, then again from the prefix cache."""
    path, prompts = families[name], make_prompts()
    with LLM(
        str(path), kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_num_batched_tokens=24
    ) as llm:
        chunked = generate(llm, prompts)
        block_manager = llm.scheduler.block_manager
        hits_before = block_manager.num_cache_hit_blocks
        cached = generate(llm, prompts)
        full_blocks = sum(len(p) // BLOCK for p in prompts)
        assert block_manager.num_cache_hit_blocks - hits_before >= full_blocks - 1
    assert chunked == cached == expected(path, prompts)


@pytest.mark.slow
def test_llama_and_qwen3_moe_at_tp2_match_transformers(families):
    """Both engines at once, 2 ranks each: Llama's sharded attention and tied head,
    Qwen3-MoE's experts sharded along their intermediate dimension."""
    paths = [families["llama"], families["qwen3_moe"]]
    prompts = make_prompts()  # test_greedy_batch_matches_transformers': answers cached
    engines = [
        LLM(str(path), tensor_parallel_size=2, kvcache_block_size=BLOCK, num_kvcache_blocks=64)
        for path in paths
    ]
    try:
        outputs = [generate(llm, prompts) for llm in engines]
    finally:
        for llm in engines:
            llm.close()
    assert outputs == [expected(path, prompts) for path in paths]


# -- Qwen3-MoE's parts ---------------------------------------------------------------------


def tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
        | overrides
    )


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_moe_block_matches_transformers(norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HF

    from nanovllm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    config = tiny_moe_config(norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    theirs = HF(config)
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.3)
    ours = Qwen3MoeSparseMoeBlock(config)
    ours.gate.weight.data.copy_(theirs.gate.weight)
    load_experts(ours.experts, theirs.experts.gate_up_proj, theirs.experts.down_proj)
    x = torch.randn(37, config.hidden_size)
    with torch.no_grad():
        assert (ours(x) - theirs(x[None])[0]).abs().max().item() < 1e-5


def load_experts(experts, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """transformers' fused [E, 2I, H] / [E, H, I] expert weights through our loaders, one
    checkpoint tensor (expert, projection) at a time."""
    for e, (gate, up) in enumerate(zip(*gate_up.detach().chunk(2, dim=1))):
        experts.weight_loader(experts.w13_weight, gate, (e, "w1"))
        experts.weight_loader(experts.w13_weight, up, (e, "w3"))
        experts.weight_loader(experts.w2_weight, down[e].detach(), (e, "w2"))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_slice_of_every_experts_intermediate_dimension(rank):
    from nanovllm.distributed.group import TPGroup, tp_group_scope
    from nanovllm.models.moe import FusedMoE

    with tp_group_scope(TPGroup(rank=rank, size=2)):
        experts = FusedMoE(
            num_experts=3, top_k=2, hidden_size=4, intermediate_size=6, renormalize=True
        )
    gate_up, down = torch.randn(3, 12, 4), torch.randn(3, 4, 6)
    load_experts(experts, gate_up, down)
    gate, up = gate_up.chunk(2, dim=1)
    rows = slice(3 * rank, 3 * rank + 3)
    assert torch.equal(experts.w13_weight, torch.cat([gate[:, rows], up[:, rows]], dim=1))
    assert torch.equal(experts.w2_weight, down[:, :, rows])
    with pytest.raises(ValueError, match=r"shape \(4, 5\) does not have the expected 6 columns"):
        experts.weight_loader(experts.w2_weight, torch.zeros(4, 5), (0, "w2"))


@pytest.mark.parametrize("step,mlp_only_layers", [(1, []), (2, []), (2, [3]), (1, [0, 2])])
def test_sparse_layers_are_transformers_ones(step, mlp_only_layers):
    from transformers import Qwen3MoeForCausalLM as HF

    from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock

    config = tiny_moe_config(decoder_sparse_step=step, mlp_only_layers=mlp_only_layers)
    with torch.device("meta"):
        ours, theirs = Qwen3MoeForCausalLM(config), HF(config)
    sparse = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in theirs.model.layers
    ]


# -- a sharded checkpoint -----------------------------------------------------------------


def test_a_sharded_checkpoint_loads_only_the_files_its_index_lists(families, tmp_path):
    src = families["qwen3_moe"]
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    path = tmp_path / "m"
    shutil.copytree(src, path)
    # Mistral's repositories hold consolidated.safetensors beside the indexed shards.
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, path / "consolidated.safetensors")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    up = load_file(path / index[name])[name]
    with LLM(str(path), num_kvcache_blocks=4) as llm:
        experts = llm.model_runner.model.model.layers[2].mlp.experts
        assert torch.equal(experts.w13_weight[5, up.shape[0] :], up)


def test_an_index_listing_a_missing_file_is_a_value_error_naming_it(families, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(families["qwen3_moe"], path)
    (path / "model-00002-of-00007.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00007.safetensors"):
        LLM(str(path), num_kvcache_blocks=4)


def edited_shard(src: Path, dst: Path, tensor: str, edit) -> Path:
    """A copy of a sharded checkpoint with `edit` applied to the shard holding `tensor`."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = load_file(dst / index[tensor])
    edit(tensors)
    save_file(tensors, dst / index[tensor], metadata={"format": "pt"})
    return dst


def test_missing_and_extra_expert_tensors_are_all_named(families, tmp_path):
    gone = "model.layers.0.mlp.experts.3.down_proj.weight"
    extra = "model.layers.0.mlp.experts.8.down_proj.weight"  # there are 8 experts: 0..7

    def edit(tensors):
        tensors[extra] = tensors.pop(gone)

    path = edited_shard(families["qwen3_moe"], tmp_path / "m", gone, edit)
    with pytest.raises(ValueError) as error:
        LLM(str(path), num_kvcache_blocks=4)
    assert "lacks tensor(s): " + gone in str(error.value)
    assert repr(extra) + " match no parameter" in str(error.value)


def test_a_misshaped_expert_tensor_is_named(families, tmp_path):
    name = "model.layers.2.mlp.experts.7.gate_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name][:, :-1].clone()

    path = edited_shard(families["qwen3_moe"], tmp_path / "m", name, edit)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r"': shape \(32, 63\)"):
        LLM(str(path), num_kvcache_blocks=4)


# -- what is refused, by name, before any weight is read ------------------------------------


def config_only(src: Path, dst: Path, **changes) -> Path:
    """config.json (edited) and the tokenizer, no weights: an error raised here comes
    before the loader, which would say that no *.safetensors file is present."""
    path = edit_config(src, dst, **changes)
    for file in path.glob("*.safetensors*"):
        file.unlink()
    return path


@pytest.mark.parametrize(
    "name,changes,match",
    [
        ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
        ("qwen2", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (
            "mistral",
            dict(sliding_window=64),
            r"sliding_window \(64\) is smaller than max_model_len",
        ),
        ("qwen2", dict(use_sliding_window=True, sliding_window=64), r"sliding_window \(64\)"),
        ("llama", dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
    ],
)
def test_an_unsupported_option_is_a_value_error_naming_it(families, tmp_path, name, changes, match):
    path = config_only(families[name], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=match):
        LLM(str(path), num_kvcache_blocks=4)


def test_a_sliding_window_as_wide_as_max_model_len_is_full_attention(families, tmp_path):
    path = config_only(families["mistral"], tmp_path / "m", sliding_window=64)
    assert Config(str(path), max_model_len=64).max_model_len == 64


def test_tensor_parallel_must_divide_each_experts_intermediate_size(families, tmp_path):
    import multiprocessing

    path = config_only(families["qwen3_moe"], tmp_path / "m", moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(33\)"):
        LLM(str(path), tensor_parallel_size=2)
    assert not multiprocessing.active_children()


# -- RoPE ---------------------------------------------------------------------------------


def llama3_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(
        **dict(
            hidden_size=64,
            num_attention_heads=4,
            head_dim=16,
            num_hidden_layers=3,
            vocab_size=64,
            max_position_embeddings=512,
            rope_parameters=dict(LLAMA3_ROPE, rope_theta=3000.0),
        )
        | overrides
    )


def test_llama3_rope_equals_transformers_past_the_original_context():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from nanovllm.layers.rotary_embedding import get_rope
    from nanovllm.models.hf_config import rope_parameters

    config = llama3_config()
    ours = get_rope(16, 512, rope_parameters(config)).cos_sin_cache
    positions = torch.arange(512)[None]  # 16 times original_max_position_embeddings
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(
        ours[:, 0], cos[0]
    )  # [512, 2, 16]: cos, then sin with its first half negated
    assert torch.equal(ours[:, 1], torch.cat([-sin[0, :, :8], sin[0, :, 8:]], dim=-1))


def test_llama3_rope_without_its_parameters_is_a_value_error_naming_them():
    from nanovllm.layers.rotary_embedding import get_rope

    params = {"rope_type": "llama3", "rope_theta": 3000.0, "factor": 8.0}
    with pytest.raises(ValueError, match="low_freq_factor, high_freq_factor, original_max"):
        get_rope(16, 64, params)


def test_layers_share_one_cos_sin_cache_per_set_of_rope_parameters():
    from nanovllm.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(llama3_config())
    caches = {layer.self_attn.rotary_emb.cos_sin_cache.data_ptr() for layer in model.model.layers}
    assert len(caches) == 1
    other = LlamaForCausalLM(
        llama3_config(rope_parameters={"rope_type": "default", "rope_theta": 3000.0})
    )
    assert other.model.layers[0].self_attn.rotary_emb.cos_sin_cache.data_ptr() not in caches


def test_both_config_styles_give_the_same_llama3_rope_parameters():
    from transformers import LlamaConfig

    from nanovllm.models.hf_config import rope_parameters

    v4 = LlamaConfig(rope_theta=3000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=512)
    v5 = LlamaConfig(
        rope_parameters=dict(LLAMA3_ROPE, rope_theta=3000.0), max_position_embeddings=512
    )
    assert rope_parameters(v4) == rope_parameters(v5) == dict(LLAMA3_ROPE, rope_theta=3000.0)
