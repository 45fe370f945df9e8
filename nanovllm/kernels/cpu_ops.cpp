// The small ops between the matmuls on a CPU, one call each instead of PyTorch's 5-10 small
// ops (~5-10 us each). Plain C++ with C entry points, no PyTorch headers, built like
// cpu_decode.cpp (nanovllm/kernels/cpu_ops.py). T is float32 or bfloat16; every result is
// bit-equal to the eager op of layers/ (layernorm.py, rotary_embedding.py), because each step
// rounds where PyTorch's does: a bfloat16 op computes in float32 and rounds to nearest-even,
// and a*b + c is two roundings (built with -ffp-contract=off, so never one FMA).
//
//   nanovllm_rms_norm: for each row x (a token's `heads` rows of `dim`, tokens `stride` apart;
//     r, out and residual_out contiguous), with a residual r first x = T(x + r), written to
//     residual_out; then out = T(weight * T(x * (1 / sqrt(sum(x * x) / dim + eps)))), x and
//     weight widened to float32, the sum in the order of PyTorch's CPU sum (sums_of_squares).
//   nanovllm_rotary: q and k of each token (heads of `dim`, tokens `q_stride`, `k_stride`
//     apart) rotated by its position's cache row (cos | cos), (-sin | sin), both first
//     rounded to T: out = T(T(x_rotated_half * sin) + T(x * cos)), out [tokens, q_heads +
//     k_heads, dim] contiguous. Returns the first token whose position is outside the cache,
//     or -1.
// Both spread their rows over `num_threads` OpenMP threads from PyTorch's grain size on.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using bf16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// float32 -> T, rounding to nearest-even as PyTorch does (a NaN: its quiet NaN).
inline float narrow(float x, float) { return x; }
inline bf16 narrow(float x, bf16) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? bf16{0x7fc0} : static_cast<bf16>(rounded);
}
// x rounded to T's precision, kept as a float32.
template <typename T>
inline float round_to(float x) { return widen(narrow(x, T{})); }

// PyTorch's float32 sum of a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp,
// cascade_sum), of the squares of x widened, reproduced step for step: a sum's rounding
// depends on its order. Vectors of L floats (Vectorized<float> of the build that runs: 8 on
// x86, AVX-512 CPUs included, see below) are summed lane by lane into 4 accumulators, vector
// j into j % 4 ("rows" of 4 vectors); every `step` rows (16 below 2^20 rows) the
// accumulators are carried into a second level, every step^2 into a third, step^3 a fourth,
// so that no sum grows long; then the levels, then the 4 accumulators, are added up (the
// levels only where carried into: else they hold zeros, and adding 0 is exact).
//
// L is 8 under AVX-512 too: SumKernel.cpp registers its kernels with REGISTER_DISPATCH, not
// ALSO_REGISTER_AVX512_DISPATCH ("these kernels are slower with AVX512 than with AVX2"), so a
// CPU whose capability is AVX512 runs the AVX2 build of sum (and of mean, a sum then a
// division). Checked with torch 2.13 on a Sapphire Rapids: torch.sum's bits are those of
// ATEN_CPU_CAPABILITY=avx2 and of this function with L = 8, over every row; with L = 16 about
// half the rows differed in the last bit (a 1-row case could pass by chance). The L = 16 path
// stays for a PyTorch whose sum would be dispatched with 16-lane vectors (cpu_ops.py's LANES).
template <int L, typename T>
void cascade_sum_of_squares(const T* x, int64_t count, float* total) {
  constexpr int ILP = 4, LEVELS = 4;
  float acc[LEVELS][ILP][L] = {};
  const int64_t rows = count / ILP;
  const int ceil_log2 = rows <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(rows - 1));
  const int power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;  // torch's level_power
  const int64_t step = int64_t{1} << power;
  auto add = [&](float* a, int64_t vector) {
    for (int l = 0; l < L; ++l) {
      const float v = widen(x[vector * L + l]);
      a[l] += v * v;
    }
  };
  int64_t i = 0;
  for (; i + step <= rows;) {
    for (int64_t end = i + step; i < end; ++i)
      for (int k = 0; k < ILP; ++k) add(acc[0][k], i * ILP + k);
    for (int j = 1; j < LEVELS; ++j) {
      for (int k = 0; k < ILP; ++k)
        for (int l = 0; l < L; ++l) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.f;
      if (i & ((step - 1) << (j * power))) break;  // i is no multiple of step^(j + 1)
    }
  }
  const bool carried = i > 0;
  for (; i < rows; ++i)
    for (int k = 0; k < ILP; ++k) add(acc[0][k], i * ILP + k);
  for (int j = 1; carried && j < LEVELS; ++j)
    for (int k = 0; k < ILP; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = rows * ILP; v < count; ++v) add(acc[0][0], v);  // the vectors left over
  for (int k = 1; k < ILP; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  std::memcpy(total, acc[0][0], sizeof(float) * L);
}

