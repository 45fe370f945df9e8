// Int8 weight-only GEMM on a CPU (W8A16): y = x q^T * scale (+ bias), the activations float32 or
// bfloat16, the weights int8 with one float32 scale per output channel.
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
// Three ways to multiply, chosen at compile time by -march=native, each reading that layout:
//   - VNNI (AVX-512 with VNNI: AMD Zen 4 on, Intel Ice Lake on), from 16 inputs on: each row of x
//     is written per block of 256 inputs in 24-bit fixed point, as three signed bytes, and
//     vpdpbusd multiplies the weights by each digit; the integer sums are exact, turned to float32
//     once a block (the VNNI section below: the arithmetic, its bounds, its accuracy);
//   - FMA tiles elsewhere (AVX2, AVX-512 without VNNI, generic vectors) and for K < 16: weights
//     widened to float32 in registers, float32 sums (below);
//   - AMX (Sapphire Rapids on) from a few rows: weights widened to bfloat16 tiles, x split into
//     bfloat16 parts, products exact, float32 sums (the AMX section).
//
// The FMA path is GEMM's register tiling. A tile is MR rows of x by NV vectors of W channels:
// MR x NV accumulators in registers, over the whole of K. Each k, the tile's NV weight vectors
// are loaded and widened to float32 once (sign-extend, convert: 2 instructions a vector) and
// each meets the MR rows' x[m, k] (a broadcast folded into the FMA): NV * MR FMAs for 2 * NV
// conversions. So the conversion's share falls as MR grows: one weight row's bytes are
// turned into floats once per MR rows of x, never materialized in memory.
//   - few rows (M <= MR of the wide tile): a tile as wide as the panel (64 channels), as many
//     rows as M, so that at M = 1 the FMA chains are 64 / W long and a whole line is used;
//   - more rows: a narrow, tall tile (NV * MR FMAs against 2 * NV conversions), rows in tiles
//     of MR, the last tile shorter (each row count is its own instantiation).
// Before its tiles run, a chunk of x's rows is packed (and widened from bfloat16) per tile of
// MR rows into [K][MR] float32: a tile's broadcasts are one contiguous stream (x is read
// N / (NV * W) times, the packing once). A lone float32 row is used as it is.
//
// Work items are (panel, row tile) pairs, panel-major, spread statically over the threads
// from GRAIN multiply-adds on: a thread keeps a panel in its L2 for all its row tiles; the
// rows go in chunks whose packed x stays in L2.
// Vectors: AVX-512 (W = 16, 32 registers), AVX2 + FMA (W = 8, 16 registers) or the compiler's
// generic vectors (W = 4: SSE2, NEON). AVX2 keeps the FMA tiles even with AVX-VNNI (Intel Alder
// Lake on, AMD Zen 5): its 256-bit vpdpbusd would serve the VNNI path's arithmetic, not written
// yet; without it, vpmaddubsw's int16 pair sums would saturate on the flipped weights.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_fixed_point.h"  // x's digits, as cpu_int4.cpp's
#include "cpu_parallel.h"     // parallel_for

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define NANOVLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define NANOVLLM_AMX 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define NANOVLLM_INT8_VNNI 1
#else
#define NANOVLLM_INT8_VNNI 0
#endif

namespace {

#define ALWAYS_INLINE inline __attribute__((always_inline))

using bf16 = uint16_t;
constexpr int BLOCK = 64;  // channels a panel: a cache line of int8 weights each k

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int WIDE_NV = 4, WIDE_MR = 6;  // 64 channels (4 vectors) x 6 rows: 24 + 4 of 32 registers
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
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
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

#if NANOVLLM_AMX
// From this many rows of x on, the AMX path (below) beat the FMA tiles (0.6B's and cpu-small's
// layers, 1 thread): bfloat16 x from 6 rows (at 4 0.79-0.87x, at 8 1.3-1.5x), float32 x, in
// three parts, from 12 (at 8 0.75-0.92x, at 14 0.9-1.4x).
template <typename T>
constexpr int64_t amx_min_rows() { return std::is_same_v<T, float> ? 12 : 6; }
#endif

// 64-byte aligned storage (AMX's tile stores, whole cache lines).
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const AlignedAllocator&) const { return true; }
  bool operator!=(const AlignedAllocator&) const { return false; }
};

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

// The packed x of a chunk of row tiles, at most (one tile at least): it is read once for each
// panel, so it must stay in L2 (a 0.6B down_proj, [2048, 3072] x [1024, 3072]^T, 1 thread,
// AVX-512: 96 GFLOP/s with x whole (25 MB), 140-145 in chunks of 128 KB to 1 MB; Zen 2/3 have
// 512 KB of L2). x is packed a chunk at a time, into two buffers by turns: the threads pack
// chunk c + 1 while the last of them may still read chunk c, and the barrier after a packing
// means that chunk c - 1's buffer is free by then; so a call's packed x is two chunks at most,
// whatever its rows (a prefill's too), and one barrier a chunk.
constexpr int64_t X_CHUNK_BYTES = 256 * 1024;

