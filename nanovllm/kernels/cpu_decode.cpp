// Paged decode attention on a CPU: one query token per sequence, read straight from the
// paged KV cache (no dense copy of the rows in use). Plain C++ with a C entry point, no
// PyTorch headers, so it builds in a few seconds (nanovllm/kernels/cpu_decode.py).
//
//   q, out       [num_seqs, num_heads, head_dim]                          float32
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]         float32 | bfloat16
//   block_tables [num_seqs, table_stride] int32;  context_lens [num_seqs] int32
//
// One work item (thread) = one sequence, scheduled dynamically. For each:
//   1. row_offsets: where each token's row (all kv heads) starts, the same in K and V: the
//      block table walked block by block, a fixed stride inside a block (no division a token).
//   2. score: scores[h][t] = q[h] . k[t]. Rows are taken TOKENS at a time, in order (whole
//      rows: memory the prefetcher follows); each kv head's slice of them meets two query
//      heads of its GQA group at once. That is TOKENS x 2 independent FMA chains (one chain
//      waits on the FMA latency, ~4 cycles, the whole time), each K vector loaded and widened
//      once for both heads, each q vector once for TOKENS keys. TOKENS = 8 rather than 4:
//      more rows (pages) in flight at once, which paid most where the cache is read from
//      DRAM (16 was slower again).
//   3. softmax of each head's scores, in place.
//   4. weigh: out[h] = sum_t p[h][t] v[t] over the same tiles: out is loaded and stored once
//      for TOKENS rows, each V vector loaded once for two heads.
// head_dim is a compile-time constant for the usual sizes (decode<DIM>, DIM = 0 for any
// other), so that the loops over it unroll: at head_dim 16, loop overhead was most of the
// time. Vectors are GCC vector extensions of W floats (AVX2: a register, NEON: two), taken
// 2W at a time: a bfloat16 chunk of 2W is one load, its even elements a shift, its odd ones
// a mask (bfloat16 is the top half of a float32). So q and out are kept in that lane order
// (evens, odds a chunk) while a sequence is worked on ("lanes"; float32's is the natural
// order); the last head_dim % 2W elements go one at a time. All sums in float32.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_exp.h"  // exp_nonpositive