// Rows at a time, at most BLOCK.
constexpr int BLOCK = 16;

// totals[j] = the sum of rows[j]'s n squares, j < count, in PyTorch's order: a row under L
// elements summed as with L = 1; else its last n % L elements, then the L lanes of its
// vector sum, added one at a time. That is a chain of dependent adds, the longest part of a
// row's work: so the rows' lanes are added for all the rows at once, each in its own order.
template <int L, typename T>
void sums_of_squares(const T* const* rows, int count, int n, float* totals) {
  if (n < L) {
    for (int j = 0; j < count; ++j) cascade_sum_of_squares<1>(rows[j], n, totals + j);
    return;
  }
  float lanes[L][BLOCK];  // lane l of row j's vector sum
  for (int j = 0; j < count; ++j) {
    float sum[L];
    cascade_sum_of_squares<L>(rows[j], n / L, sum);
    for (int l = 0; l < L; ++l) lanes[l][j] = sum[l];
    totals[j] = 0.f;
    for (int i = n / L * L; i < n; ++i) totals[j] += widen(rows[j][i]) * widen(rows[j][i]);
  }
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < count; ++j) totals[j] += lanes[l][j];
}

struct NormShape {
  int64_t tokens, stride;  // x's rows: token t's heads start at t * stride
  int heads, dim, lanes;
  float eps;
};

// Blocks spread over threads only from PyTorch's own grain size (32768 elements): below
// it a fork/join costs more than it saves.
constexpr int64_t GRAIN = 32768;

template <typename T>
void rms_norm(const void* x_, const void* r_, const void* w_, void* out_, void* residual_out_,
              const NormShape& s, int num_threads) {
  const T *x = static_cast<const T*>(x_), *r = static_cast<const T*>(r_);
  const T* w = static_cast<const T*>(w_);
  T *out = static_cast<T*>(out_), *residual_out = static_cast<T*>(residual_out_);
  const int64_t rows = s.tokens * s.heads;
  const int n = s.dim;
#pragma omp parallel for if (rows * n >= GRAIN) num_threads(num_threads) schedule(static)
  for (int64_t first = 0; first < rows; first += BLOCK) {
    const int count = static_cast<int>(rows - first < BLOCK ? rows - first : BLOCK);
    const T* src[BLOCK];  // each row of x, after the add
    int64_t t = first / s.heads, h = first % s.heads;
    for (int j = 0; j < count; ++j) {
      const int64_t packed = (first + j) * n;  // r, out and residual_out are contiguous
      src[j] = x + t * s.stride + h * n;
      if (r != nullptr) {
        for (int i = 0; i < n; ++i)
          residual_out[packed + i] = narrow(widen(src[j][i]) + widen(r[packed + i]), T{});
        src[j] = residual_out + packed;
      }
      if (++h == s.heads) h = 0, ++t;
    }
    float inverse[BLOCK];  // 1 / rms
    if (s.lanes == 16)
      sums_of_squares<16>(src, count, n, inverse);
    else
      sums_of_squares<8>(src, count, n, inverse);
    for (int j = 0; j < count; ++j)
      inverse[j] = 1.f / std::sqrt(inverse[j] / static_cast<float>(n) + s.eps);
    for (int j = 0; j < count; ++j)
      for (int i = 0; i < n; ++i)
        out[(first + j) * n + i] =
            narrow(widen(w[i]) * round_to<T>(widen(src[j][i]) * inverse[j]), T{});
  }
}

