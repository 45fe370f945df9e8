// LoRA's adapters on a CPU, each row under its own (nanovllm/kernels/cpu_lora.py): for each row
// i of slot s = slots[i] >= 0,
//
//   t = a[s] @ x[i]        a [slots, W, K]: every slice's A, stacked (W = slices x R)
//   y[i] += t @ b[s]       b [slots, W, N]: slice j's B transposed in its rows j*R .. (j+1)*R
//                          and columns slice_ends[j - 1] .. slice_ends[j], zeros elsewhere
//
// The expand streams along the outputs (y += t[w] * b[w, :], a vector FMA a step), each slice's
// outputs over its own R rows only (a fused q|k|v projection's is a third of the full width's).
// float32, every tensor's last dimension contiguous. One pass a row, rows split over the threads
// asked for: a decode step's few rows cost one call, where PyTorch's GEMMs per adapter cost a
// dozen small ops a layer. (A prefill chunk's many rows run PyTorch's GEMMs: see cpu_lora.py.)
#include <cstdint>

namespace {

constexpr int MAX_WIDTH = 1024;  // W at most (cpu_lora.py checks it): a row's t is on the stack

inline float dot(const float* u, const float* v, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < n; ++k) sum += u[k] * v[k];
  return sum;
}

}  // namespace

extern "C" void nanovllm_lora_bgmv(const float* x, int64_t x_stride, const float* a,
                                   const float* b, const int64_t* slots, float* y,
                                   int64_t y_stride, int64_t rows, int64_t K, int64_t W, int64_t N,
                                   const int64_t* slice_ends, int64_t num_slices,
                                   int num_threads) {
  const int64_t R = W / num_slices;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t s = slots[i];
    if (s < 0) continue;
    const float* as = a + s * W * K;
    const float* bs = b + s * W * N;
    const float* xi = x + i * x_stride;
    float t[MAX_WIDTH];
    for (int64_t w = 0; w < W; ++w) t[w] = dot(as + w * K, xi, K);
    float* yi = y + i * y_stride;
    for (int64_t j = 0, start = 0; j < num_slices; start = slice_ends[j++]) {
      for (int64_t w = j * R; w < (j + 1) * R; ++w) {
        const float tw = t[w];
        const float* bw = bs + w * N;
#pragma omp simd
        for (int64_t n = start; n < slice_ends[j]; ++n) yi[n] += tw * bw[n];
      }
    }
  }
}