// The calling thread's buffers of packed x, kept between calls (no allocation a call).
thread_local std::vector<float> packed_x;

// Below this many multiply-adds a call runs on its own thread: a fork/join costs more.
constexpr int64_t GRAIN = int64_t{1} << 16;

template <typename T, int NV, int MR>
void gemm(const Problem& p, const T* x, T* y, int num_threads) {
  static constexpr auto tiles_of = tile_table<T, NV>(std::make_integer_sequence<int, MR>{});
  const int64_t row_tiles = (p.M + MR - 1) / MR, panels = (p.N + BLOCK - 1) / BLOCK;
  const int64_t chunk = std::max<int64_t>(1, X_CHUNK_BYTES / (4 * MR * std::max<int64_t>(p.K, 1)));
  const int64_t chunk_floats = std::min(chunk, row_tiles) * MR * p.K;
  const bool packs = !(std::is_same_v<T, float> && p.M == 1);  // a lone float32 row is [K][1]
  if (packs && packed_x.size() < static_cast<size_t>(2 * chunk_floats))
    packed_x.resize(2 * chunk_floats);
  float* buffers = packed_x.data();
#pragma omp parallel if (p.M * p.N * p.K >= GRAIN && num_threads > 1) num_threads(num_threads)
  for (int64_t first = 0; first < row_tiles; first += chunk) {
    const int64_t tiles = std::min(chunk, row_tiles - first);
    const float* xp = reinterpret_cast<const float*>(x);  // the chunk's [tiles][K][MR]
    if (packs) {
      float* out = buffers + (first / chunk % 2) * chunk_floats;
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = (first + t) * MR;
        const int rows = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
        pack_rows(x, p.K, m0, rows, out + t * MR * p.K);
      }
      xp = out;
    }
#pragma omp for schedule(static) nowait  // a chunk writes its own rows of y
    for (int64_t job = 0; job < panels * tiles; ++job) {
      const int64_t panel = job / tiles, t = job % tiles, m0 = (first + t) * MR;
      const int rows = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
      const int8_t* w = p.packed + panel * p.K * BLOCK;
      for (int c = 0; c < BLOCK && panel * BLOCK + c < p.N; c += NV * W)
        tiles_of[rows - 1](p, w + c, xp + t * MR * p.K, panel * BLOCK + c, y + m0 * p.N);
    }
  }
}

#if NANOVLLM_INT8_VNNI
// ---- VNNI: x in 24-bit fixed point, the weights' products summed exactly in int32 -------------
// Each row of x is written per block of X_BLOCK input channels in fixed point with the block's
// own power-of-two step, X = round(x / step), |X| <= X_MAX, as three signed bytes (digits)
// X = c0 + 2^8 c1 + 2^16 c2 (as cpu_int4.cpp does). vpdpbusd adds to each 32-bit lane the 4
// products of an unsigned byte and a signed one; the digits are signed and so are the weights,
// so the weights are flipped to u = q + 128 (an XOR with 0x80: 0..255) and a block's sums
//
//   D_i = sum_k u_k c_ik = S_i + 128 C_i,    S_i = sum_k q_k c_ik,  C_i = sum_k c_ik
//
// have 128 C_i (of x alone, counted with the digits) taken off. |D_i| <= 255 128 X_BLOCK and
// |S_i| <= 128 128 X_BLOCK = 2^22: exact in int32, and S_i exact in float32 (< 2^24). Then, per
// block and in float32 (the products by step, a power of two, exact):
//
//   d = (S2 2^8 + S1) (2^8 step) + S0 step;   total += d;   y = total scale + bias
//
// S2 2^8 + S1 rounded once (an FMA), d once more, the total once a block, y once (an FMA). So
// against float32 arithmetic x is rounded to 23 bits below its block's largest |x| (at most
// 2^-23 max |x_block| / 0.996 an element, 2^-124 at the least), the products and their sums
// are exact, and a block adds 3 roundings, the end 1 (and bfloat16's, storing a bfloat16 y).
// A row's result does not depend on the other rows, the tile or the thread. A row holding an
// inf or a NaN goes through the FMA tile instead (the fixed point has neither).
//
// The panel's lines hold one k each; vpdpbusd wants 4 k of a channel in a lane. Four lines are
// transposed in registers (two rounds of byte and word unpacks, 2 instructions a vector, shared
// by the tile's rows), so the packed layout is the FMA and AMX paths' own: the AMX section reads
// what it read before. The unpacks work within 128-bit lanes: vector v (of 4) holds channel
// 16 l + 4 v + i in lane 4 l + i; the totals stay in that order until they are stored.
// Per 64 weights of a row, 3 dot products, against 4 FMAs on the FMA path; shared by the
// tile's rows, a load, 2 unpacks and a flip, against 8 widening instructions. At M = 1, 1 thread,
// AMD EPYC Zen 4, weights in L2/L3: cpu-small's layers 2.2-3.2x faster than the FMA tile (its
// LM head, 4096 x 256, 58 -> 18 us; ~60 GB/s of int8, the dot products' rate), 0.6B's qkv
// 4096 x 1024 204 -> 69 us; from 2 to 64 rows 1.3-1.45x faster than the FMA tiles. So it runs
// at every row count below the AMX path's. With the weights read from DRAM (0.6B's layers, the
// machine's other core busy) both paths read at the memory's rate, 17-23 GB/s.
constexpr int X_BLOCK = 256;  // input channels a block of x's fixed point (a multiple of 4)
// From this many inputs on: below, x's rounding (up to 2^-23 of the block's largest |x|) is a
// large share of the float32 sum's own error, K + 2 roundings of at most 2^-24 (at K = 1 twice
// a float32 product's: tests/kernels/test_cpu_int8.py holds every path to the float32 bound),
// and there are few products to gain on.
constexpr int VNNI_MIN_K = 16;