struct RotaryShape {
  int64_t tokens, q_stride, k_stride, max_position;
  int q_heads, k_heads, dim;
};

// y[i] = T(T(x[j] * sin[i]) + T(x[i] * cos[i])), x[j] the other half's element: (x2 | x1).
template <typename T>
inline T rotate(T other, float sin, T x, float cos) {
  return narrow(round_to<T>(widen(other) * sin) + round_to<T>(widen(x) * cos), T{});
}

template <typename T>
void rotate_head(const T* __restrict x, const float* __restrict cos,
                 const float* __restrict sin, int dim, T* __restrict y) {
  const int half = dim / 2;
  for (int i = 0; i < half; ++i) y[i] = rotate(x[i + half], sin[i], x[i], cos[i]);
  for (int i = half; i < dim; ++i) y[i] = rotate(x[i - half], sin[i], x[i], cos[i]);
}

template <typename T>
int64_t rotary(const int64_t* positions, const void* q_, const void* k_, const float* cache,
               void* out_, const RotaryShape& s, int num_threads) {
  const T *q = static_cast<const T*>(q_), *k = static_cast<const T*>(k_);
  T* out = static_cast<T*>(out_);
  for (int64_t t = 0; t < s.tokens; ++t)
    if (positions[t] < 0 || positions[t] >= s.max_position) return t;
  const int heads = s.q_heads + s.k_heads, dim = s.dim;
#pragma omp parallel if (s.tokens * heads * dim >= GRAIN) num_threads(num_threads)
  {
    std::vector<float> rounded(2 * dim);  // a cache row rounded to T
#pragma omp for schedule(static)
    for (int64_t t = 0; t < s.tokens; ++t) {
      const float* row = cache + positions[t] * 2 * dim;  // [2, dim]: cos, then sin
      if constexpr (!std::is_same_v<T, float>) {
        for (int i = 0; i < 2 * dim; ++i) rounded[i] = round_to<T>(row[i]);
        row = rounded.data();
      }
      T* y = out + t * heads * dim;
      for (int h = 0; h < s.q_heads; ++h)
        rotate_head(q + t * s.q_stride + h * dim, row, row + dim, dim, y + h * dim);
      for (int h = 0; h < s.k_heads; ++h)
        rotate_head(k + t * s.k_stride + h * dim, row, row + dim, dim, y + (s.q_heads + h) * dim);
    }
  }
  return -1;
}

}  // namespace

extern "C" void nanovllm_rms_norm(const void* x, int64_t stride, const void* residual,
                                  const void* weight, void* out, void* residual_out,
                                  int64_t tokens, int heads, int dim, float eps, int lanes,
                                  int is_bf16, int num_threads) {
  const NormShape s{tokens, stride, heads, dim, lanes, eps};
  if (is_bf16)
    rms_norm<bf16>(x, residual, weight, out, residual_out, s, num_threads);
  else
    rms_norm<float>(x, residual, weight, out, residual_out, s, num_threads);
}

extern "C" int64_t nanovllm_rotary(const int64_t* positions, const void* q, int64_t q_stride,
                                   const void* k, int64_t k_stride, const float* cache,
                                   int64_t max_position, void* out, int64_t tokens, int q_heads,
                                   int k_heads, int dim, int is_bf16, int num_threads) {
  const RotaryShape s{tokens, q_stride, k_stride, max_position, q_heads, k_heads, dim};
  return is_bf16 ? rotary<bf16>(positions, q, k, cache, out, s, num_threads)
                 : rotary<float>(positions, q, k, cache, out, s, num_threads);
}
