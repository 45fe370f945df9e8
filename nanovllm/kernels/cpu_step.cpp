// A dense decoder's decode step on a CPU in one call (kernels/cpu_step.py launches it): the
// token embedding, every layer, the final RMSNorm and the LM head for a few rows, as the eager
// model runs them (models/decoder.py), with no PyTorch op between. What the eager layers call natively
// (RMSNorm, rotary, paged decode attention, the int8 and int4 GEMMs) it calls through the same
// libraries' functions, handed over as pointers; what it adds is the float32 GEMM of a few rows
// (`f32_linear`, also exported for the LM head), SwiGLU's gate and the KV-cache store.
//
//   x = embed[id];  per layer:  h = norm(x (+ residual));  qkv = h Wqkv^T (+ b)
//       q, k = rotary(q_norm(q), k_norm(k));  cache[slot] = k, v;  a = attention(q)
//       h, residual = norm(a Wo^T (+ b) + residual);  x = (silu(g) * u)(h Wgu^T) Wd^T
//   hidden = norm(x + residual);  logits = hidden Whead^T   (or the hidden states, without a head)
//
// Float32 activations and KV cache; a linear's weight is float32 [N, K] row-major, int8
// panels with per-channel scales (cpu_int8.cpp's layout) or int4 panels with their groups'
// scales and offsets in one of cpu_int4.cpp's forms.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__)
#define W 16  // floats a vector
#else
#define W 8
#endif
using vec = float __attribute__((vector_size(W * sizeof(float))));

inline vec load(const float* p) {  // any alignment
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The sums of four vectors' lanes, {sum(a), sum(b), sum(c), sum(d)}: lanes added pairwise
// across the four at once (a quarter of the shuffles of four sums one by one).
using quad = float __attribute__((vector_size(4 * sizeof(float))));
inline quad sum4(vec a, vec b, vec c, vec d) {
#if W == 16
  const vec ab = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                         14, 30) +
                 __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                         15, 31);
  const vec cd = __builtin_shufflevector(c, d, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                         14, 30) +
                 __builtin_shufflevector(c, d, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                         15, 31);
  const vec abcd = __builtin_shufflevector(ab, cd, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                           13, 28, 29) +
                   __builtin_shufflevector(ab, cd, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                           15, 30, 31);
  const auto half = __builtin_shufflevector(abcd, abcd, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(abcd, abcd, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(half, half, 0, 1, 2, 3) +
         __builtin_shufflevector(half, half, 4, 5, 6, 7);
#else
  const vec ab = __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
                 __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
  const vec cd = __builtin_shufflevector(c, d, 0, 8, 2, 10, 4, 12, 6, 14) +
                 __builtin_shufflevector(c, d, 1, 9, 3, 11, 5, 13, 7, 15);
  const vec abcd = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(abcd, abcd, 0, 1, 2, 3) +
         __builtin_shufflevector(abcd, abcd, 4, 5, 6, 7);
#endif
}

// y[r, n] = x[r] . w[n] (+ b[n]) for R rows of x and output channels [n0, n1). The weight is
// read in its order, row after row (one stream, which the prefetchers follow: four rows read
// side by side streamed at half the rate from L3), each row once for the R rows of x; the
// lanes of four rows' sums are added up together (sum4).
template <int R>
void dot_rows(const float* x, int64_t k, const float* w, const float* b, float* y, int64_t ldy,
              int64_t n0, int64_t n1) {
  const int64_t body = k / (2 * W) * (2 * W);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    vec acc[R][4];
    for (int j = 0; j < 4; ++j) {
      const float* row = w + (n + j) * k;
      vec even[R] = {}, odd[R] = {};  // two chains a row: the FMA's latency
      for (int64_t i = 0; i < body; i += 2 * W) {
        const vec w0 = load(row + i), w1 = load(row + i + W);
        for (int r = 0; r < R; ++r)
          even[r] += load(x + r * k + i) * w0, odd[r] += load(x + r * k + i + W) * w1;
      }
      for (int r = 0; r < R; ++r) acc[r][j] = even[r] + odd[r];
    }
    for (int r = 0; r < R; ++r) {
      const quad totals = sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      for (int j = 0; j < 4; ++j) {
        float total = totals[j];
        for (int64_t i = body; i < k; ++i) total += x[r * k + i] * w[(n + j) * k + i];
        y[r * ldy + n + j] = b ? total + b[n + j] : total;
      }
    }
  }
  for (; n < n1; ++n)
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t i = 0; i < k; ++i) total += x[r * k + i] * w[n * k + i];
      y[r * ldy + n] = b ? total + b[n] : total;
    }
}

