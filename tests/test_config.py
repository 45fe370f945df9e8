"""Config and SamplingParams validation: every bad value is a ValueError/TypeError
that names the field."""

import json
import subprocess
import sys
import types

import pytest

from nanovllm.config import Config
from nanovllm.models.hf_config import checkpoint_dtype, rope_parameters
from nanovllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg")
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rope_theta": 5000.0,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_defaults_are_nano_vllms(config_dir):
    c = Config(config_dir)
    assert (
        c.max_num_batched_tokens,
        c.max_num_seqs,
        c.gpu_memory_utilization,
        c.tensor_parallel_size,
        c.enforce_eager,
        c.kvcache_block_size,
        c.num_kvcache_blocks,
    ) == (16384, 512, 0.9, 1, False, 256, -1)


def test_max_model_len_is_clipped_to_the_models_positions(config_dir):
    assert Config(config_dir).max_model_len == 512
    assert Config(config_dir, max_model_len=100).max_model_len == 100


def test_transformers_4_style_config_is_understood(config_dir):
    c = Config(config_dir)
    assert rope_parameters(c.hf_config)["rope_theta"] == 5000.0
    assert checkpoint_dtype(c.hf_config) == "bfloat16"


def test_transformers_4_attributes_are_read_as_such():
    # transformers 5 turns a 4.x config.json into its own attributes when it loads it (so
    # the test above passes either way); a transformers 4 config object keeps these.
    v4 = types.SimpleNamespace(
        rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype="bfloat16"
    )
    assert rope_parameters(v4) == {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}
    assert checkpoint_dtype(v4) == "bfloat16"


def test_missing_model_directory_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        Config(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_num_batched_tokens", 0),
        ("max_num_seqs", -1),
        ("max_model_len", 0),
        ("kvcache_block_size", 0),
        ("num_kvcache_blocks", 0),
        ("num_kvcache_blocks", -2),
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", 9),
        ("gpu_memory_utilization", 0),
        ("gpu_memory_utilization", 1.5),
        ("device", "tpu"),
        ("dtype", "int8"),
        ("attention_backend", "xformers"),
        ("load_format", "pt"),
        ("cpu_kvcache_space_gib", 0),
        ("cpu_kvcache_space_gib", float("inf")),
        ("scheduling_policy", "fifo"),
        ("max_logprobs", -1),
    ],
)
def test_bad_values_name_their_field(config_dir, field, value):
    with pytest.raises(ValueError, match=field):
        Config(config_dir, **{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_num_seqs", 2.5),
        ("enforce_eager", "yes"),
        ("enable_prefix_caching", 1),
        ("gpu_memory_utilization", "0.5"),
        ("device", None),
        ("tensor_parallel_size", True),
        ("max_logprobs", 2.0),
    ],
)
def test_wrong_types_are_type_errors_naming_their_field(config_dir, field, value):
    with pytest.raises(TypeError, match=field):
        Config(config_dir, **{field: value})


def test_unknown_keyword_is_a_type_error_naming_it(config_dir):
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        Config.from_kwargs(config_dir, {"max_num_seq": 4})


def test_sampling_params_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.ignore_eos) == (1.0, 64, False)
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    "kwargs,exc,field",
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"max_tokens": 1.5}, TypeError, "max_tokens"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        SamplingParams(**kwargs)


def test_control_plane_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import nanovllm.core, nanovllm.sampling_params\n"
        "from nanovllm import SamplingParams\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules "
        "if sys.modules[m] is not None)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
