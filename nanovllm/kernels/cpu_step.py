"""A dense decoder's decode step in one native call on a CPU (cpu_step.cpp), and the float32 GEMM
of a few rows it runs (`f32_linear`; also every packed CPU linear's single row, `packed_linear`).
The step calls RMSNorm and rotary (cpu_ops.cpp), paged decode attention (cpu_decode.cpp) and, for
int8 or int4 weights, their GEMMs (cpu_int8.cpp, cpu_int4.cpp) through those libraries' own
functions, so it computes what the eager layers compute with them; only its float32 GEMMs sum in
another order than F.linear's. Built at first use and loaded with ctypes (kernels/cpu_build.py);
`load()` is None, with one warning, where it cannot be, and `usable()` is False where one of the
libraries the step calls cannot be.

    step = DecoderStep(library, shape, embed, final_norm, rope, layers, head)
    logits = step(input_ids, positions, slot_mapping, block_tables, context_lens)

(with head=None the step ends at the final norm's hidden states).
"""

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from nanovllm.kernels import cpu_decode, cpu_int8, cpu_ops
from nanovllm.kernels.cpu_build import load_library, native_flags

SOURCE = Path(__file__).with_name("cpu_step.cpp")
# -ffp-contract=fast: the GEMM's x * w + acc is one FMA; the ops it calls keep their own flags.
FLAGS = native_flags("-ffp-contract=fast", "-fno-math-errno")
_INT, _I64, _PTR, _FLOAT = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", _PTR),
        ("scale", _PTR),
        ("bias", _PTR),
        ("out", _I64),
        ("in_", _I64),
        ("group", _I64),
        ("form", _I64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Linear) for name in ("qkv", "o", "gate_up", "down")),
        *((name, _PTR) for name in ("input_norm", "post_norm", "q_norm", "k_norm")),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _INT) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim")),
        ("block_size", _INT),
        ("norm_lanes", _INT),
        ("eps", _FLOAT),
        ("scale", _FLOAT),
        *((name, _PTR) for name in ("embed", "final_norm", "rope")),
        ("max_position", _I64),
        ("layers", ctypes.POINTER(_Layer)),
        ("head", _Linear),
        *((name, _PTR) for name in ("rms_norm", "rotary", "paged_decode")),
        *((name, _PTR) for name in ("int8_linear", "int4_linear")),
    ]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (and a warning) if it cannot be."""
    library = load_library(SOURCE, FLAGS, "the decode step runs layer by layer in PyTorch")
    if library is not None:
        library.nanovllm_f32_linear.argtypes = (_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT)
        library.nanovllm_f32_linear.restype = None
        library.nanovllm_decoder_step.argtypes = (
            ctypes.POINTER(_Model),
            *(_PTR,) * 4,
            _I64,
            _PTR,
            _I64,
            _PTR,
            _INT,
        )
        library.nanovllm_decoder_step.restype = _I64
    return library


def f32_linear(
    library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, K] @ weight[N, K]^T (+ bias), all float32 contiguous CPU tensors (unchecked:
    the caller's layer holds them so)."""
    out = torch.empty(x.shape[0], weight.shape[0])
    library.nanovllm_f32_linear(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
        torch.get_num_threads(),
    )
    return out


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A CPU linear that keeps a oneDNN-blocked copy of its [N, K] weight, x [rows, K]: rows
    from 2 through oneDNN's GEMM over `blocked`; one float32 row through f32_linear (MKL's GEMV
    read a weight at half its rate on an AMD EPYC), one row of another dtype through F.linear."""
    if x.shape[0] > 1:
        return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")
    library = load() if x.dtype == torch.float32 else None
    if library is None:
        return torch.nn.functional.linear(x, weight, bias)
    return f32_linear(library, x.contiguous(), weight, bias)


class Linear(NamedTuple):
    """A linear layer's tensors: a float32 [N, K] weight, int8 panels with their scales, or
    int4 panels (their scales and offsets inside) with their group size and form."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # int8 (cpu_int8.pack's panels) when set
    out_features: int = 0
    in_features: int = 0
    group_size: int = 0  # int4 (cpu_int4.pack's panels) when set
    form: int = 0  # int4's: cpu_int4.Form


class Layer(NamedTuple):
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    eps: float
    scale: float


def _linear(linear: Linear) -> _Linear:
    out_features = linear.out_features or linear.weight.shape[0]
    in_features = linear.in_features or linear.weight.shape[1]
    return _Linear(
        linear.weight.data_ptr(),
        None if linear.scale is None else linear.scale.data_ptr(),
        None if linear.bias is None else linear.bias.data_ptr(),
        out_features,
        in_features,
        linear.group_size,
        linear.form,
    )


def _address(library: ctypes.CDLL | None, name: str) -> int | None:
    return None if library is None else ctypes.cast(getattr(library, name), _PTR).value


class DecoderStep:
    """The step over fixed tensors (every one float32 and contiguous but int8 and int4
    panels, which the caller checked); holds them so the addresses it gave the C++ stay
    valid."""

    def __init__(
        self,
        library: ctypes.CDLL,
        shape: Shape,
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        rope: torch.Tensor,
        layers: list[Layer],
        head: Linear | None = None,
    ):
        self.library, self.tensors = library, (embed, final_norm, rope, layers, head)
        self.hidden = embed.shape[1]
        head_struct = _Linear() if head is None else _linear(head)  # a null weight: no head
        self.width = self.hidden if head is None else head_struct.out  # a row of the output
        linears = [linear for layer in layers for linear in layer[:4]]
        if head is not None:
            linears.append(head)
        int8 = any(linear.scale is not None for linear in linears)
        int4 = None
        if any(linear.group_size > 0 for linear in linears):  # imported only with int4 weights
            from nanovllm.kernels import cpu_int4

            int4 = _address(cpu_int4.load(), "nanovllm_int4_linear")
        self.layers = (_Layer * len(layers))(
            *(
                _Layer(
                    *(_linear(linear) for linear in layer[:4]),
                    *(None if t is None else t.data_ptr() for t in layer[4:]),
                )
                for layer in layers
            )
        )
        self.model = _Model(
            len(layers),
            self.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.block_size,
            cpu_ops.LANES,
            shape.eps,
            shape.scale,
            embed.data_ptr(),
            final_norm.data_ptr(),
            rope.data_ptr(),
            rope.shape[0],
            self.layers,
            head_struct,
            _address(cpu_ops.load(), "nanovllm_rms_norm"),
            _address(cpu_ops.load(), "nanovllm_rotary"),
            _address(cpu_decode.load(), "nanovllm_paged_decode"),
            _address(cpu_int8.load(), "nanovllm_int8_linear") if int8 else None,
            int4,
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions, slot_mapping [rows] int64; block_tables [rows, width] and
        context_lens [rows] int32 (the step's decode metadata) -> logits [rows, vocab] (hidden
        states [rows, hidden] without a head)."""
        rows = input_ids.shape[0]
        out = torch.empty(rows, self.width)
        bad = self.library.nanovllm_decoder_step(
            ctypes.byref(self.model),
            input_ids.data_ptr(),
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            rows,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if bad >= 0:
            raise ValueError(
                f"position {int(positions[bad])} is outside the rotary cache's "
                f"{self.model.max_position}"
            )
        return out


def usable() -> bool:
    """Every library the step calls (but int8's and int4's, asked for by the caller) could be
    built."""
    return all(lib.load() is not None for lib in (cpu_ops, cpu_decode)) and load() is not None