// x in fixed point, for the VNNI tiles.
struct Digits {
  std::vector<int8_t> digits;   // [blocks][M][3][X_BLOCK]: a block's rows side by side
  std::vector<int32_t> offset;  // [M][blocks][3]: 128 C_i, what the flipped weights add
  std::vector<float> step;      // [M][blocks]
  std::vector<uint8_t> finite;  // [M]: 0 where the row holds an inf or a NaN
  int64_t blocks = 0;
};

// The calling thread's, kept between calls (no allocation a call once grown).
thread_local Digits x_digits;

// Row `x` [K] -> its digits (block j's [3][X_BLOCK] at digits + j * stride, zeros past K),
// offsets and steps; false if it holds an inf or a NaN.
template <typename T>
bool to_digits(const T* x, int64_t K, int8_t* digits, int64_t stride, int32_t* offset,
               float* step) {
  for (int64_t k0 = 0, j = 0; k0 < K; k0 += X_BLOCK, ++j) {
    const int64_t n = std::min<int64_t>(X_BLOCK, K - k0);
    const auto as_float = [](T v) { return widen(v); };
    const uint32_t top = fixed_point::largest_magnitude_bits(x + k0, n, as_float);
    if (top >= fixed_point::NONFINITE_BITS) return false;
    const float scale = fixed_point::block_scale(__builtin_bit_cast(float, top));
    int8_t* out = digits + j * stride;
    int32_t sums[3] = {};
    for (int64_t i = 0; i < n; ++i) {
      int8_t c0, c1, c2;
      fixed_point::split(fixed_point::to_fixed(widen(x[k0 + i]), scale), c0, c1, c2);
      out[i] = c0, out[X_BLOCK + i] = c1, out[2 * X_BLOCK + i] = c2;
      sums[0] += c0, sums[1] += c1, sums[2] += c2;
    }
    for (int i = 0; i < 3; ++i) {
      std::memset(out + i * X_BLOCK + n, 0, X_BLOCK - n);
      offset[3 * j + i] = 128 * sums[i];
    }
    step[j] = 1.f / scale;
  }
  return true;
}

template <typename T>
void prepare_digits(const Problem& p, const T* x, int num_threads) {
  Digits& d = x_digits;
  d.blocks = (p.K + X_BLOCK - 1) / X_BLOCK;
  if (d.digits.size() < static_cast<size_t>(3 * p.M * d.blocks * X_BLOCK))
    d.digits.resize(3 * p.M * d.blocks * X_BLOCK);
  if (d.step.size() < static_cast<size_t>(p.M * d.blocks)) {
    d.step.resize(p.M * d.blocks);
    d.offset.resize(3 * p.M * d.blocks);
  }
  if (d.finite.size() < static_cast<size_t>(p.M)) d.finite.resize(p.M);
  parallel_for(p.M, p.M * p.K >= GRAIN, num_threads, [&](int64_t m) {
    d.finite[m] = to_digits(x + m * p.K, p.K, d.digits.data() + 3 * m * X_BLOCK,
                            3 * p.M * X_BLOCK, d.offset.data() + 3 * m * d.blocks,
                            d.step.data() + m * d.blocks);
  });
}

