// A token bitmask applied to logits on the CPU (nanovllm/kernels/cpu_bitmask.py):
//
//   logits [rows, vocab] float32 (row stride `stride`), bitmask [rows, words] int32 with
//   words = ceil(vocab / 32): bit t % 32 of word t / 32 set = token t allowed. For each row of
//   `indices`, every token whose bit is 0 becomes -inf; the other rows are not touched.
//
// A grammar's mask is mostly whole words of 0 (a JSON key, a number: a few tokens allowed) or
// of 1 (inside a string: nearly all allowed), so a word is looked at once: all 1 skipped, all 0
// filled, only a mixed one read bit by bit. Rows are split over the threads asked for.
#include <cstdint>

namespace {

constexpr float NEG_INF = -__builtin_inff();

void apply_row(float* x, int vocab, const uint32_t* mask) {
  const int words = (vocab + 31) / 32;
  for (int w = 0; w < words; ++w) {
    const uint32_t bits = mask[w];
    if (bits == 0xFFFFFFFFu) continue;
    float* chunk = x + w * 32;
    const int n = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
    if (bits == 0) {
      for (int t = 0; t < n; ++t) chunk[t] = NEG_INF;
      continue;
    }
    for (int t = 0; t < n; ++t)
      if (!((bits >> t) & 1u)) chunk[t] = NEG_INF;
  }
}

}  // namespace

extern "C" void nanovllm_apply_bitmask(float* logits, int vocab, int64_t stride,
                                       const int32_t* bitmask, int words, const int64_t* indices,
                                       int num_indices, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_indices > 8)
  for (int i = 0; i < num_indices; ++i) {
    const int64_t row = indices[i];
    apply_row(logits + row * stride, vocab, reinterpret_cast<const uint32_t*>(bitmask) + row * words);
  }
}
