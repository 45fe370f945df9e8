"""Engine configuration: one dataclass, checked in __post_init__ (TypeError for a wrong
type, ValueError for a wrong value). Values found at run time (the number of KV-cache
blocks) are returned by the parts that find them, never written back here."""

import math
import os
from dataclasses import dataclass, field, fields

from transformers import AutoConfig, PretrainedConfig

from nanovllm.models.registry import architecture
from nanovllm.utils import check_bool, check_choice, check_int, check_number

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULING_POLICIES = ("mixed", "prefill_first")
PUBLISHED_QUANTIZATIONS = ("gptq", "awq", "gguf")  # as the checkpoint has them
QUANTIZATIONS = ("int8", "int4", *PUBLISHED_QUANTIZATIONS)
AT_LEAST_ONE = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size")


@dataclass
class Config:
    """Every field, its default and its meaning is listed in docs/api.md."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas, each over tensor_parallel_size ranks
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1  # -1: as many as the memory allows
    device: str = "auto"
    dtype: str = "auto"  # "auto": the checkpoint's (CPU: if native)
    attention_backend: str = "auto"
    load_format: str = "auto"
    enable_prefix_caching: bool = True
    cpu_kvcache_space_gib: float = 4.0  # KV-cache budget on the CPU
    cpu_threads: int = 0  # intra-op threads on a CPU; 0: from the CPU quota (platforms/cpu/)
    cpu_decode_step: bool = True  # a CPU decodes in one native call (platforms/cpu/decode_step.py)
    quantization: str | None = None  # "int8", "int4": at load; "gptq", "awq", "gguf": published so
    scheduling_policy: str = "mixed"  # decode first; "prefill_first": nano-vLLM's
    async_scheduling: bool = False  # schedule step n+1 while step n runs (one rank only)
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's)
    speculative_config: dict | str | None = None  # n-gram drafts: nanovllm/speculative/
    enable_lora: bool = False  # LoRA adapters, per request (nanovllm/lora/)
    max_loras: int = 1  # adapters in one step (their slots), with enable_lora
    max_lora_rank: int = 16  # the highest adapter rank accepted, with enable_lora
    hf_config: PretrainedConfig = field(init=False, repr=False)
    gguf_file: str | None = field(init=False, default=None)  # the model folder's, for one

    def __post_init__(self) -> None:
        self.model = os.path.expanduser(str(self.model))
        if self.model.endswith(".gguf") or not os.path.isfile(
            os.path.join(self.model, "config.json")
        ):
            self._find_gguf_file()  # a GGUF file, or a folder of one: the model is its folder
        for name in AT_LEAST_ONE:
            check_int(name, getattr(self, name), minimum=1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1, maximum=8)
        check_int("data_parallel_size", self.data_parallel_size, minimum=1)
        check_int("cpu_threads", self.cpu_threads, minimum=0)
        if check_int("num_kvcache_blocks", self.num_kvcache_blocks, minimum=-1) == 0:
            raise ValueError("num_kvcache_blocks must be -1 (auto) or >= 1, got 0")
        check_number(
            "gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, "in (0, 1]", low_open=True
        )
        check_number(
            "cpu_kvcache_space_gib", self.cpu_kvcache_space_gib, 0, math.inf, "> 0", low_open=True
        )
        check_int("max_logprobs", self.max_logprobs, minimum=0)
        for name in ("enforce_eager", "cpu_decode_step", "enable_prefix_caching", "enable_lora"):
            check_bool(name, getattr(self, name))
        check_int("max_loras", self.max_loras, minimum=1)
        check_int("max_lora_rank", self.max_lora_rank, minimum=1)
        if check_bool("async_scheduling", self.async_scheduling) and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling works on one rank: pass tensor_parallel_size=1 "
                "or async_scheduling=False"
            )
        if self.quantization is not None:
            check_choice("quantization", self.quantization, QUANTIZATIONS)
        for name, allowed in (
            ("device", DEVICES),
            ("dtype", DTYPES),
            ("load_format", LOAD_FORMATS),
            ("attention_backend", ATTENTION_BACKENDS),
            ("scheduling_policy", SCHEDULING_POLICIES),
        ):
            check_choice(name, getattr(self, name), allowed)
        if self.speculative_config is not None:
            from nanovllm.speculative.config import parse_speculative_config

            self.speculative_config = parse_speculative_config(
                self.speculative_config, self.async_scheduling
            )
        if self.gguf_file is not None:
            try:
                from nanovllm.quantization.gguf_checkpoint import gguf_config
            except ImportError as e:
                raise ImportError(
                    f"a GGUF file needs the gguf package: pip install 'nano-vllm[gguf]' ({e})"
                ) from None
            self.hf_config = gguf_config(self.model, self.gguf_file, self.quantization)
            self.quantization = "gguf"
        else:
            self.hf_config = AutoConfig.from_pretrained(self.model)
            asked = self.quantization
            if asked in PUBLISHED_QUANTIZATIONS or is_published(self.model, self.hf_config):
                from nanovllm.quantization.published import published_method

                self.quantization = published_method(self.model, self.hf_config, asked)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        check_model_config(self.hf_config, self.tensor_parallel_size, self.max_model_len)

    def _find_gguf_file(self) -> None:
        found = find_gguf_file(self.model)
        if found is None:
            raise ValueError(
                f"model must be a directory holding config.json, or a GGUF file; "
                f"{self.model!r} is neither (no model is downloaded)"
            )
        self.model, self.gguf_file = found

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict) -> "Config":
        """Build a Config, refusing unknown keyword arguments by name."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown argument(s) {', '.join(unknown)}; "
                f"Config accepts: {', '.join(sorted(known - {'model'}))}"
            )
        return cls(model, **kwargs)