namespace {

// Forced: GCC declined to inline the tile functions, and a call's fixed cost, paid once a
// tile, was ~1/6 of the time at head_dim 16.
#define ALWAYS_INLINE inline __attribute__((always_inline))

using bf16 = uint16_t;
constexpr int W = 8;       // floats a vector
constexpr int TOKENS = 8;  // rows a tile
using vec = float __attribute__((vector_size(W * sizeof(float))));
using half_vec = float __attribute__((vector_size(W / 2 * sizeof(float))));
using u32_vec = uint32_t __attribute__((vector_size(W * sizeof(uint32_t))));

inline vec load(const float* p) {  // any alignment
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// 2W elements from p as two vectors, in lane order: for float32 p[0, W) and p[W, 2W); for
// bfloat16 the even and the odd elements (a 32-bit lane holds two, little-endian: the
// even one low).
inline void load2(const float* p, vec& a, vec& b) { a = load(p), b = load(p + W); }
inline void load2(const bf16* p, vec& a, vec& b) {
  u32_vec pairs;
  std::memcpy(&pairs, p, sizeof pairs);
  a = reinterpret_cast<vec>(pairs << 16);
  b = reinterpret_cast<vec>(pairs & 0xffff0000u);
}
inline float widen(float x) { return x; }
inline float widen(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// A head's n floats, natural order <-> lane order of cache type T (chunks of 2W; the rest as is).
inline void arrange(const float* x, float* lanes, int n, float) {
  std::memcpy(lanes, x, sizeof(float) * n);
}
inline void arrange(const float* x, float* lanes, int n, bf16) {
  int d = 0;
  for (; d + 2 * W <= n; d += 2 * W)
    for (int i = 0; i < W; ++i) lanes[d + i] = x[d + 2 * i], lanes[d + W + i] = x[d + 2 * i + 1];
  for (; d < n; ++d) lanes[d] = x[d];
}
inline void unarrange(const float* lanes, float* x, int n, float) {
  std::memcpy(x, lanes, sizeof(float) * n);
}
inline void unarrange(const float* lanes, float* x, int n, bf16) {
  int d = 0;
  for (; d + 2 * W <= n; d += 2 * W)
    for (int i = 0; i < W; ++i) x[d + 2 * i] = lanes[d + i], x[d + 2 * i + 1] = lanes[d + W + i];
  for (; d < n; ++d) x[d] = lanes[d];
}

// sums[j] = the sum of acc[j]'s lanes, j < N: four at once by two rounds of pairwise sums.
inline half_vec fold(vec v) {
  half_vec lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lo + hi;
}
template <int N>
ALWAYS_INLINE void lane_sums(const vec* acc, float* sums) {
  for (int j = 0; j + 4 <= N; j += 4) {
    const half_vec a = fold(acc[j]), b = fold(acc[j + 1]), c = fold(acc[j + 2]), d = fold(acc[j + 3]);
    const half_vec ab = half_vec{a[0], a[2], b[0], b[2]} + half_vec{a[1], a[3], b[1], b[3]};
    const half_vec cd = half_vec{c[0], c[2], d[0], d[2]} + half_vec{c[1], c[3], d[1], d[3]};
    const half_vec s = half_vec{ab[0], ab[2], cd[0], cd[2]} + half_vec{ab[1], ab[3], cd[1], cd[3]};
    std::memcpy(sums + j, &s, sizeof s);
  }
  for (int j = N / 4 * 4; j < N; ++j) {
    const half_vec s = fold(acc[j]);
    sums[j] = (s[0] + s[2]) + (s[1] + s[3]);
  }
}

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_size, group;  // group: query heads a kv head
  int64_t table_stride;
  float scale;
};

// offsets[t]: where token t's row starts in either cache, in elements.
void row_offsets(const int32_t* table, int len, const Shape& s, int64_t* offsets) {
  const int64_t width = static_cast<int64_t>(s.num_kv_heads) * s.head_dim;
  for (int t = 0, b = 0; t < len; ++b) {
    const int64_t base = table[b] * (s.block_size * width);
    const int rows = len - t < s.block_size ? len - t : s.block_size;
    for (int r = 0; r < rows; ++r) offsets[t++] = base + r * width;
  }
}

// scores[i * len + j] = q[i * dim:] . k_j[:dim] for heads i < P and rows j < N (k_j: one kv
// head's slice of a row; q in lane order).
template <int N, int P, typename T>
ALWAYS_INLINE void dot_tile(const float* q, const T* const* k, int dim, int len, float* scores) {
  vec acc[P][N];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = vec{};
  const int whole = dim / (2 * W) * (2 * W);
  for (int d = 0; d < whole; d += 2 * W) {
    vec qa[P], qb[P];
    for (int i = 0; i < P; ++i) qa[i] = load(q + i * dim + d), qb[i] = load(q + i * dim + d + W);
    for (int j = 0; j < N; ++j) {
      vec ka, kb;
      load2(k[j] + d, ka, kb);
      for (int i = 0; i < P; ++i) acc[i][j] += qa[i] * ka + qb[i] * kb;
    }
  }
  for (int i = 0; i < P; ++i) {
    float sums[N];
    lane_sums<N>(acc[i], sums);
    for (int j = 0; j < N; ++j) {
      for (int d = whole; d < dim; ++d) sums[j] += q[i * dim + d] * widen(k[j][d]);
      scores[i * len + j] = sums[j];
    }
  }
}

// out[i * dim:][:dim] += sum_j p[i * len + j] v_j[:dim] for heads i < P and rows j < N
// (out in lane order).
template <int N, int P, typename T>
ALWAYS_INLINE void axpy_tile(const float* p, const T* const* v, int dim, int len, float* out) {
  float pj[P][N];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < N; ++j) pj[i][j] = p[i * len + j];
  const int whole = dim / (2 * W) * (2 * W);
  for (int d = 0; d < whole; d += 2 * W) {
    vec oa[P], ob[P];
    for (int i = 0; i < P; ++i) oa[i] = load(out + i * dim + d), ob[i] = load(out + i * dim + d + W);
    for (int j = 0; j < N; ++j) {
      vec va, vb;
      load2(v[j] + d, va, vb);
      for (int i = 0; i < P; ++i) oa[i] += pj[i][j] * va, ob[i] += pj[i][j] * vb;
    }
    for (int i = 0; i < P; ++i) store(out + i * dim + d, oa[i]), store(out + i * dim + d + W, ob[i]);
  }
  for (int d = whole; d < dim; ++d)
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < N; ++j) out[i * dim + d] += pj[i][j] * widen(v[j][d]);
}

