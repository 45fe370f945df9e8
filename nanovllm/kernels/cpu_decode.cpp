// Paged decode attention on a CPU: one query token per sequence, read straight from the
// paged KV cache (no dense copy of the rows in use). Plain C++ with a C entry point, no
// PyTorch headers, so it builds in about a second (nanovllm/kernels/cpu_decode.py).
//
//   q, out       [num_seqs, num_heads, head_dim]                          float32
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]         float32 | bfloat16
//   block_tables [num_seqs, table_stride] int32;  context_lens [num_seqs] int32
//
// One work item (thread) = one sequence. Its token rows are read whole (every kv head:
// contiguous memory, which the prefetcher follows), once for all query heads (GQA), and
// for bfloat16 widened to float32 once. Two passes: scores of every position for every
// head, then the softmax-weighted sum of V rows; all sums in float32.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

using bf16 = uint16_t;

inline const float* widen(const float* row, float*, int) { return row; }

inline const float* widen(const bf16* row, float* buf, int dim) {
  for (int d = 0; d < dim; ++d) {  // bfloat16 is the top half of a float32
    uint32_t bits = static_cast<uint32_t>(row[d]) << 16;
    std::memcpy(buf + d, &bits, sizeof(float));
  }
  return buf;
}

// exp(x) for the softmax's x = score - max <= 0 in plain arithmetic, so that its loop
// vectorizes (libm's expf, a call a score, was a third of the kernel's time): Cephes' expf,
// 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (Cody-Waite); within 2 ulp; exp(-87) ~ 1.6e-38 below.
inline float exp_nonpositive(float x) {
  const float c = x < -87.f ? -87.f : x;
  const float n = static_cast<float>(static_cast<int32_t>(c * 1.44269504f - 0.5f));  // c <= 0
  const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n >= -126: a normal float
  return p * __builtin_bit_cast(float, bits);
}

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_size;
  int64_t table_stride;
  float scale;
};

// Token t's row (every kv head) in a sequence with block table `table`.
template <typename T>
inline const T* row_of(const T* cache, const int32_t* table, int t, const Shape& s) {
  int64_t slot = static_cast<int64_t>(table[t / s.block_size]) * s.block_size + t % s.block_size;
  return cache + slot * s.num_kv_heads * s.head_dim;
}

// One sequence, every head: q, out [num_heads, head_dim]; scores [num_heads, len].
template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int len,
            const Shape& s, float* out, float* scores, float* buf) {
  const int group = s.num_heads / s.num_kv_heads, dim = s.head_dim, width = s.num_kv_heads * dim;
  for (int t = 0; t < len; ++t) {
    const float* k = widen(row_of(k_cache, table, t, s), buf, width);
    for (int h = 0; h < s.num_heads; ++h) {
      const float *qh = q + h * dim, *kh = k + (h / group) * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < dim; ++d) dot += qh[d] * kh[d];
      scores[h * len + t] = dot * s.scale;
    }
  }
  for (int h = 0; h < s.num_heads; ++h) {
    float* sc = scores + h * len;
    float top = sc[0], total = 0.f;
#pragma omp simd reduction(max : top)
    for (int t = 1; t < len; ++t) top = sc[t] > top ? sc[t] : top;
#pragma omp simd reduction(+ : total)
    for (int t = 0; t < len; ++t) total += (sc[t] = exp_nonpositive(sc[t] - top));
    for (int t = 0; t < len; ++t) sc[t] /= total;
  }
  std::memset(out, 0, sizeof(float) * s.num_heads * dim);
  for (int t = 0; t < len; ++t) {
    const float* v = widen(row_of(v_cache, table, t, s), buf, width);
    for (int h = 0; h < s.num_heads; ++h) {
      const float p = scores[h * len + t], *vh = v + (h / group) * dim;
      float* o = out + h * dim;
#pragma omp simd
      for (int d = 0; d < dim; ++d) o[d] += p * vh[d];
    }
  }
}

template <typename T>
void decode(const float* q, const T* k_cache, const T* v_cache, float* out,
            const int32_t* block_tables, const int32_t* context_lens, int num_seqs,
            const Shape& s, int num_threads) {
  int max_len = 1;
  for (int i = 0; i < num_seqs; ++i) max_len = context_lens[i] > max_len ? context_lens[i] : max_len;
  const int width = s.num_kv_heads * s.head_dim;
#pragma omp parallel num_threads(num_threads)
  {
    float* scratch = static_cast<float*>(std::malloc(sizeof(float) * (s.num_heads * max_len + width)));
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < num_seqs; ++i) {
      const int64_t first = static_cast<int64_t>(i) * s.num_heads * s.head_dim;
      attend(q + first, k_cache, v_cache, block_tables + i * s.table_stride, context_lens[i], s,
             out + first, scratch + width, scratch);
    }
    std::free(scratch);
  }
}

}  // namespace

extern "C" void nanovllm_paged_decode(const float* q, const void* k_cache, const void* v_cache,
                                      float* out, const int32_t* block_tables,
                                      int64_t table_stride, const int32_t* context_lens,
                                      int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                      int block_size, float scale, int is_bf16, int num_threads) {
  const Shape s{num_heads, num_kv_heads, head_dim, block_size, table_stride, scale};
  if (is_bf16)
    decode(q, static_cast<const bf16*>(k_cache), static_cast<const bf16*>(v_cache), out,
           block_tables, context_lens, num_seqs, s, num_threads);
  else
    decode(q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), out,
           block_tables, context_lens, num_seqs, s, num_threads);
}