# -- what of a checkpoint our models run --------------------------------------------------


def find_gguf_file(model: str) -> tuple[str, str] | None:
    """(folder, file name) when `model` is a .gguf file or a folder of one .gguf without a
    config.json; None otherwise. A folder of several .gguf files (the parts of a split file, or
    several quantizations) is a ValueError asking for one."""
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.dirname(model) or ".", os.path.basename(model)
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    files = sorted(name for name in os.listdir(model) if name.endswith(".gguf"))
    if len(files) > 1:
        raise ValueError(
            f"{model!r} holds {len(files)} .gguf files ({', '.join(files)}); pass the path of "
            "one (a file split in parts is not supported: llama-gguf-split --merge joins them)"
        )
    return (model, files[0]) if files else None


def is_published(model: str, hf_config: PretrainedConfig) -> bool:
    """The checkpoint says it is quantized: a quantization_config in config.json, or AutoGPTQ's
    or AutoAWQ's file beside it (quantization/published.py reads them)."""
    files = ("quantize_config.json", "quant_config.json")
    return getattr(hf_config, "quantization_config", None) is not None or any(
        os.path.isfile(os.path.join(model, name)) for name in files
    )


def check_model_config(hf_config: PretrainedConfig, tp_size: int, max_model_len: int) -> None:
    """Refuse, by name and before any process is spawned or weight read, what no family here
    implements (RoPE types are get_rope's to refuse, as the layers are built)."""
    architecture(hf_config)
    if hf_config.hidden_act != "silu":
        raise ValueError(
            f"hidden_act {hf_config.hidden_act!r} is not supported; only 'silu' (SwiGLU) is"
        )
    if tp_size > 1:
        from nanovllm.distributed.sharding import check_sharding

        check_sharding(hf_config, tp_size)
    check_full_attention(hf_config, max_model_len)


def check_full_attention(hf_config: PretrainedConfig, max_model_len: int) -> None:
    """A sliding window at least max_model_len wide never hides a key: attention is full. A
    narrower one would hide some, and sliding-window attention is not implemented."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or not getattr(hf_config, "use_sliding_window", True):
        return
    if window < max_model_len:
        raise ValueError(
            f"sliding_window ({window}) is smaller than max_model_len "
            f"({max_model_len}) and sliding-window attention is not supported; "
            f"pass max_model_len={window} or less"
        )