// Rows [t, t + N) against every head: each kv head's slices, its group's heads two at a time.
template <int N, int DIM, typename T>
ALWAYS_INLINE void score_rows(const float* q, const T* k_cache, const int64_t* offsets, int t,
                              int len, const Shape& s, float* scores) {
  const int dim = DIM ? DIM : s.head_dim;
  for (int kv = 0; kv < s.num_kv_heads; ++kv) {
    const T* k[N];
    for (int j = 0; j < N; ++j) k[j] = k_cache + offsets[t + j] + kv * dim;
    const int end = (kv + 1) * s.group;
    int h = kv * s.group;
    for (; h + 2 <= end; h += 2) dot_tile<N, 2>(q + h * dim, k, dim, len, scores + h * len + t);
    if (h < end) dot_tile<N, 1>(q + h * dim, k, dim, len, scores + h * len + t);
  }
}

template <int N, int DIM, typename T>
ALWAYS_INLINE void weigh_rows(const float* p, const T* v_cache, const int64_t* offsets, int t,
                              int len, const Shape& s, float* out) {
  const int dim = DIM ? DIM : s.head_dim;
  for (int kv = 0; kv < s.num_kv_heads; ++kv) {
    const T* v[N];
    for (int j = 0; j < N; ++j) v[j] = v_cache + offsets[t + j] + kv * dim;
    const int end = (kv + 1) * s.group;
    int h = kv * s.group;
    for (; h + 2 <= end; h += 2) axpy_tile<N, 2>(p + h * len + t, v, dim, len, out + h * dim);
    if (h < end) axpy_tile<N, 1>(p + h * len + t, v, dim, len, out + h * dim);
  }
}

// scores[h * len + t] = q[h] . k[t] for every head and token.
template <int DIM, typename T>
void score(const float* q, const T* k_cache, const int64_t* offsets, int len, const Shape& s,
           float* scores) {
  int t = 0;
  for (; t + TOKENS <= len; t += TOKENS)
    score_rows<TOKENS, DIM>(q, k_cache, offsets, t, len, s, scores);
  for (; t < len; ++t) score_rows<1, DIM>(q, k_cache, offsets, t, len, s, scores);
}

// Each head's row of scores -> softmax(scale * scores), in place.
void softmax(float* scores, int len, int num_heads, float scale) {
  for (int h = 0; h < num_heads; ++h) {
    float* sc = scores + h * len;
    float top = sc[0], total = 0.f;
#pragma omp simd reduction(max : top)
    for (int t = 1; t < len; ++t) top = sc[t] > top ? sc[t] : top;
#pragma omp simd reduction(+ : total)
    for (int t = 0; t < len; ++t) total += (sc[t] = exp_nonpositive((sc[t] - top) * scale));
    const float inverse = 1.f / total;
#pragma omp simd
    for (int t = 0; t < len; ++t) sc[t] *= inverse;
  }
}