// Lines k .. k + 3 at w -> the 4 vectors of 16 channels x 4 k (in the lanes' order above),
// flipped to unsigned: bytes interleaved (lines 0 with 1, 2 with 3), then their pairs.
ALWAYS_INLINE void unsigned_quads(const int8_t* w, __m512i (&u)[4]) {
  const __m512i l0 = _mm512_loadu_si512(w), l1 = _mm512_loadu_si512(w + BLOCK);
  const __m512i l2 = _mm512_loadu_si512(w + 2 * BLOCK), l3 = _mm512_loadu_si512(w + 3 * BLOCK);
  const __m512i flip = _mm512_set1_epi8(-128);
  const __m512i a = _mm512_unpacklo_epi8(l0, l1), b = _mm512_unpacklo_epi8(l2, l3);
  const __m512i c = _mm512_unpackhi_epi8(l0, l1), d = _mm512_unpackhi_epi8(l2, l3);
  u[0] = _mm512_xor_si512(_mm512_unpacklo_epi16(a, b), flip);
  u[1] = _mm512_xor_si512(_mm512_unpackhi_epi16(a, b), flip);
  u[2] = _mm512_xor_si512(_mm512_unpacklo_epi16(c, d), flip);
  u[3] = _mm512_xor_si512(_mm512_unpackhi_epi16(c, d), flip);
}

// acc += the products of u's unsigned bytes with x's signed ones, 4 to a 32-bit lane. In asm:
// GCC 12 copied the intrinsic's accumulators to other registers and back, or to the stack
// (0.6B's qkv at 2 rows 263 us a call against 123).
ALWAYS_INLINE void dpbusd(__m512i& acc, __m512i u, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x));
}

// sums[i][m][v] += the products of lines k .. k + 3 at w with digit i of row m's k .. k + 3
// (rows: the tile's rows of a block's digits, [MR][3][X_BLOCK]).
template <int MR>
ALWAYS_INLINE void dot_quad(__m512i (&sums)[3][MR][4], const int8_t* w, const int8_t* rows,
                            int64_t k) {
  __m512i u[4];
  unsigned_quads(w, u);
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int i = 0; i < 3; ++i) {
      int32_t x4;
      std::memcpy(&x4, rows + (3 * m + i) * X_BLOCK + k, 4);
      const __m512i x = _mm512_set1_epi32(x4);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) dpbusd(sums[i][m][v], u[v], x);
    }
}

// One tile: rows [m0, m0 + MR) of x against a panel (at w), block by block; each block's d is
// added to totals [MR][64] (the panel's channels in the lanes' order). No prefetches: the FMA
// tile's (16 and 128 lines ahead) slowed it, 4-8% with the weights in L3 (a decode step of
// cpu-small's GEMMs, 74 -> 72 us) and 5-15% from DRAM (0.6B's layers: 17-19 GB/s -> 19-23,
// the hardware's prefetchers alone; the machine's other core busy).
template <int MR>
void vnni_tile(const Problem& p, const Digits& xd, const int8_t* __restrict w, int64_t m0,
               float* __restrict totals) {
  for (int64_t j = 0; j < xd.blocks; ++j, w += X_BLOCK * BLOCK) {
    const int64_t n = std::min<int64_t>(X_BLOCK, p.K - j * X_BLOCK);
    const int8_t* rows = xd.digits.data() + (j * p.M + m0) * 3 * X_BLOCK;
    __m512i sums[3][MR][4];
#pragma GCC unroll 3
    for (int i = 0; i < 3; ++i)
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) sums[i][m][v] = _mm512_setzero_si512();
    alignas(64) int8_t tail[4 * BLOCK] = {};
    for (int64_t k = 0; k < n; k += 4) {
      const int8_t* lines = w + k * BLOCK;
      if (k + 4 > n) {  // K's last 1-3 lines, then zeros (their digits are 0): none read past K
        std::memcpy(tail, lines, (n - k) * BLOCK);
        lines = tail;
      }
      dot_quad<MR>(sums, lines, rows, k);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const int32_t* offset = xd.offset.data() + ((m0 + m) * xd.blocks + j) * 3;
      const float step = xd.step[(m0 + m) * xd.blocks + j];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m512 s[3];
        for (int i = 0; i < 3; ++i)  // S_i: exact in int32, then in float32 (|S_i| <= 2^22)
          s[i] = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[i][m][v], _mm512_set1_epi32(offset[i])));
        const __m512 upper = _mm512_fmadd_ps(s[2], _mm512_set1_ps(256.f), s[1]);
        const __m512 d = _mm512_fmadd_ps(upper, _mm512_set1_ps(256.f * step),
                                         _mm512_mul_ps(s[0], _mm512_set1_ps(step)));
        float* total = totals + m * BLOCK + v * W;
        _mm512_store_ps(total, _mm512_add_ps(_mm512_load_ps(total), d));
      }
    }
  }
}

