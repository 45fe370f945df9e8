// Int8 weight-only GEMM on a CPU (W8A16): y = x q^T * scale (+ bias), the activations float32 or
// bfloat16, the weights int8 with one float32 scale per output channel, all sums in float32.
// Plain C++ with a C entry point, no PyTorch headers, built like cpu_decode.cpp
// (nanovllm/kernels/cpu_int8.py).
//
//   x      [M, K] float32 | bfloat16, contiguous         y  [M, N] x's dtype, contiguous
//   packed [N_pad / 64, K, 64] int8: panels of 64 output channels, one 64-byte line a k
//   scale  [N] float32;  bias  [N] float32 or null;  N <= N_pad < N + 64 (padded rows are 0)
//
// A panel line holds the 64 channels' weights of one k, so a panel is one sequential stream
// and consecutive panels are too: at M = 1 the weights are read once, front to back.
//
// The work is GEMM's register tiling. A tile is MR rows of x by NV vectors of W channels:
// MR x NV accumulators in registers, over the whole of K. Each k, the tile's NV weight vectors
// are loaded and widened to float32 once (sign-extend, convert: 2 instructions a vector) and
// each meets the MR rows' x[m, k] (a broadcast folded into the FMA): NV * MR FMAs for 2 * NV
// conversions. So the conversion's share falls as MR grows: one weight row's bytes are
// turned into floats once per MR rows of x, never materialized in memory.
//   - few rows (M <= MR of the wide tile): a tile as wide as the panel (64 channels), as many
//     rows as M, so that at M = 1 the FMA chains are 64 / W long and a whole line is used;
//   - more rows: a narrow, tall tile (NV * MR FMAs against 2 * NV conversions), rows in tiles
//     of MR, the last tile shorter (each row count is its own instantiation).
// Before the tiles, x is packed (and widened from bfloat16) per tile of MR rows into
// [K][MR] float32: a tile's broadcasts are one contiguous stream (x is read M * N / 64 /
// NV_tiles times, the packing once). A lone float32 row is used as it is.
//
// Work items are (panel, row tile) pairs, panel-major, spread statically over the threads
// from GRAIN multiply-adds on: a thread keeps a panel in its L2 for all its row tiles.
// Vectors: AVX-512 (W = 16, 32 registers), AVX2 + FMA (W = 8, 16 registers) or the compiler's
// generic vectors (W = 4: SSE2, NEON), chosen at compile time by -march=native.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#define ALWAYS_INLINE inline __attribute__((always_inline))

using bf16 = uint16_t;
constexpr int BLOCK = 64;  // channels a panel: a cache line of int8 weights each k

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int WIDE_NV = 4, WIDE_MR = 6;  // 64 channels (4 vectors) x 6 rows: 24 accumulators + 4 weights
constexpr int TALL_NV = 2, TALL_MR = 14;  // 32 channels x 14 rows: 28 + 2 of 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
constexpr int WIDE_NV = 8, WIDE_MR = 1;  // 64 channels (8 vectors) x 1 row: 8 accumulators
constexpr int TALL_NV = 2, TALL_MR = 6;  // 16 channels x 6 rows: 12 + 2 + a broadcast of 16
#else
constexpr int W = 4;
constexpr int WIDE_NV = 8, WIDE_MR = 1;  // 32 channels: 8 of 16 registers
constexpr int TALL_NV = 2, TALL_MR = 6;
#endif

using vec = float __attribute__((vector_size(W * sizeof(float))));
using i8vec = int8_t __attribute__((vector_size(W)));
using i32vec = int32_t __attribute__((vector_size(W * sizeof(int32_t))));
using u32vec = uint32_t __attribute__((vector_size(W * sizeof(uint32_t))));
using u16vec = uint16_t __attribute__((vector_size(W * sizeof(uint16_t))));

// W int8 weights at p, as float32.
ALWAYS_INLINE vec widen_weights(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__) && defined(__FMA__)
  return reinterpret_cast<vec>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else  // through int32: GCC converts int8 to float one element at a time
  i8vec q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(__builtin_convertvector(q, i32vec), vec);
#endif
}

