// The CPU's unseeded draw from softmax(logits), fused (nanovllm/kernels/sampling_ops.py):
//
//   logits [rows, vocab] float32 (-inf: filtered out), u [rows] float64 in (0, 1] -> out [rows]
//   int64: the first token whose cumulative weight reaches u * the row's total weight,
//   weight_t = exp(logit_t - the row's max) (0 for -inf), every sum in float64.
//
// What torch's softmax, float64 cumsum and searchsorted compute, without writing a
// [rows, vocab] probability or CDF (float64: twice the logits' size): each row is read
// twice, and a float32 division is saved (u scales the unnormalized total). Per row:
//   1. the max of the logits;
//   2. the weights of each chunk of CHUNK tokens, written to a chunk-sized buffer (the exp
//      loop vectorizes), then summed in float64 (each token's weight its own step: a float32
//      sum over a real vocabulary would round a tiny one's to nothing);
//   3. the chunk where u * total falls, found from the chunk sums; that chunk's weights again,
//      added one at a time until they reach it.
// A weight-0 token is never drawn: its step adds nothing. Where the chunk's one-at-a-time
// sum ends a rounding short of the target (its chunk sum was added in another order), the
// chunk's last token of weight > 0 is drawn, the token the target is on up to that rounding.
// Rows are split over the threads asked for.
//
// And a greedy row's token (nanovllm_argmax): the index of its largest logit, the first of
// ties, a NaN counting as the largest (torch.argmax's answer, bit for bit), where torch's CPU
// argmax compares one element at a time (~0.8 ns each: 2 ms for 16 rows of a 151,936-token
// vocabulary). Per row, a vectorized max and NaN test over each chunk, then one scalar scan of
// the chunk that holds the answer.
#include <cstdint>

#include "cpu_exp.h"  // exp_nonpositive

namespace {

constexpr int CHUNK = 64;  // tokens a chunk: a short final scan, its buffer in L1
constexpr float NEG_INF = -__builtin_inff();

// w[0, n) = the weights of logits x[0, n) against the row's max `top`; their float64 sum.
inline double chunk_weights(const float* x, int n, float top, float* w) {
#pragma omp simd
  for (int t = 0; t < n; ++t)  // a product, not a select: GCC would not vectorize that
    w[t] = exp_nonpositive(x[t] - top) * static_cast<float>(x[t] != NEG_INF);
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < n; ++t) sum += w[t];
  return sum;
}

int64_t sample_row(const float* x, int vocab, double u, double* sums) {
  float top = x[0];
#pragma omp simd reduction(max : top)
  for (int t = 1; t < vocab; ++t) top = x[t] > top ? x[t] : top;
  const int chunks = (vocab + CHUNK - 1) / CHUNK;
  const auto size = [vocab](int c) { return vocab - c * CHUNK < CHUNK ? vocab - c * CHUNK : CHUNK; };
  float w[CHUNK];
  double total = 0;
  for (int c = 0; c < chunks; ++c) total += sums[c] = chunk_weights(x + c * CHUNK, size(c), top, w);
  const double target = u * total;  // > 0: u > 0, and the max's weight is 1
  double before = 0;                // the weight of the chunks before chunk c
  int c = 0;
  while (c + 1 < chunks && before + sums[c] < target) before += sums[c++];
  const int n = size(c);
  chunk_weights(x + c * CHUNK, n, top, w);
  int last = 0;  // the newest token of weight > 0 (the chunk has one: its sum reached target)
  for (int t = 0; t < n; ++t) {
    if (w[t] == 0.f) continue;
    last = t;
    before += w[t];
    if (before >= target) break;
  }
  return static_cast<int64_t>(c) * CHUNK + last;
}

// The first index of a row's largest value (of its first NaN, if it has one).
int64_t argmax_row(const float* x, int vocab) {
  float top = NEG_INF;
  int best = 0;  // the chunk that first reached `top`; an all -inf row: token 0
  for (int c = 0; c * CHUNK < vocab; ++c) {
    const float* chunk = x + c * CHUNK;
    const int n = vocab - c * CHUNK < CHUNK ? vocab - c * CHUNK : CHUNK;
    float chunk_top = NEG_INF;
    int nan = 0;  // an int's | (a bool's || would not vectorize)
#pragma omp simd reduction(max : chunk_top) reduction(| : nan)
    for (int t = 0; t < n; ++t) {
      chunk_top = chunk[t] > chunk_top ? chunk[t] : chunk_top;
      nan |= chunk[t] != chunk[t];
    }
    if (nan) {
      int t = 0;
      while (chunk[t] == chunk[t]) ++t;
      return static_cast<int64_t>(c) * CHUNK + t;
    }
    if (chunk_top > top) top = chunk_top, best = c;
  }
  const float* chunk = x + best * CHUNK;
  int t = 0;
  while (chunk[t] != top) ++t;  // within the chunk: it reached `top`
  return static_cast<int64_t>(best) * CHUNK + t;
}

}  // namespace

extern "C" void nanovllm_argmax(const float* logits, int rows, int vocab, int64_t* out,
                                int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
  for (int i = 0; i < rows; ++i) out[i] = argmax_row(logits + static_cast<int64_t>(i) * vocab, vocab);
}

extern "C" void nanovllm_sample(const float* logits, int rows, int vocab, const double* u,
                                int64_t* out, int num_threads) {
  const int chunks = (vocab + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(num_threads)
  {
    double* sums = new double[chunks];
#pragma omp for schedule(static)
    for (int i = 0; i < rows; ++i)
      out[i] = sample_row(logits + static_cast<int64_t>(i) * vocab, vocab, u[i], sums);
    delete[] sums;
  }
}