using VnniTileFn = void (*)(const Problem&, const Digits&, const int8_t*, int64_t, float*);

// vnni_tiles(MR)[r - 1]: the tile of r rows, r = 1..MR.
template <int... R>
constexpr auto vnni_tiles(std::integer_sequence<int, R...>) {
  return std::array<VnniTileFn, sizeof...(R)>{&vnni_tile<R + 1>...};
}

// A row tile's totals [rows][64], in the lanes' order -> rows [m0, m0 + rows) of y, channels
// [n0, n0 + 64) but not past N, scaled, plus the bias. Vector v's 128-bit part l holds channels
// 16 l + 4 v .. + 3: a 4 x 4 transpose of 128-bit parts puts them in order.
template <typename T>
void vnni_store(const Problem& p, const float* totals, int64_t m0, int rows, int64_t n0, T* y) {
  for (int m = 0; m < rows; ++m) {
    const float* t = totals + m * BLOCK;
    const __m512 t0 = _mm512_load_ps(t), t1 = _mm512_load_ps(t + 16);
    const __m512 t2 = _mm512_load_ps(t + 32), t3 = _mm512_load_ps(t + 48);
    const __m512 a = _mm512_shuffle_f32x4(t0, t1, 0x44), b = _mm512_shuffle_f32x4(t2, t3, 0x44);
    const __m512 c = _mm512_shuffle_f32x4(t0, t1, 0xEE), d = _mm512_shuffle_f32x4(t2, t3, 0xEE);
    const __m512 ordered[4] = {_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD),
                               _mm512_shuffle_f32x4(c, d, 0x88), _mm512_shuffle_f32x4(c, d, 0xDD)};
    T* out = y + (m0 + m) * p.N;
    for (int v = 0; v < 4; ++v) {
      const int64_t n = n0 + v * W;
      if (n >= p.N) break;
      const vec total = reinterpret_cast<vec>(ordered[v]);
      if (n + W <= p.N) {
        store(out + n, total * load(p.scale + n) + (p.bias ? load(p.bias + n) : vec{}));
      } else {  // the last channels, fewer than W
        for (int64_t i = 0; n + i < p.N; ++i)
          store_one(out + n + i, total[i] * p.scale[n + i] + (p.bias ? p.bias[n + i] : 0.f));
      }
    }
  }
}

// Work items are (row chunk, panel, row tile) triples, in that order, spread statically over the
// threads: a chunk's digits stay in L2 while its rows meet every panel (as the FMA path's packed
// x), and a thread keeps a panel in its L2 for its row tiles of the chunk. A tile of two rows
// against the whole panel (24 sums in registers) ran ~1.1x faster a row than one row alone, as
// fast as 3 rows against half of it (0.6B's layers, 1 thread).
template <typename T>
void vnni_gemm(const Problem& p, T* y, int num_threads) {
  constexpr int MR = 2;
  static constexpr auto tiles_of = vnni_tiles(std::make_integer_sequence<int, MR>{});
  const int64_t row_tiles = (p.M + MR - 1) / MR, panels = (p.N + BLOCK - 1) / BLOCK;
  const int64_t chunk = std::max<int64_t>(1, X_CHUNK_BYTES / (3 * MR * p.K));  // row tiles
  const int64_t chunk_jobs = panels * chunk;
  const Digits& xd = x_digits;
  const int64_t jobs = panels * row_tiles;
  parallel_for(jobs, p.M * p.N * p.K >= GRAIN, num_threads, [&](int64_t job) {
    const int64_t first = job / chunk_jobs * chunk, tiles = std::min(chunk, row_tiles - first);
    const int64_t panel = job % chunk_jobs / tiles, m0 = (first + job % chunk_jobs % tiles) * MR;
    const int rows = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
    alignas(64) float totals[MR * BLOCK] = {};
    tiles_of[rows - 1](p, xd, p.packed + panel * p.K * BLOCK, m0, totals);
    vnni_store(p, totals, m0, rows, panel * BLOCK, y);
  });
}

template <typename T>
void vnni_linear(const Problem& p, const T* x, T* y, int num_threads) {
  prepare_digits(p, x, num_threads);
  vnni_gemm(p, y, num_threads);
  // A row holding an inf or a NaN: the FMA tile's float32 sums, whose infs and NaNs are those of
  // x @ w^T (the fixed point has none).
  for (int64_t m = 0; m < p.M; ++m)
    if (!x_digits.finite[m]) {
      const Problem row{p.packed, p.scale, p.bias, 1, p.N, p.K};
      gemm<T, WIDE_NV, WIDE_MR>(row, x + m * p.K, y + m * p.N, num_threads);
    }
}
#endif  // NANOVLLM_INT8_VNNI

