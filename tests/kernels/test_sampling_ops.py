"""The CPU's inverse-CDF draw (nanovllm/sampling/ops.py): fused in C++
(kernels/cpu_sample.cpp), or torch's softmax and float64 cumsum where that does not build. Oracles:
the float64 CDF of exp(logit - max) over the whole row, for given uniforms (the C++ draw is
held to it up to its float32 exp's rounding, torch's to the search of its softmax token for
token); and the softmax written out in Python, for inverse_cdf's draws (Pearson's chi-square
under the 0.999 quantile, fixed seeds). The rows put weight, zeros and -inf at the C++
draw's chunk edges. On the CPU; this folder also runs under the Triton interpreter, which
these tests do not use."""

import math

import pytest
import torch
from conftest import native_library

from nanovllm.kernels import cpu_sample
from nanovllm.platforms.cpu.ops import inverse_cdf

F64 = torch.float64
C = 64  # cpu_sample.cpp's CHUNK: the edges the cases put weight on and around
CHI2_999 = {7: 24.322}  # the 0.999 quantile of chi-square, 7 degrees of freedom
# The C++ draw's weights are float32 exps (within 2 ulp, cpu_exp.h) of the float32 logit - max:
# each step of the CDF it walks is within 2.4e-7 of exp's float64 value relative, so the CDF
# itself within 2.4e-7 of the total.
NATIVE_TOLERANCE = 3e-7


