"""LoRA's batched GEMMs (lora/ops.py's grouped one, kernels/lora.py's Triton one) against the
per-row definition in float64: every row under its own slot, rows of slot -1 untouched, slots
that no row uses never read (they hold NaN)."""

import pytest
import torch
from kernel_cases import DEVICE, NAN, TOLERANCE, randn, rel_error, requires_kernels

from nanovllm.lora.mapping import map_rows
from nanovllm.lora.ops import lora_delta, lora_delta_reference

SLOTS = [1, 1, -1, 0, 1, -1, 0, 1]  # two adapters and the base, interleaved
CASES = [(torch.float32, 64, 96, 16), (torch.bfloat16, 256, 48, 24), (torch.float16, 40, 130, 8)]


def case(dtype: torch.dtype, k: int, n: int, width: int, device: str):
    gen = torch.Generator().manual_seed(k)
    x = randn(len(SLOTS), k, dtype=dtype, gen=gen).to(device)
    y = randn(len(SLOTS), n, dtype=dtype, gen=gen).to(device)
    a = randn(3, width, k, dtype=dtype, gen=gen, scale=k**-0.5).to(device)
    b = randn(3, width, n, dtype=dtype, gen=gen, scale=width**-0.5).to(device)
    a[2], b[2] = NAN, NAN  # a slot no row is under: never read
    return y, x, a, b


@pytest.mark.parametrize("dtype,k,n,width", CASES)
def test_the_grouped_gemms_add_each_rows_adapter(dtype, k, n, width):
    y, x, a, b = case(dtype, k, n, width, "cpu")
    expected = lora_delta_reference(y, x, a, b, torch.tensor(SLOTS))
    got = lora_delta(y.clone(), x, a, b, map_rows(SLOTS), torch.tensor([n]))
    assert rel_error(got, expected) < TOLERANCE[dtype]
    base = [i for i, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])


def sliced(b: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """b as a fused projection's: slice j's outputs only in its own rows (zeros elsewhere), and
    the slices' ends."""
    rank = b.shape[1] // len(sizes)
    b = b.clone()
    ends = torch.tensor(sizes).cumsum(0)
    for j, (start, end) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist())):
        b[:, : j * rank, start:end] = 0
        b[:, (j + 1) * rank :, start:end] = 0
    return b, ends


@pytest.mark.parametrize("sizes", [[96], [32, 48, 16]])
def test_the_cpus_native_call_adds_each_rows_adapter(sizes):
    """One slice, and three (q | k | v): each output reads only its slice's columns."""
    from conftest import native_library

    from nanovllm.kernels import cpu_lora

    library = native_library(cpu_lora.load)
    for k, width in [(64, 48), (40, 24), (256, 96)]:
        y, x, a, b = case(torch.float32, k, sum(sizes), width, "cpu")
        b, ends = sliced(b, sizes)
        x = torch.cat([x, x], dim=1)[:, :k]  # rows a stride apart, as a view's
        slots = torch.tensor(SLOTS)
        expected = lora_delta_reference(y, x, a, b, slots)
        assert cpu_lora.fits(x, a, b, y)
        got = cpu_lora.lora_bgmv(library, y.clone(), x, a, b, slots, ends)
        assert rel_error(got, expected) < TOLERANCE[torch.float32], (k, width)
        base = [i for i, s in enumerate(SLOTS) if s < 0]
        assert torch.equal(got[base], y[base])


@pytest.mark.cuda
@requires_kernels
@pytest.mark.parametrize("dtype,k,n,width", CASES)
def test_the_triton_kernels_add_each_rows_adapter(dtype, k, n, width):
    from nanovllm.kernels import lora_bgmv

    y, x, a, b = case(dtype, k, n, width, DEVICE)
    slots = torch.tensor(SLOTS, device=DEVICE)
    expected = lora_delta_reference(y.cpu(), x.cpu(), a.cpu(), b.cpu(), slots.cpu())
    got = lora_bgmv(y.clone(), x, a, b, slots)
    assert rel_error(got.cpu(), expected) < TOLERANCE[dtype]
    base = [i for i, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])


@pytest.mark.cuda
@requires_kernels
def test_decode_graphs_replay_each_rows_adapter_from_their_static_slots(checkpoints, tmp_path):
    """An engine with two adapters and the base in one batch gives PEFT's greedy tokens with
    its decode steps replayed from the graphs' static buffers, each row's slot among them: on
    CUDA real graphs; in the interpreter the stand-in that runs what a graph captured
    (test_cuda_graph.py), the LoRA layers on the Triton kernels, as CUDA's platform gives them."""
    peft = pytest.importorskip("peft")
    from test_cuda_graph import with_stand_in_graphs
    from transformers import AutoModelForCausalLM

    from nanovllm import LLM, SamplingParams
    from nanovllm.lora.request import LoRARequest
    from nanovllm.platforms.cuda import triton_lora

    base = checkpoints["gqa"]
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]

    def adapter(name: str, rank: int, seed: int):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=targets)
        model = peft.get_peft_model(model, config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.normal_(0, 0.3)
        model.save_pretrained(tmp_path / name)
        return model.eval()

    models = {"a": adapter("a", 8, 1), "b": adapter("b", 4, 2), None: None}
    prompts = [[5, 6, 7, 8], list(range(30, 50)), [9, 9, 9]]
    loras = {
        "a": LoRARequest("a", 1, str(tmp_path / "a")),
        "b": LoRARequest("b", 2, str(tmp_path / "b")),
    }
    batch = [(p, name) for p in prompts for name in models]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(enable_lora=True, max_loras=2, kvcache_block_size=16, num_kvcache_blocks=32)
    if DEVICE == "cpu":  # the interpreter: stand-in graphs, the CUDA platform's LoRA kernels
        options.update(device="cpu", attention_backend="triton")
    with LLM(str(base), **options) as llm:
        if DEVICE == "cpu":
            for layer in llm.model_runner.lora.layers.values():
                layer._delta = triton_lora
            replays = with_stand_in_graphs(llm)
        else:
            replays = [] if llm.model_runner.fast_decode is None else [1]
        outs = llm.generate(
            [p for p, _ in batch],
            params,
            use_tqdm=False,
            lora_request=[loras.get(n) for _, n in batch],
        )
    assert replays, "the decode steps ran through the graphs"
    for (prompt, name), out in zip(batch, outs):
        model = models[name] or AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), name