#if NANOVLLM_AMX
// ---- AMX: the weights widened to bfloat16 tiles, x split into bfloat16 parts -------------------
// A tile is 16 rows of 64 bytes. tdpbf16ps adds A (16 rows x 32 bfloat16 of x) times B (32 k x 16
// channels of weights, the k in pairs: row i holds each channel's (k 2i, k 2i + 1)) to C (16 x 16
// float32), each product exact and added in float32 (what an FMA does, denormals flushed).
// Weights: q fits bfloat16 exactly. x: a bfloat16 x is one part; a float32 one is split into
// three, hi + mid + lo == x exactly (each rounded off the rest: 8 + 8 + 8 of its 24 bits), and
// the three parts' products go into the same C (3 K float32 additions, not K).
//
// x's parts are written a chunk of row blocks (16 rows each) at a time, [parts][rows padded
// to 16][K padded to 32], into two buffers by turns (as the FMA path's packed x); a chunk's
// parts stay in L2. For a chunk, each panel in turn is widened into B tiles a slice of K at a
// time (a thread's scratch, [8 k tiles][4][16 x 32] bfloat16: 32 KB, in L1), and every block
// of the chunk runs over the slice: C tiles 0-3 hold the block's 16 x 64 sums, kept in a
// thread's scratch between slices. Each widened weight serves the chunk's rows.
// Measured against the FMA tiles, 1 thread, 0.6B's layers: bfloat16 x 2.1-2.4x faster at 16
// rows, 3.8-5.5x at 64-256; float32 x 1.3-2.0x at 16, 2.0-2.8x at 64-256.

constexpr int AMX_ROWS = 16, AMX_K = 32, AMX_TILE = AMX_ROWS * AMX_K;  // bfloat16 a tile
constexpr int64_t AMX_CHUNK_BYTES = 1024 * 1024;  // the x parts of a chunk (AMX CPUs: 2 MB L2)
constexpr int64_t SLICE = 8;  // k tiles of a panel widened at a time: 4 x 8 x 1 KB, in L1

// Linux lets a process use the tile registers once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); if it refuses, the FMA path runs.
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_a_row[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_a_row[t] = 64, config.rows[t] = AMX_ROWS;
  _tile_loadconfig(&config);
}

// rows [m0, m0 + rows) of x -> `parts` [PARTS][rows_pad][k_pad] bfloat16 (part stride
// part_size), zeros past K and past the last row.
template <typename T, int PARTS>
void split_rows(const T* x, int64_t K, int64_t k_pad, int64_t m0, int64_t rows, int64_t rows_pad,
                bf16* parts, int64_t part_size) {
  for (int64_t m = 0; m < rows_pad; ++m) {
    bf16* out = parts + m * k_pad;
    if (m >= rows) {
      for (int part = 0; part < PARTS; ++part) std::memset(out + part * part_size, 0, 2 * k_pad);
      continue;
    }
    const T* row = x + (m0 + m) * K;
    for (int64_t k = 0; k < k_pad; ++k) {
      float rest = k < K ? widen(row[k]) : 0.f;
      for (int part = 0; part < PARTS; ++part) {
        const bf16 b = narrow(rest);
        out[part * part_size + k] = b;
        rest -= widen(b);  // exact: the bits that b did not take
      }
    }
  }
}

// A panel [K][64] int8 -> B tiles [k_tiles][4][16 rows][32] bfloat16: tile (t, j) row i holds
// channels 16 j .. 16 j + 15, each as the pair (k, k + 1), k = 32 t + 2 i (0 past K).
// bfloat16(q) is the top half of float32(q): q has at most 8 significant bits.
void widen_panel(const int8_t* panel, int64_t K, int64_t first_tile, int64_t k_tiles,
                 bf16* tiles) {
  auto bits = [&](int64_t k, int j) {  // float32(q) of k's channels 16 j .., as integers
    return k < K ? _mm512_castps_si512(widen_weights(panel + k * BLOCK + 16 * j))
                 : _mm512_setzero_si512();
  };
  for (int64_t t = 0; t < k_tiles; ++t)
    for (int i = 0; i < AMX_ROWS; ++i) {
      const int64_t k = (first_tile + t) * AMX_K + 2 * i;
      for (int j = 0; j < 4; ++j) {  // each 32-bit lane: k + 1's top half over k's
        const __m512i pairs =
            _mm512_mask_blend_epi16(0x55555555, bits(k + 1, j), _mm512_srli_epi32(bits(k, j), 16));
        _mm512_store_si512(tiles + ((t * 4 + j) * AMX_ROWS + i) * AMX_K, pairs);
      }
    }
}