// out[h] = sum_t p[h * len + t] v[t] for every head.
template <int DIM, typename T>
void weigh(const float* p, const T* v_cache, const int64_t* offsets, int len, const Shape& s,
           float* out) {
  for (int i = 0; i < s.num_heads * s.head_dim; ++i) out[i] = 0.f;
  int t = 0;
  for (; t + TOKENS <= len; t += TOKENS)
    weigh_rows<TOKENS, DIM>(p, v_cache, offsets, t, len, s, out);
  for (; t < len; ++t) weigh_rows<1, DIM>(p, v_cache, offsets, t, len, s, out);
}

template <int DIM, typename T>
void decode(const float* q, const T* k_cache, const T* v_cache, float* out,
            const int32_t* block_tables, const int32_t* context_lens, int num_seqs,
            const Shape& s, int num_threads) {
  int max_len = 1;
  for (int i = 0; i < num_seqs; ++i) max_len = context_lens[i] > max_len ? context_lens[i] : max_len;
  const int dim = s.head_dim, n = s.num_heads * dim;
#pragma omp parallel num_threads(num_threads)
  {
    int64_t* offsets = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * max_len));
    float* scores = static_cast<float*>(std::malloc(sizeof(float) * s.num_heads * max_len));
    float* lanes = static_cast<float*>(std::malloc(sizeof(float) * 2 * n));  // q, then out
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < num_seqs; ++i) {
      const int64_t first = static_cast<int64_t>(i) * n;
      const int len = context_lens[i];
      row_offsets(block_tables + i * s.table_stride, len, s, offsets);
      for (int h = 0; h < s.num_heads; ++h) arrange(q + first + h * dim, lanes + h * dim, dim, T{});
      score<DIM>(lanes, k_cache, offsets, len, s, scores);
      softmax(scores, len, s.num_heads, s.scale);
      weigh<DIM>(scores, v_cache, offsets, len, s, lanes + n);
      for (int h = 0; h < s.num_heads; ++h)
        unarrange(lanes + n + h * dim, out + first + h * dim, dim, T{});
    }
    std::free(lanes);
    std::free(scores);
    std::free(offsets);
  }
}

template <typename T>
void decode_any_dim(const float* q, const void* k_cache, const void* v_cache, float* out,
                    const int32_t* block_tables, const int32_t* context_lens, int num_seqs,
                    const Shape& s, int num_threads) {
  const T *k = static_cast<const T*>(k_cache), *v = static_cast<const T*>(v_cache);
  switch (s.head_dim) {  // the tests' tiny models (16, 32) and real ones' (64, 128, 256)
    case 16: return decode<16>(q, k, v, out, block_tables, context_lens, num_seqs, s, num_threads);
    case 32: return decode<32>(q, k, v, out, block_tables, context_lens, num_seqs, s, num_threads);
    case 64: return decode<64>(q, k, v, out, block_tables, context_lens, num_seqs, s, num_threads);
    case 128: return decode<128>(q, k, v, out, block_tables, context_lens, num_seqs, s, num_threads);
    case 256: return decode<256>(q, k, v, out, block_tables, context_lens, num_seqs, s, num_threads);
    default: return decode<0>(q, k, v, out, block_tables, context_lens, num_seqs, s, num_threads);
  }
}

}  // namespace

extern "C" void nanovllm_paged_decode(const float* q, const void* k_cache, const void* v_cache,
                                      float* out, const int32_t* block_tables,
                                      int64_t table_stride, const int32_t* context_lens,
                                      int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                      int block_size, float scale, int is_bf16, int num_threads) {
  const Shape s{num_heads, num_kv_heads, head_dim, block_size, num_heads / num_kv_heads,
                table_stride, scale};
  if (is_bf16)
    decode_any_dim<bf16>(q, k_cache, v_cache, out, block_tables, context_lens, num_seqs, s,
                         num_threads);
  else
    decode_any_dim<float>(q, k_cache, v_cache, out, block_tables, context_lens, num_seqs, s,
                          num_threads);
}