// Below this many weights a fork/join of threads costs more than the GEMM they would share.
constexpr int64_t GRAIN = 1 << 16;

void f32_linear(const float* x, const float* w, const float* b, float* y, int64_t rows,
                int64_t n, int64_t k, int num_threads) {
  const int64_t blocks = (n + 63) / 64;  // 64 output channels a task
#pragma omp parallel for if (n * k >= GRAIN && num_threads > 1) num_threads(num_threads)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t n0 = block * 64, n1 = n0 + 64 < n ? n0 + 64 : n;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) dot_rows<4>(x + r * k, k, w, b, y + r * n, n, n0, n1);
    switch (rows - r) {
      case 3: dot_rows<3>(x + r * k, k, w, b, y + r * n, n, n0, n1); break;
      case 2: dot_rows<2>(x + r * k, k, w, b, y + r * n, n, n0, n1); break;
      case 1: dot_rows<1>(x + r * k, k, w, b, y + r * n, n, n0, n1); break;
    }
  }
}

// The other libraries' entry points (cpu_ops.cpp, cpu_decode.cpp, cpu_int8.cpp, cpu_int4.cpp).
using RmsNorm = void (*)(const void*, int64_t, const void*, const void*, void*, void*, int64_t,
                         int, int, float, int, int, int);
using Rotary = int64_t (*)(const int64_t*, const void*, int64_t, const void*, int64_t,
                           const float*, int64_t, void*, int64_t, int, int, int, int, int);
using PagedDecode = void (*)(const float*, const void*, const void*, float*, const int32_t*,
                             int64_t, const int32_t*, int, int, int, int, int, float, int, int);
using Int8Linear = void (*)(const void*, int, const void*, const float*, const float*, float*,
                            int64_t, int64_t, int64_t, int);
using Int4Linear = void (*)(const void*, int, const void*, const float*, float*, int64_t, int64_t,
                            int64_t, int64_t, int, int);

struct Linear {
  const void* weight;  // float32 [out, in]; int8 panels when scale is set; int4 when group is
  const float* scale;
  const float* bias;  // or null
  int64_t out, in;
  int64_t group;  // int4's group size, else 0
  int64_t form;   // int4's form (cpu_int4.cpp's Form: how a group holds its scales)
};

struct Layer {
  Linear qkv, o, gate_up, down;
  const float *input_norm, *post_norm, *q_norm, *k_norm;  // q_norm, k_norm: null without
  float *k_cache, *v_cache;                               // [blocks, block_size, kv_heads, dim]
};

struct Model {
  int num_layers, hidden, heads, kv_heads, head_dim, block_size, norm_lanes;
  float eps, scale;
  const float* embed;       // [vocab, hidden]
  const float* final_norm;  // [hidden]
  const float* rope;        // [max_position, 2, head_dim]: (cos | cos), (-sin | sin)
  int64_t max_position;
  const Layer* layers;
  Linear head;  // the LM head [vocab, hidden]; its weight null: the step ends at the hidden states
  RmsNorm rms_norm;
  Rotary rotary;
  PagedDecode paged_decode;
  Int8Linear int8_linear;  // null when no weight is int8
  Int4Linear int4_linear;  // null when no weight is int4
};

void linear(const Model& m, const Linear& l, const float* x, float* y, int64_t rows,
            int threads) {
  if (l.group > 0)
    m.int4_linear(x, 0, l.weight, l.bias, y, rows, l.out, l.in, l.group,
                  static_cast<int>(l.form), threads);
  else if (l.scale != nullptr)
    m.int8_linear(x, 0, l.weight, l.scale, l.bias, y, rows, l.out, l.in, threads);
  else
    f32_linear(x, static_cast<const float*>(l.weight), l.bias, y, rows, l.out, l.in, threads);
}

// norm(x) over rows of `heads` vectors of `dim`; with `residual`: norm(x + residual), and
// residual_out = x + residual (cpu_ops.cpp's rms_norm, as the eager layers call it).
// `stride`: floats from one row of x to the next (out and residual are dense).
void norm(const Model& m, const float* x, int64_t stride, const float* residual,
          const float* weight, float* out, float* residual_out, int64_t rows, int heads, int dim,
          int threads) {
  m.rms_norm(x, stride, residual, weight, out, residual_out, rows, heads, dim, m.eps,
             m.norm_lanes, 0, threads);
}

// SwiGLU's gate over [rows, 2 * n] (gate | up): silu(g) * u, as F.silu(g) * u rounds it.
void silu_and_mul(const float* gate_up, float* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const float g = gate_up[r * 2 * n + i];
      out[r * n + i] = g / (1.f + std::exp(-g)) * gate_up[r * 2 * n + n + i];
    }
}

}  // namespace