// C tiles 0-3 (a block's 16 rows x 64 channels) += its x parts against k_tiles B tiles.
template <int PARTS>
ALWAYS_INLINE void amx_block(const bf16* parts, int64_t part_size, int64_t k_pad,
                             const bf16* tiles, int64_t k_tiles) {
  const int64_t stride = 2 * k_pad;  // bytes between rows of x
  for (int64_t t = 0; t < k_tiles; ++t, parts += AMX_K, tiles += 4 * AMX_TILE) {
    if constexpr (PARTS == 1) {  // B in three registers in turn
      _tile_loadd(4, parts, stride);
      _tile_loadd(5, tiles, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, tiles + AMX_TILE, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, tiles + 2 * AMX_TILE, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, tiles + 3 * AMX_TILE, 64);
      _tile_dpbf16ps(3, 4, 5);
    } else {  // three parts in 4-6, B in 7
      _tile_loadd(4, parts, stride);
      _tile_loadd(5, parts + part_size, stride);
      _tile_loadd(6, parts + 2 * part_size, stride);
      _tile_loadd(7, tiles, 64);
      _tile_dpbf16ps(0, 4, 7);
      _tile_dpbf16ps(0, 5, 7);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(7, tiles + AMX_TILE, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(1, 5, 7);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(7, tiles + 2 * AMX_TILE, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(2, 5, 7);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(7, tiles + 3 * AMX_TILE, 64);
      _tile_dpbf16ps(3, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
      _tile_dpbf16ps(3, 6, 7);
    }
  }
}

// C tiles 0-3 <-> a block's 16 x 64 float32 partial sums (rows 256 bytes apart).
ALWAYS_INLINE void load_c(const float* c) {
  _tile_loadd(0, c, 4 * BLOCK);
  _tile_loadd(1, c + 16, 4 * BLOCK);
  _tile_loadd(2, c + 32, 4 * BLOCK);
  _tile_loadd(3, c + 48, 4 * BLOCK);
}
ALWAYS_INLINE void store_c(float* c) {
  _tile_stored(0, c, 4 * BLOCK);
  _tile_stored(1, c + 16, 4 * BLOCK);
  _tile_stored(2, c + 32, 4 * BLOCK);
  _tile_stored(3, c + 48, 4 * BLOCK);
}

// A block's sums c [16][64] -> rows [m0, m0 + rows) of y, channels [n0, n0 + 64), scaled.
template <typename T>
void amx_store(const Problem& p, const float* c, int64_t m0, int rows, int64_t n0, T* y) {
  if (n0 + BLOCK > p.N) {  // the last channels: one at a time
    for (int m = 0; m < rows; ++m)
      for (int64_t n = n0; n < p.N; ++n)
        store_one(y + (m0 + m) * p.N + n,
                  c[m * BLOCK + n - n0] * p.scale[n] + (p.bias ? p.bias[n] : 0.f));
    return;
  }
  vec scale[BLOCK / W], bias[BLOCK / W];
  for (int v = 0; v < BLOCK / W; ++v)
    scale[v] = load(p.scale + n0 + v * W), bias[v] = p.bias ? load(p.bias + n0 + v * W) : vec{};
  for (int m = 0; m < rows; ++m)
    for (int v = 0; v < BLOCK / W; ++v)
      store(y + (m0 + m) * p.N + n0 + v * W, load(c + m * BLOCK + v * W) * scale[v] + bias[v]);
}

// The x parts of the calling thread; each thread's B tiles and partial sums. Kept between calls.
thread_local std::vector<bf16, AlignedAllocator<bf16>> x_parts, b_tiles;
thread_local std::vector<float, AlignedAllocator<float>> c_sums;

template <typename T, int PARTS>
void amx_gemm(const Problem& p, const T* x, T* y, int num_threads) {
  const int64_t k_tiles = (p.K + AMX_K - 1) / AMX_K, k_pad = k_tiles * AMX_K;
  const int64_t blocks = (p.M + AMX_ROWS - 1) / AMX_ROWS, panels = (p.N + BLOCK - 1) / BLOCK;
  // Blocks a chunk; its parts [PARTS][blocks of the chunk][16][k_pad], in two buffers by turns
  // (as the FMA path's packed x).
  const int64_t chunk = std::max<int64_t>(1, AMX_CHUNK_BYTES / (2 * PARTS * AMX_ROWS * k_pad));
  const int64_t part_size = std::min(chunk, blocks) * AMX_ROWS * k_pad;
  if (x_parts.size() < static_cast<size_t>(2 * PARTS * part_size))
    x_parts.resize(2 * PARTS * part_size);
  bf16* buffers = x_parts.data();
#pragma omp parallel if (p.M * p.N * p.K >= GRAIN && num_threads > 1) num_threads(num_threads)
  {
    configure_tiles();
    if (b_tiles.size() < static_cast<size_t>(SLICE * 4 * AMX_TILE))
      b_tiles.resize(SLICE * 4 * AMX_TILE);
    if (c_sums.size() < static_cast<size_t>(part_size / k_pad * BLOCK))
      c_sums.resize(part_size / k_pad * BLOCK);
    bf16* tiles = b_tiles.data();
    float* c = c_sums.data();  // [blocks of the chunk][16][64] sums between slices
    for (int64_t first = 0; first < blocks; first += chunk) {
      const int64_t count = std::min(chunk, blocks - first);
      bf16* parts = buffers + (first / chunk % 2) * PARTS * part_size;
#pragma omp for schedule(static)
      for (int64_t b = 0; b < count; ++b) {
        const int64_t m0 = (first + b) * AMX_ROWS;
        split_rows<T, PARTS>(x, p.K, k_pad, m0, std::min<int64_t>(AMX_ROWS, p.M - m0), AMX_ROWS,
                             parts + b * AMX_ROWS * k_pad, part_size);
      }
#pragma omp for schedule(static) nowait  // a chunk writes its own rows of y
      for (int64_t panel = 0; panel < panels; ++panel) {
        for (int64_t t = 0; t < k_tiles; t += SLICE) {  // B tiles of a slice of K, in L1
          const int64_t n = std::min<int64_t>(SLICE, k_tiles - t);
          widen_panel(p.packed + panel * p.K * BLOCK, p.K, t, n, tiles);
          for (int64_t b = 0; b < count; ++b) {
            if (t == 0) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              load_c(c + b * AMX_ROWS * BLOCK);
            }
            amx_block<PARTS>(parts + b * AMX_ROWS * k_pad + t * AMX_K, part_size, k_pad, tiles, n);
            store_c(c + b * AMX_ROWS * BLOCK);
          }
        }
        for (int64_t b = 0; b < count; ++b) {
          const int64_t m0 = (first + b) * AMX_ROWS;
          amx_store(p, c + b * AMX_ROWS * BLOCK, m0,
                    static_cast<int>(std::min<int64_t>(AMX_ROWS, p.M - m0)), panel * BLOCK, y);
        }
      }
    }
    _tile_release();
  }
}
#endif  // NANOVLLM_AMX

template <typename T>
void linear(const Problem& p, const void* x, void* y, int num_threads) {
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(y);
#if NANOVLLM_AMX
  if (p.M >= amx_min_rows<T>() && amx_permitted()) {
    if constexpr (std::is_same_v<T, bf16>)
      amx_gemm<T, 1>(p, in, out, num_threads);
    else
      amx_gemm<T, 3>(p, in, out, num_threads);
    return;
  }
#endif
#if NANOVLLM_INT8_VNNI
  if (p.K >= VNNI_MIN_K) {
    vnni_linear(p, in, out, num_threads);
    return;
  }
#endif
  if (p.M <= WIDE_MR)
    gemm<T, WIDE_NV, WIDE_MR>(p, in, out, num_threads);
  else
    gemm<T, TALL_NV, TALL_MR>(p, in, out, num_threads);
}

}  // namespace

extern "C" int nanovllm_int8_block() { return BLOCK; }
extern "C" int nanovllm_int8_vector_width() { return W; }

// The fewest inputs (K) from which x is taken in fixed point, below the AMX path's rows (the
// VNNI path); 0: it never runs.
extern "C" int nanovllm_int8_vnni_inputs() {
#if NANOVLLM_INT8_VNNI
  return VNNI_MIN_K;
#else
  return 0;
#endif
}

// The inputs of a block of x's fixed point on the VNNI path; 0: it never runs.
extern "C" int nanovllm_int8_x_block() {
#if NANOVLLM_INT8_VNNI
  return X_BLOCK;
#else
  return 0;
#endif
}

// The fewest rows of float32 (is_bf16 0) or bfloat16 x that take the AMX path; 0: it never runs.
extern "C" int nanovllm_int8_amx_rows(int is_bf16) {
#if NANOVLLM_AMX
  if (amx_permitted()) return is_bf16 ? amx_min_rows<bf16>() : amx_min_rows<float>();
#endif
  return 0;
}

extern "C" void nanovllm_int8_linear(const void* x, int is_bf16, const int8_t* packed,
                                     const float* scale, const float* bias, void* y, int64_t M,
                                     int64_t N, int64_t K, int num_threads) {
  const Problem p{packed, scale, bias, M, N, K};
  if (is_bf16)
    linear<bf16>(p, x, y, num_threads);
  else
    linear<float>(p, x, y, num_threads);
}