ALWAYS_INLINE vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// float32 -> bfloat16, to nearest-even (a NaN: the quiet NaN), as cpu_ops.cpp's narrow().
inline bf16 narrow(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  return x != x ? bf16{0x7fc0} : static_cast<bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
ALWAYS_INLINE void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
ALWAYS_INLINE void store(bf16* p, vec v) {
  const u32vec bits = reinterpret_cast<u32vec>(v);
  const u32vec rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32vec nan = reinterpret_cast<u32vec>(v != v);  // all ones where v is a NaN
  const u16vec out = __builtin_convertvector((rounded & ~nan) | (nan & 0x7fc0u), u16vec);
  std::memcpy(p, &out, sizeof out);
}
inline void store_one(float* p, float v) { *p = v; }
inline void store_one(bf16* p, float v) { *p = narrow(v); }

// Lines ahead of the one in use that are asked for, into L1 and into L2: at M = 1 the kernel
// works ~6 cycles a line, so that the hardware's prefetchers alone kept too few lines in
// flight (4096 x 1024 from DRAM, 1 thread: 8.2 GB/s, with these 13.1, what a bare read loop
// gets).
constexpr int PREFETCH_L1 = 16, PREFETCH_L2 = 128;

struct Problem {
  const int8_t* packed;
  const float *scale, *bias;  // bias may be null
  int64_t M, N, K;
};

// One tile: rows [MR] of x packed [K][MR] (xp) against channels [n0, n0 + NV * W) of a panel
// (w: the panel's first line plus the tile's offset in it); y rows are N apart.
template <typename T, int NV, int MR>
void tile(const Problem& p, const int8_t* __restrict w, const float* __restrict xp, int64_t n0,
          T* __restrict y) {
  vec acc[MR][NV];
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[m][v] = vec{};
  for (int64_t k = 0; k < p.K; ++k, w += BLOCK, xp += MR) {
    vec wv[NV];
    if constexpr (NV * W == BLOCK) {  // the stream of a few rows' tile
      __builtin_prefetch(w + PREFETCH_L1 * BLOCK);
      __builtin_prefetch(w + PREFETCH_L2 * BLOCK, 0, 2);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) wv[v] = widen_weights(w + v * W);
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) {
      const float xs = xp[m];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[m][v] += wv[v] * xs;
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const int64_t n = n0 + v * W;
    if (n >= p.N) break;
    if (n + W <= p.N) {
      const vec scale = load(p.scale + n), bias = p.bias ? load(p.bias + n) : vec{};
#pragma GCC unroll 32
      for (int m = 0; m < MR; ++m) store(y + m * p.N + n, acc[m][v] * scale + bias);
    } else {  // the last channels, fewer than W
      for (int m = 0; m < MR; ++m)
        for (int64_t i = 0; n + i < p.N; ++i)
          store_one(y + m * p.N + n + i,
                    acc[m][v][i] * p.scale[n + i] + (p.bias ? p.bias[n + i] : 0.f));
    }
  }
}

template <typename T, int NV>
using TileFn = void (*)(const Problem&, const int8_t*, const float*, int64_t, T*);

// tiles<T, NV>(MR)[r - 1]: the tile of r rows, r = 1..MR.
template <typename T, int NV, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  return std::array<TileFn<T, NV>, sizeof...(R)>{&tile<T, NV, R + 1>...};
}

// x rows [m0, m0 + rows) -> out [K][rows] float32.
template <typename T>
void pack_rows(const T* x, int64_t K, int64_t m0, int rows, float* out) {
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < rows; ++m) out[k * rows + m] = widen(x[(m0 + m) * K + k]);
}

// The packed x of the calling thread, kept between calls (no allocation a call).
thread_local std::vector<float> packed_x;

// The packed x of a chunk of row tiles, at most (one tile at least): it is read once for each
// panel, so it must stay in L2 (a 0.6B down_proj, [2048, 3072] x [1024, 3072]^T, 1 thread,
// AVX-512: 96 GFLOP/s with x whole (25 MB), 140-145 in chunks of 128 KB to 1 MB; Zen 2/3 have
// 512 KB of L2).
constexpr int64_t X_CHUNK_BYTES = 256 * 1024;

// Below this many multiply-adds a call runs on its own thread: a fork/join costs more.
constexpr int64_t GRAIN = int64_t{1} << 16;

template <typename T, int NV, int MR>
void gemm(const Problem& p, const T* x, T* y, int num_threads) {
  static constexpr auto tiles_of = tile_table<T, NV>(std::make_integer_sequence<int, MR>{});
  const int64_t row_tiles = (p.M + MR - 1) / MR, panels = (p.N + BLOCK - 1) / BLOCK;
  const bool packs = !(std::is_same_v<T, float> && p.M == 1);
  std::vector<float>& buffer = packed_x;
  if (packs && buffer.size() < static_cast<size_t>(p.M * p.K)) buffer.resize(p.M * p.K);
  const float* xp = packs ? buffer.data() : reinterpret_cast<const float*>(x);
  float* out = buffer.data();
  const bool parallel = p.M * p.N * p.K >= GRAIN && num_threads > 1;
  // Row tiles a chunk: its packed x (chunk * MR * K floats) stays in L2 while the panels go by.
  const int64_t chunk = std::max<int64_t>(1, X_CHUNK_BYTES / (4 * MR * std::max<int64_t>(p.K, 1)));
#pragma omp parallel if (parallel) num_threads(num_threads)
  {
    if (packs) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < row_tiles; ++t) {
        const int64_t m0 = t * MR;
        pack_rows(x, p.K, m0, static_cast<int>(std::min<int64_t>(MR, p.M - m0)), out + m0 * p.K);
      }
    }
    for (int64_t first = 0; first < row_tiles; first += chunk) {
      const int64_t tiles = std::min(chunk, row_tiles - first);
#pragma omp for schedule(static)
      for (int64_t job = 0; job < panels * tiles; ++job) {
        const int64_t panel = job / tiles, m0 = (first + job % tiles) * MR;
        const int rows = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
        const int8_t* w = p.packed + panel * p.K * BLOCK;
        for (int c = 0; c < BLOCK && panel * BLOCK + c < p.N; c += NV * W)
          tiles_of[rows - 1](p, w + c, xp + m0 * p.K, panel * BLOCK + c, y + m0 * p.N);
      }
    }
  }
}

template <typename T>
void linear(const Problem& p, const void* x, void* y, int num_threads) {
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(y);
  if (p.M <= WIDE_MR)
    gemm<T, WIDE_NV, WIDE_MR>(p, in, out, num_threads);
  else
    gemm<T, TALL_NV, TALL_MR>(p, in, out, num_threads);
}

}  // namespace

extern "C" int nanovllm_int8_block() { return BLOCK; }
extern "C" int nanovllm_int8_vector_width() { return W; }

extern "C" void nanovllm_int8_linear(const void* x, int is_bf16, const int8_t* packed,
                                     const float* scale, const float* bias, void* y, int64_t M,
                                     int64_t N, int64_t K, int num_threads) {
  const Problem p{packed, scale, bias, M, N, K};
  if (is_bf16)
    linear<bf16>(p, x, y, num_threads);
  else
    linear<float>(p, x, y, num_threads);
}