extern "C" void nanovllm_f32_linear(const float* x, const float* w, const float* b, float* y,
                                    int64_t rows, int64_t n, int64_t k, int num_threads) {
  f32_linear(x, w, b, y, rows, n, k, num_threads);
}

// out: [rows, vocab] logits, or [rows, hidden] hidden states without a head. Returns -1, or
// the row whose position is outside the rotary cache (nothing is valid then).
extern "C" int64_t nanovllm_decoder_step(const Model* model, const int64_t* ids,
                                         const int64_t* positions, const int64_t* slots,
                                         const int32_t* block_tables, int64_t table_stride,
                                         const int32_t* context_lens, int64_t rows, float* out,
                                         int threads) {
  const Model& m = *model;
  const int64_t h = m.hidden, dim = m.head_dim, q_size = m.heads * dim, kv_size = m.kv_heads * dim;
  const int64_t qkv_size = q_size + 2 * kv_size, inter = m.layers[0].gate_up.out / 2;
  for (int64_t r = 0; r < rows; ++r)
    if (positions[r] < 0 || positions[r] >= m.max_position) return r;
  thread_local std::vector<float> work;
  work.resize(rows * (4 * h + qkv_size + 3 * q_size + 2 * kv_size + 3 * inter));
  float *x = work.data(), *residual = x + rows * h, *normed = residual + rows * h;
  float *qkv = normed + rows * h, *q = qkv + rows * qkv_size, *k = q + rows * q_size;
  float *qk = k + rows * kv_size, *attn = qk + rows * (q_size + kv_size);
  float* gate_up = attn + rows * q_size;
  float *act = gate_up + rows * 2 * inter, *hidden = act + rows * inter;
  for (int64_t r = 0; r < rows; ++r) std::memcpy(x + r * h, m.embed + ids[r] * h, h * 4);
  for (int i = 0; i < m.num_layers; ++i) {
    const Layer& l = m.layers[i];
    if (i == 0) {
      std::memcpy(residual, x, rows * h * 4);
      norm(m, x, h, nullptr, l.input_norm, normed, nullptr, rows, 1, h, threads);
    } else {
      norm(m, x, h, residual, l.input_norm, normed, residual, rows, 1, h, threads);
    }
    linear(m, l.qkv, normed, qkv, rows, threads);
    // q and k normed per head (Qwen3) into qk, then rotated into q and k.
    const float *q_in = qkv, *k_in = qkv + q_size;
    int64_t stride = qkv_size;
    if (l.q_norm != nullptr) {
      norm(m, qkv, qkv_size, nullptr, l.q_norm, qk, nullptr, rows, m.heads, dim, threads);
      norm(m, qkv + q_size, qkv_size, nullptr, l.k_norm, qk + rows * q_size, nullptr, rows,
           m.kv_heads, dim, threads);
      q_in = qk, k_in = qk + rows * q_size, stride = 0;
    }
    m.rotary(positions, q_in, stride ? stride : q_size, nullptr, 0, m.rope, m.max_position, q,
             rows, m.heads, 0, dim, 0, threads);
    m.rotary(positions, k_in, stride ? stride : kv_size, nullptr, 0, m.rope, m.max_position, k,
             rows, m.kv_heads, 0, dim, 0, threads);
    for (int64_t r = 0; r < rows; ++r) {
      if (slots[r] < 0) continue;
      std::memcpy(l.k_cache + slots[r] * kv_size, k + r * kv_size, kv_size * 4);
      std::memcpy(l.v_cache + slots[r] * kv_size, qkv + r * qkv_size + q_size + kv_size,
                  kv_size * 4);
    }
    m.paged_decode(q, l.k_cache, l.v_cache, attn, block_tables, table_stride, context_lens,
                   static_cast<int>(rows), m.heads, m.kv_heads, m.head_dim, m.block_size, m.scale,
                   0, threads);
    linear(m, l.o, attn, x, rows, threads);
    norm(m, x, h, residual, l.post_norm, normed, residual, rows, 1, h, threads);
    linear(m, l.gate_up, normed, gate_up, rows, threads);
    silu_and_mul(gate_up, act, rows, inter);
    linear(m, l.down, act, x, rows, threads);
  }
  if (m.head.weight == nullptr) {
    norm(m, x, h, residual, m.final_norm, out, residual, rows, 1, h, threads);
    return -1;
  }
  norm(m, x, h, residual, m.final_norm, hidden, residual, rows, 1, h, threads);
  linear(m, m.head, hidden, out, rows, threads);
  return -1;
}