def full_cdf_index(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose float64 CDF over the whole row reaches u * total."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)


def edge_weights(
    rows: int, vocab: int, size: int, gen: torch.Generator, spread: bool = False
) -> torch.Tensor:
    """Random weights, 40% of them 0, and rows whose zeros sit at the chunk edges: the first
    and last token of every chunk, a whole chunk, the tail, all but one edge token. From
    torch.rand, multiples of 2**-24 below 1, so every float64 sum of a row's weights is exact;
    `spread`: exp(-40 rand) instead, 17 decades, as a softmax's, whose float64 sums round."""
    w = torch.rand(rows, vocab, generator=gen)
    if spread:
        w = w.mul_(-40).exp_()
    w *= torch.rand(rows, vocab, generator=gen) > 0.4
    ids = torch.arange(vocab)
    w[0::4, (ids % size == 0) | (ids % size == size - 1)] = 0
    w[1::4, size : 2 * size] = 0  # a chunk of weight 0 inside
    w[2::4, vocab // size * size - 1 :] = 0  # the last full chunk's end and the tail
    w[3:8:2] = 0
    w[3, min(size, vocab) - 1] = 1.0  # one token, a chunk's last
    w[5, [min(size, vocab - 2), vocab - 1]] = 0.5  # a chunk's first and the vocab's last
    w[7, -1] = 1.0  # the vocab's last alone
    return w


def uniforms(rows: int, gen: torch.Generator) -> torch.Tensor:
    u = 1 - torch.rand(rows, 1, dtype=F64, generator=gen)  # (0, 1], as inverse_cdf draws
    u[::3] = 1.0  # the top of the CDF: the last token of weight > 0
    u[1::3][:4] = 2.0**-53  # the smallest 1 - rand: the first token of weight > 0
    return u


@pytest.fixture(params=["native", "torch"])
def draw_path(request, monkeypatch):
    """inverse_cdf through cpu_sample.cpp, or (its library taken away) through torch."""
    if request.param == "native":
        native_library(cpu_sample.load)
    else:
        monkeypatch.setattr(cpu_sample, "load", lambda: None)
    return request.param


def test_inverse_cdf_draws_follow_the_softmax_at_a_vocab_of_several_chunks(draw_path):
    """Mass on chunk edges (the first and last token of chunks 0 and 1, the tail's first, the
    vocab's last but one), spread evenly over chunk 3, every other token -inf: chunk 2 and
    the vocab's last token among them."""
    vocab = 4 * C + 77
    mass = {0: 0.2, C - 1: 0.15, C: 0.15, 2 * C - 1: 0.1, 4 * C: 0.1, vocab - 2: 0.2}
    n = 12_000
    logits = torch.full((vocab,), float("-inf"))
    for t, p in mass.items():
        logits[t] = math.log(p)
    logits[3 * C : 4 * C] = math.log(0.1 / C)
    torch.manual_seed(11)
    tokens = inverse_cdf(logits.expand(n, vocab).clone())
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[list(mass)] = True
    allowed[3 * C : 4 * C] = True
    assert allowed[tokens].all(), tokens[~allowed[tokens]].unique()
    counts = torch.bincount(tokens, minlength=vocab)
    half = 3 * C + C // 2  # chunk 3 in halves: where in the chunk counts too
    observed = [counts[t].item() for t in mass]
    observed += [counts[3 * C : half].sum().item(), counts[half : 4 * C].sum().item()]
    expected = [n * p for p in (*mass.values(), 0.05, 0.05)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < CHI2_999[len(expected) - 1], (chi2, observed, expected)


@pytest.mark.parametrize("rows,vocab", [(256, 512), (24, 151936)])
def test_a_seed_reproduces_the_draw_of_one_uniform_a_row(rows, vocab, draw_path):
    """inverse_cdf = the full-CDF search of one 1 - torch.rand a row, at the tests' models'
    vocab and Qwen's, with filtered-out tokens; nothing else drawn. torch's draw is that
    search of its float32 softmax token for token; the C++ one's weights are its own float32
    exp, so it is held to the float64 CDF up to that exp's rounding (native_on_target)."""
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[torch.rand(rows, vocab, generator=gen) < 0.5] = float("-inf")
    torch.manual_seed(5)
    drawn, after = inverse_cdf(logits.clone()), torch.rand(1)
    torch.manual_seed(5)
    u = 1 - torch.rand(rows, 1, dtype=F64)
    assert torch.equal(after, torch.rand(1))
    probs = torch.softmax(logits, -1)
    assert (probs.gather(1, drawn[:, None]) > 0).all()
    if draw_path == "torch":
        assert torch.equal(drawn, full_cdf_index(probs, u))
    else:
        native_on_target(logits, u, drawn)


# -- the C++ draw (cpu_sample.cpp), against the float64 softmax ---------------------------


def float64_weights(logits: torch.Tensor) -> torch.Tensor:
    """exp(logit - max) in float64, of the float32 difference (the softmax's, the kernel's)."""
    return (logits - logits.amax(-1, keepdim=True)).double().exp()


def native_draw(logits: torch.Tensor, u: torch.Tensor, threads: int = 1) -> torch.Tensor:
    library = native_library(cpu_sample.load)
    logits, out = logits.contiguous(), torch.empty(len(logits), dtype=torch.int64)
    library.nanovllm_sample(
        logits.data_ptr(), *logits.shape, u.contiguous().data_ptr(), out.data_ptr(), threads
    )
    return out


def native_on_target(logits: torch.Tensor, u: torch.Tensor, got: torch.Tensor):
    """Not -inf, and its step of the float64 CDF of float64_weights holds u * total up to
    NATIVE_TOLERANCE of the total."""
    assert (logits.gather(1, got[:, None]) > float("-inf")).all()
    cdf = float64_weights(logits).cumsum(-1)
    target, tol = u * cdf[:, -1:], NATIVE_TOLERANCE * cdf[:, -1:]
    got = got[:, None]
    below = torch.where(got > 0, cdf.gather(1, (got - 1).clamp_min(0)), 0)
    assert (below <= target + tol).all() and (cdf.gather(1, got) >= target - tol).all()


@pytest.mark.parametrize("vocab", [C, 4 * C + 17, 151936, 1, 5])
@pytest.mark.parametrize("spread", [False, True])
def test_native_draw_is_on_the_float64_softmax_target_never_on_minus_inf(vocab, spread):
    """Rows with -inf at every chunk edge, a whole chunk -inf, the tail, all but one edge
    token (edge_weights' rows, as logits log w); u = 1 (the last finite token) and 2**-53
    (the first) among them; logits spread over 17 decades or within one."""
    gen = torch.Generator().manual_seed(vocab + spread)
    rows = 48 if vocab > 100_000 else 400
    w = edge_weights(rows, vocab, C, gen, spread)
    w[(w == 0).all(-1), -1] = 1.0  # a row keeps one token (the sampler's filters keep one)
    logits, u = w.log(), uniforms(rows, gen)
    got = native_draw(logits, u)
    native_on_target(logits, u, got)
    top = (logits == logits.amax(-1, keepdim=True)).float().argmax(-1)
    finite = (logits > float("-inf")).sum(-1)
    one = finite == 1
    assert torch.equal(got[one], top[one])  # a row of one finite token draws it
    if not spread:  # u = 1: the last token of weight > 0 (spread, one below float64's ulp
        last = logits.size(1) - 1 - (logits.flip(-1) > float("-inf")).float().argmax(-1)
        at_top = u[:, 0] == 1.0  # of the total may be passed over, as by any float64 CDF)
        assert torch.equal(got[at_top], last[at_top])


def test_native_draw_beside_each_chunk_edge():
    """u * total a float64 ulp and 1e-6 of the total either side of the CDF at every chunk's
    end: 1e-6 away (beyond the exp's rounding) only the token on its side of the edge."""
    vocab, size = 6 * C + 40, C
    logits = edge_weights(8, vocab, size, torch.Generator().manual_seed(3)).log()
    cdf = float64_weights(logits).cumsum(-1)
    rows, us, sides = [], [], []
    for r in range(len(logits)):
        for edge in range(size - 1, vocab - 1, size):
            if not (cdf[r, edge] > 0 and cdf[r, edge] < cdf[r, -1]):
                continue  # nothing before or nothing after the edge: no two sides
            u = (cdf[r, edge] / cdf[r, -1]).item()
            for x_, side in (
                (u - 1e-6, -1),
                (math.nextafter(u, 0), 0),
                (u, 0),
                (math.nextafter(u, 2), 0),
                (u + 1e-6, 1),
            ):
                rows.append(r), us.append(x_), sides.append((side, edge))
    u = torch.tensor(us, dtype=F64)[:, None]
    got = native_draw(logits[rows], u)
    native_on_target(logits[rows], u, got)
    for token, (side, edge) in zip(got.tolist(), sides):
        assert side == 0 or (token <= edge) == (side < 0), (token, side, edge)


def test_native_draw_is_the_same_on_one_and_two_threads():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(67, 3000, generator=gen) * 4
    logits[torch.rand(67, 3000, generator=gen) < 0.3] = float("-inf")
    u = 1 - torch.rand(67, 1, dtype=F64, generator=gen)
    assert torch.equal(native_draw(logits, u, 1), native_draw(logits, u, 2))


@pytest.mark.parametrize("vocab", [1, C - 1, C, C + 1, 3 * C + 5])
def test_native_argmax_is_torchs_ties_nan_and_infinities_included(vocab):
    """cpu_sample.argmax against torch.argmax, index for index: ties (the first wins, at and
    across chunk edges), a NaN (the first NaN wins), -inf and +inf, rows all -inf; on one
    thread and on two."""
    library = native_library(cpu_sample.load)
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 3, (12, vocab), generator=gen).float()  # many ties
    logits[1] = float("-inf")
    logits[2, -1] = float("inf")
    logits[3, vocab // 2] = float("nan")
    logits[3, -1] = float("nan")
    logits[4, :] = 7.0
    logits[5, min(C, vocab - 1)] = 9.0  # a chunk's first
    logits[5, vocab - 1] = 9.0
    logits[6, min(C - 1, vocab - 1)] = 9.0  # a chunk's last
    logits[7, 0] = float("nan")
    logits[8, -1] = 100.0  # the tail's last
    logits[9] = torch.randn(vocab, generator=gen)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_sample.argmax(library, logits), logits.argmax(dim=-1)), threads
    finally:
        torch.set_num_threads(before)
