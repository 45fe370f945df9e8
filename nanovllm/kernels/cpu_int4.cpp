// Group-quantized int4 weight-only GEMM on a CPU (W4A16): float32 or bfloat16 activations, 4-bit
// weights with a scale and offset per output channel and group of G input channels,
//
//   w[n, k] = scale[n, g] * q[n, k] + offset[n, g]     q in 0..15, g = k / G
//   y[m, n] = sum_g scale[n, g] (x[m, g] . q[n, g]) + offset[n, g] sum(x[m, g])   (+ bias[n])
//
// in one of three forms, a field of the call (cpu_int4.py's Form), each exact for what it serves:
//
//   AFFINE      float32 scale and offset a group               int4's own, GPTQ, AWQ
//   SYMMETRIC   float16 scale a group, offset = -8 scale        GGUF's Q4_0 (G = 32)
//   SUB_SCALED  float32 scale and offset a group, and per sub-block of 32 inputs (s = k / 32)
//               integers sc, m in 0..63: w = scale sc[n, s] q + offset m[n, s]   Q4_K (G = 256)
//
// Plain C++ with a C entry point, no PyTorch headers, built like cpu_int8.cpp
// (nanovllm/kernels/cpu_int4.py).
//
//   x       [M, K] float32 | bfloat16, contiguous        y  [M, N] x's dtype, contiguous
//   packed  [N_pad / 64][K / G][header | G / 8 lines of 256 bytes], the header per form:
//             AFFINE      scale 64 float32 | offset 64 float32                     512 bytes
//             SYMMETRIC   scale 64 float16                                         128
//             SUB_SCALED  scale, offset 64 float32 | G / 32 x (sc 64 | m 64 bytes)  512 + G / 32 128
//   bias    [N] float32 or null;  N <= N_pad < N + 64 (padded channels: q, scale, offset 0)
//
// A weight takes half a byte and its share of a header: 0.75 bytes at AFFINE's G = 32, 0.5625 at
// 128; 0.5625 SYMMETRIC's at 32 (Q4_0's own); 0.59 SUB_SCALED's at 256 (Q4_K's file 0.5625).
// A panel holds 64 output channels; its groups follow each other, each the group's header,
// then its G / 8 lines, so at M = 1 the weights are read once, front to back, as one
// stream that the hardware's prefetchers follow (with the scales after the lines, loaded first,
// the kernel read from DRAM at 9.6 GB/s; now at 23-27, a bare read loop's rate). A line holds 8
// input channels k .. k + 7 of the 64 channels, 4 bytes a channel, 16 channels (64 bytes) after
// each other: byte i of channel j is q[j, k + i] | q[j, k + 4 + i] << 4.
//
// The products are integer ones. Each row of x is written, per block of B input channels (B =
// G up to 1024), in 24-bit fixed point with the block's own power-of-two step, X = round(x /
// step), |X| <= 8355711, as three signed bytes X = c0 + 2^8 c1 + 2^16 c2. A vector dot-product
// instruction (AVX-512 VNNI's vpdpbusd: 16 lanes, each adding 4 products of an unsigned and a
// signed byte) multiplies the weights' low or high nibbles (an AND, or a shift and an AND, for
// 16 channels x 4 k) by 4 bytes of one digit, broadcast; a block's sums S_c = sum_k q c_k are
// exact in int32. Then, per block and in float32:
//
//   d = step (2^8 (S1 + 2^8 S2) + S0);  total += scale d;  total += offset (step sum(X))
//
// S1 + 2^8 S2 is exact in int32 and rounded once to float32, d once more (an FMA; the products
// by step, a power of two, are exact), the total twice. So against float32 arithmetic: x is
// rounded to 23 bits below its block's largest |x| (at most 2^-23 max |x_block| an element,
// 2^-124 at the least), the products and their sums are exact, and a block adds 4-5 roundings.
// That float work, per row and 16 channels, costs as much as 8-12 dot products: at G = 32 a
// fifth of the time (Qwen3-0.6B's qkv, 128 rows, 1 thread, AMD EPYC Zen 4: 10.1 ms against 8.0
// at G = 256). The two other forms store fewer bytes a weight (gate_up's one row from DRAM:
// AFFINE at G = 32 224 us, SYMMETRIC 161, SUB_SCALED 173) and do that work in integers:
//
//   SYMMETRIC, per sub-block: sum (q - 8) X = S0 + 2^8 S1 + 2^16 S2 - 8 sum(X) is exact in int32
//     (|.| <= 8 8355711 32 < 2^31; the terms wrap modulo 2^32, their total does not), rounded
//     once: total += scale (step sum (q - 8) X), 2 roundings a sub-block. No faster from L3
//     (10.4 ms): the integer sums cost what the conversions they save did.
//   SUB_SCALED, per sub-block j, each digit's sums times sc_j in int32, summed over the block:
//     T_c = sum_j sc_j S_c,j, |T_c| <= 15 128 32 63 B / 32 < 2^27 (exact); per block once,
//     d = step (2^16 T2 + 2^8 T1 + T0) (3 conversions and 2 FMAs, each rounded), and the offsets'
//     part from each sub-block's step sum(X) (rounded once): total += scale d + offset sum_j
//     m_j step sum_j(X), 2 B / 32 + 7 roundings a block. Its tiles hold twice the sums (S and
//     T): half the rows. 9.5 ms for that qkv (the multiplies by sc, vpmulld, and the shorter
//     tiles are the rest of the way to AFFINE's 8.0).
// The weights are never widened to floats: per 64 weights of a row, 6 dot-product instructions
// (2 x 3 digits) and 3 of unpacking shared by the tile's rows. At M = 1 that ran 74 G weights/s
// (6144 x 1024, in L3, 1 thread, AMD EPYC Zen 4; a stand-alone microbenchmark of the inner loops,
// not kept) against 30 for nibbles turned into floats for FMAs, 37 for bfloat16 dot products
// with x split exactly into three bfloat16 parts, and cpu_int8.cpp's loop 28.
//
// The work is GEMM's register tiling, as cpu_int8.cpp's: a tile is MR rows of x by NV vectors of
// channels, 3 MR NV integer sums in registers over a block; each line's nibbles are unpacked once
// for the tile's rows, and its scaled sums are added to the tile's float32 totals (in L1) once a
// block. A row's sums are the same whatever the tile and the thread that ran it: its result does
// not depend on the other rows.
// Vectors: AVX-512 (W = 16 lanes; vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd, which sum the
// same products exactly), AVX2 (W = 8; AVX-VNNI's vpdpbusd where present, else the same pair),
// or plain loops over 4 lanes (SSE2, NEON), chosen at compile time by -march=native.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_fixed_point.h"  // x's digits, as cpu_int8.cpp's
#include "cpu_parallel.h"     // parallel_for

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#define ALWAYS_INLINE inline __attribute__((always_inline))

using bf16 = uint16_t;
constexpr int BLOCK = 64;  // channels a panel
constexpr int LINE = 256;  // bytes of a panel's 8 input channels: 64 channels x 4 bytes
constexpr int SCALES = 8 * BLOCK;  // bytes of a float32 scale and offset a channel
constexpr int SUB = 32;            // inputs of a sub-block: SYMMETRIC's and SUB_SCALED's unit
constexpr int SPAN = 256;          // inputs a tile runs over in one call, at least a group: see gemm
constexpr int MAX_X_BLOCK = 1024;  // input channels of x's fixed point: the int32 sums' bound

// How a group holds its scales (cpu_int4.py's Form), in the bytes before its lines:
//   AFFINE      scale, offset [64] float32                      w = scale q + offset
//   SYMMETRIC   scale [64] float16                              w = scale (q - 8)
//   SUB_SCALED  scale, offset [64] float32, then per sub-block of 32 inputs sub_scale [64] and
//               sub_offset [64] bytes (0..63)                   w = scale sub_scale q + offset sub_offset
enum Form : int { AFFINE = 0, SYMMETRIC = 1, SUB_SCALED = 2 };

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define INT4_AVX512 1
constexpr int W = 16;
constexpr int WIDE_NV = 4, WIDE_MR = 1;  // 64 channels x 1 row: 12 sums
constexpr int PAIR_NV = 4;              // 64 channels x 2 rows: 24 sums
constexpr int TALL_NV = 1, TALL_MR = 8;  // 16 channels x 8 rows: 24 sums
// SUB_SCALED's tiles hold a second set of sums (a group's, scaled): half the first's
constexpr int SUB_PAIR_NV = 2, SUB_TALL_MR = 4;
#elif defined(__AVX2__) && defined(__FMA__)
#define INT4_AVX2 1
constexpr int W = 8;
constexpr int WIDE_NV = 2, WIDE_MR = 1;  // 16 channels x 1 row: 6 sums of 16 registers
constexpr int PAIR_NV = 2;              // 16 channels x 2 rows: 12 sums
constexpr int TALL_NV = 1, TALL_MR = 3;  // 8 channels x 3 rows: 9 sums
constexpr int SUB_PAIR_NV = 1, SUB_TALL_MR = 2;
#else  // 4 lanes: SSE2's and NEON's registers
constexpr int W = 4;
constexpr int WIDE_NV = 4, WIDE_MR = 1;
constexpr int PAIR_NV = 2;
constexpr int TALL_NV = 2, TALL_MR = 3;
constexpr int SUB_PAIR_NV = 2, SUB_TALL_MR = 2;
#endif
#if (defined(INT4_AVX512) && defined(__AVX512VNNI__)) || \
    (defined(INT4_AVX2) && defined(__AVXVNNI__))
#define INT4_DOT 2
#elif defined(INT4_AVX512) || defined(INT4_AVX2)
#define INT4_DOT 1
#else
#define INT4_DOT 0
#endif

using ivec = int32_t __attribute__((vector_size(W * sizeof(int32_t))));
using uvec = uint32_t __attribute__((vector_size(W * sizeof(uint32_t))));
using vec = float __attribute__((vector_size(W * sizeof(float))));
using u16vec = uint16_t __attribute__((vector_size(W * sizeof(uint16_t))));

ALWAYS_INLINE uvec load_q(const uint8_t* p) {
  uvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
ALWAYS_INLINE vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// float16 -> float32, exact (subnormals, infs and NaNs too).
inline float widen_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(mantissa), -24);
  const uint32_t bits = exponent == 31 ? 0x7f800000u | mantissa << 13
                                       : (exponent + 112) << 23 | mantissa << 13;
  return __builtin_bit_cast(float, sign | bits);
}

// W float16 values -> float32 (F16C's vcvtph2ps where the build has it).
ALWAYS_INLINE vec load_half(const uint16_t* p) {
#if defined(INT4_AVX512)
  __m256i h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vec>(_mm512_cvtph_ps(h));
#elif defined(INT4_AVX2) && defined(__F16C__)
  __m128i h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vec>(_mm256_cvtph_ps(h));
#else
  vec v;
  for (int j = 0; j < W; ++j) v[j] = widen_half(p[j]);
  return v;
#endif
}

// W bytes -> int32 (vpmovzxbd: GCC 12 widens a vector of bytes one byte at a time).
ALWAYS_INLINE ivec load_bytes(const uint8_t* p) {
#if defined(INT4_AVX512)
  __m128i b;
  std::memcpy(&b, p, sizeof b);
  return reinterpret_cast<ivec>(_mm512_cvtepu8_epi32(b));
#elif defined(INT4_AVX2)
  int64_t b;
  std::memcpy(&b, p, sizeof b);
  return reinterpret_cast<ivec>(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(b)));
#else
  ivec v;
  for (int j = 0; j < W; ++j) v[j] = p[j];
  return v;
#endif
}

// acc[j] += sum_i byte i of q[j] (unsigned) * x[i] (signed), i = 0..3: exact (|sum| < 2^13).
ALWAYS_INLINE ivec dot4(ivec acc, uvec q, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
#if defined(INT4_AVX512) && INT4_DOT == 2
  return reinterpret_cast<ivec>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc),
                                                    reinterpret_cast<__m512i>(q),
                                                    _mm512_set1_epi32(x4)));
#elif defined(INT4_AVX512)
  const __m512i pairs = _mm512_maddubs_epi16(reinterpret_cast<__m512i>(q), _mm512_set1_epi32(x4));
  return acc + reinterpret_cast<ivec>(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#elif INT4_DOT == 2
  return reinterpret_cast<ivec>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc),
                                                        reinterpret_cast<__m256i>(q),
                                                        _mm256_set1_epi32(x4)));
#elif INT4_DOT == 1
  const __m256i pairs = _mm256_maddubs_epi16(reinterpret_cast<__m256i>(q), _mm256_set1_epi32(x4));
  return acc + reinterpret_cast<ivec>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
  for (int j = 0; j < W; ++j)
    for (int i = 0; i < 4; ++i) acc[j] += static_cast<int32_t>((q[j] >> (8 * i)) & 0xFF) * x[i];
  return acc;
#endif
}

// acc[j] += the products of q[j]'s low bytes with x[0 .. 3] and of its high ones with x[4 .. 7]
// (a line's low and high nibbles). Without VNNI the two vpmaddubsw's int16 pair sums are added
// before the one vpmaddwd: |2 15 128| twice fits int16 (5 instructions for 6: the AVX2 build's
// 1-row GEMV is bound by them).
ALWAYS_INLINE ivec dot8(ivec acc, uvec low, uvec high, const int8_t* x) {
#if INT4_DOT == 1
  int32_t x0, x1;
  std::memcpy(&x0, x, 4);
  std::memcpy(&x1, x + 4, 4);
#if defined(INT4_AVX512)
  const __m512i pairs =
      _mm512_add_epi16(_mm512_maddubs_epi16(reinterpret_cast<__m512i>(low), _mm512_set1_epi32(x0)),
                       _mm512_maddubs_epi16(reinterpret_cast<__m512i>(high), _mm512_set1_epi32(x1)));
  return acc + reinterpret_cast<ivec>(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#else
  const __m256i pairs =
      _mm256_add_epi16(_mm256_maddubs_epi16(reinterpret_cast<__m256i>(low), _mm256_set1_epi32(x0)),
                       _mm256_maddubs_epi16(reinterpret_cast<__m256i>(high), _mm256_set1_epi32(x1)));
  return acc + reinterpret_cast<ivec>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
#else
  return dot4(dot4(acc, low, x), high, x + 4);
#endif
}

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// float32 -> bfloat16, to nearest-even (a NaN: the quiet NaN), as cpu_int8.cpp's.
inline bf16 narrow(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  return x != x ? bf16{0x7fc0} : static_cast<bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
ALWAYS_INLINE void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
ALWAYS_INLINE void store(bf16* p, vec v) {
  const uvec bits = reinterpret_cast<uvec>(v);
  const uvec rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uvec nan = reinterpret_cast<uvec>(v != v);  // all ones where v is a NaN
  const u16vec out = __builtin_convertvector((rounded & ~nan) | (nan & 0x7fc0u), u16vec);
  std::memcpy(p, &out, sizeof out);
}
inline void store_one(float* p, float v) { *p = v; }
inline void store_one(bf16* p, float v) { *p = narrow(v); }

struct Problem {
  const uint8_t* packed;
  const float* bias;  // or null
  int64_t M, N, K, G;
  int64_t B;            // x's fixed-point blocks: G, or its largest multiple-of-32 divisor <= 1024
  Form form;
  int64_t header;       // bytes of a group's scales (its form's), before its G / 8 lines
  int64_t group_bytes;  // header + G / 8 lines
  // K / B and G / B, divided once: a group tile's three 64-bit divisions cost a fifth of a
  // row's time at M = 1 from DRAM (qkv 124 us a call against 97)
  int64_t blocks, group_blocks;
};

// x in fixed point: its digits, per row and block the step and step * sum(X), and per row and
// sub-block of 32 sum(X) (exact: |.| < 2^28) and step * sum(X).
struct Digits {
  std::vector<int8_t> digits;    // [K / B][M][3][B]: a block's rows side by side
  std::vector<float> step, sum;  // [M][K / B]
  std::vector<int32_t> sub_total;  // [M][K / 32]
  std::vector<float> sub_sum;      // [M][K / 32]
  std::vector<uint8_t> finite;     // [M]: 0 where the row holds an inf or a NaN
};

// The calling thread's, kept between calls (no allocation a call once grown).
thread_local Digits x_digits;

// Row `x` [K] -> its digits (block j's [3][B] at digits + j * stride), steps and sums [K / B],
// sub-block sums [K / 32]; false if it holds an inf or a NaN.
template <typename T>
bool to_digits(const T* x, int64_t K, int64_t B, int8_t* digits, int64_t stride, float* step,
               float* sum, int32_t* sub_total, float* sub_sum) {
  for (int64_t k0 = 0, j = 0; k0 < K; k0 += B, ++j) {
    const auto as_float = [](T v) { return widen(v); };
    const uint32_t top = fixed_point::largest_magnitude_bits(x + k0, B, as_float);
    if (top >= fixed_point::NONFINITE_BITS) return false;
    const float scale = fixed_point::block_scale(__builtin_bit_cast(float, top));
    int64_t total = 0;
    int8_t* out = digits + j * stride - k0;
    for (int64_t s = k0; s < k0 + B; s += SUB) {
      int32_t sub = 0;
      for (int64_t k = s; k < s + SUB; ++k) {
        const int32_t X = fixed_point::to_fixed(widen(x[k]), scale);
        fixed_point::split(X, out[k], out[B + k], out[2 * B + k]);
        sub += X;
      }
      sub_total[s / SUB] = sub;
      sub_sum[s / SUB] = static_cast<float>(sub) / scale;
      total += sub;
    }
    step[j] = 1.f / scale;
    sum[j] = static_cast<float>(total) / scale;
  }
  return true;
}

template <typename T>
void prepare(const Problem& p, const T* x, int num_threads) {
  Digits& d = x_digits;
  const int64_t blocks = p.K / p.B;
  if (d.digits.size() < static_cast<size_t>(3 * p.M * p.K)) d.digits.resize(3 * p.M * p.K);
  if (d.step.size() < static_cast<size_t>(p.M * blocks)) {
    d.step.resize(p.M * blocks);
    d.sum.resize(p.M * blocks);
  }
  if (d.sub_total.size() < static_cast<size_t>(p.M * p.K / SUB)) {
    d.sub_total.resize(p.M * p.K / SUB);
    d.sub_sum.resize(p.M * p.K / SUB);
  }
  if (d.finite.size() < static_cast<size_t>(p.M)) d.finite.resize(p.M);
  int8_t* digits = d.digits.data();
  float *step = d.step.data(), *sum = d.sum.data(), *sub_sum = d.sub_sum.data();
  int32_t* sub_total = d.sub_total.data();
  uint8_t* finite = d.finite.data();
  parallel_for(p.M, p.M * p.K >= (1 << 16), num_threads, [&](int64_t m) {
    finite[m] = to_digits(x + m * p.K, p.K, p.B, digits + 3 * m * p.B, 3 * p.M * p.B,
                          step + m * blocks, sum + m * blocks, sub_total + m * p.K / SUB,
                          sub_sum + m * p.K / SUB);
  });
}

template <int NV, int MR>
using Sums = ivec[3][MR][NV];  // a tile's integer sums, digit by digit

template <int NV, int MR>
ALWAYS_INLINE void clear(Sums<NV, MR>& sums) {
#pragma GCC unroll 3
  for (int i = 0; i < 3; ++i)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) sums[i][m][v] = ivec{};
}

// sums += the tile's products over inputs [k0, k1) of its x block: `rows` the block's digits
// [MR][3][B], `line` the line of input k0 at the tile's channels.
template <int NV, int MR>
ALWAYS_INLINE void add_lines(const Problem& p, Sums<NV, MR>& sums, const uint8_t* line,
                             const int8_t* rows, int64_t k0, int64_t k1) {
  const uvec nibble = uvec{} + 0x0F0F0F0Fu;
  for (int64_t k = k0; k < k1; k += 8, line += LINE) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if constexpr (NV * W < BLOCK)  // the next group's: see gemm
        __builtin_prefetch(line + 4 * W * v + p.group_bytes, 0, 2);
      const uvec q = load_q(line + 4 * W * v);
      const uvec low = q & nibble, high = (q >> 4) & nibble;  // k .. k + 3, k + 4 .. k + 7
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = rows + 3 * m * p.B + k;
#pragma GCC unroll 3
        for (int i = 0; i < 3; ++i) sums[i][m][v] = dot8(sums[i][m][v], low, high, x + i * p.B);
      }
    }
  }
}

// AFFINE, per x block: d = step (2^8 (S1 + 2^8 S2) + S0), total += scale d + offset step sum(X).
template <int NV, int MR>
ALWAYS_INLINE void add_affine(const Problem& p, const Digits& xd, const Sums<NV, MR>& sums,
                              const float* scales, int64_t block, int64_t m0, float* totals) {
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const vec scale = load(scales + v * W), offset = load(scales + BLOCK + v * W);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const float step = xd.step[(m0 + m) * p.blocks + block];
      const float sum = xd.sum[(m0 + m) * p.blocks + block];
      const ivec upper = sums[1][m][v] + (sums[2][m][v] << 8);  // exact: |.| < 2^29
      const vec low = __builtin_convertvector(sums[0][m][v], vec) * step;  // exact
      const vec d = __builtin_convertvector(upper, vec) * (256.f * step) + low;
      float* total = totals + m * BLOCK + v * W;
      const vec t = scale * d + load(total);
      store(total, offset * sum + t);
    }
  }
}

// SYMMETRIC, per sub-block of 32 inputs: total += scale (step sum (q - 8) X), the sum exact in
// int32 (the top of the file).
template <int NV, int MR>
ALWAYS_INLINE void add_symmetric(const Problem& p, const Digits& xd, const Sums<NV, MR>& sums,
                                 const uint16_t* scales, int64_t block, int64_t sub,
                                 int64_t m0, float* totals) {
  const int64_t subs = p.K / SUB;
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const vec scale = load_half(scales + v * W);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const float step = xd.step[(m0 + m) * p.blocks + block];
      const uint32_t eight_sum = 8u * static_cast<uint32_t>(xd.sub_total[(m0 + m) * subs + sub]);
      const uvec wrapped = reinterpret_cast<const uvec&>(sums[0][m][v]) +
                           (reinterpret_cast<const uvec&>(sums[1][m][v]) << 8) +
                           (reinterpret_cast<const uvec&>(sums[2][m][v]) << 16) - eight_sum;
      const vec d = __builtin_convertvector(reinterpret_cast<ivec>(wrapped), vec) * step;
      float* total = totals + m * BLOCK + v * W;
      store(total, scale * d + load(total));
    }
  }
}

// SUB_SCALED, per x block: `sums` are T_c = sum_j sc_j S_c,j, exact (the top of the file);
// total += scale step (2^16 T2 + 2^8 T1 + T0) + offset sum_j m_j (step sum_j(X)).
template <int NV, int MR>
ALWAYS_INLINE void add_sub_scaled(const Problem& p, const Digits& xd, const Sums<NV, MR>& sums,
                                  const uint8_t* header, int64_t block, int64_t first_sub,
                                  int c, int64_t m0, float* totals) {
  const float* scales = reinterpret_cast<const float*>(header) + c;
  const uint8_t* sub_offsets = header + SCALES + BLOCK + c;  // after each sub-block's scales
  const int64_t subs = p.K / SUB, block_subs = p.B / SUB;
  const int64_t group_sub = first_sub % (p.G / SUB);  // the block's first sub-block in the group
  const float* sub_sum = xd.sub_sum.data() + m0 * subs + first_sub;  // [MR][subs]
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const vec scale = load(scales + v * W), offset = load(scales + BLOCK + v * W);
    vec mins[MR] = {};  // sum_j m_j step sum_j(X), each m_j widened once for the tile's rows
    for (int64_t j = 0; j < block_subs; ++j) {
      const vec m_j = __builtin_convertvector(
          load_bytes(sub_offsets + (group_sub + j) * 2 * BLOCK + v * W), vec);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) mins[m] = m_j * sub_sum[m * subs + j] + mins[m];
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const float step = xd.step[(m0 + m) * p.blocks + block];
      const vec high = __builtin_convertvector(sums[2][m][v], vec) * 256.f +
                       __builtin_convertvector(sums[1][m][v], vec);
      const vec d = (high * 256.f + __builtin_convertvector(sums[0][m][v], vec)) * step;
      float* total = totals + m * BLOCK + v * W;
      const vec t = scale * d + load(total);
      store(total, offset * mins[m] + t);
    }
  }
}

// SUB_SCALED's x block b of a group: the sub-blocks' sums times their sc, summed (T), then
// added to the totals. A function of its own: inlined in groups_tile, GCC 12 spilled its sums
// (128 rows 1.6x slower).
template <int NV, int MR>
__attribute__((noinline)) void sub_scaled_block(const Problem& p, const Digits& xd,
                                                const uint8_t* group, const uint8_t* line,
                                                const int8_t* rows, int64_t block, int64_t b, int c,
                                                int64_t m0, float* __restrict totals) {
  Sums<NV, MR> sums, scaled;  // scaled: sum over the block's sub-blocks of sc * sums
  clear(scaled);
  const uint8_t* sub_scales = group + SCALES + b * p.B / SUB * 2 * BLOCK + c;
  for (int64_t k = 0; k < p.B; k += SUB) {
    clear(sums);
    add_lines(p, sums, line + k / 8 * LINE, rows, k, k + SUB);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const ivec sc = load_bytes(sub_scales + k / SUB * 2 * BLOCK + v * W);
#pragma GCC unroll 3
      for (int i = 0; i < 3; ++i)
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) scaled[i][m][v] += sc * sums[i][m][v];
    }
  }
  add_sub_scaled(p, xd, scaled, group, block, block * p.B / SUB, c, m0, totals);
}

// One tile over the panel's groups [g0, g1), the first at `group`: rows [m0, m0 + MR) of x
// against channels [c, c + NV W); its sums, scaled, are added to `totals` [MR][64] (the tile's
// rows and the panel's channels).
template <int FORM, int NV, int MR>
void groups_tile(const Problem& p, const Digits& xd, const uint8_t* group, int64_t g0, int64_t g1,
                 int c, int64_t m0, float* __restrict totals) {
  for (int64_t g = g0; g < g1; ++g, group += p.group_bytes) {
    if constexpr (FORM == SUB_SCALED)  // see gemm
      for (int64_t i = 0; i < p.header; i += 64) __builtin_prefetch(group + i, 0, 3);
    for (int64_t b = 0; b < p.group_blocks; ++b) {  // x blocks of the group
      const int64_t block = g * p.group_blocks + b;
      const int8_t* rows = xd.digits.data() + (block * p.M + m0) * 3 * p.B;  // [MR][3][B]
      const uint8_t* line = group + p.header + b * (p.B / 8) * LINE + 4 * c;
      Sums<NV, MR> sums;
      if constexpr (FORM == AFFINE) {
        clear(sums);
        add_lines(p, sums, line, rows, 0, p.B);
        add_affine(p, xd, sums, reinterpret_cast<const float*>(group) + c, block, m0, totals + c);
      } else if constexpr (FORM == SYMMETRIC) {
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(group) + c;
        for (int64_t k = 0; k < p.B; k += SUB) {
          clear(sums);
          add_lines(p, sums, line + k / 8 * LINE, rows, k, k + SUB);
          add_symmetric(p, xd, sums, scales, block, (block * p.B + k) / SUB, m0, totals + c);
        }
      } else {
        sub_scaled_block<NV, MR>(p, xd, group, line, rows, block, b, c, m0, totals + c);
      }
    }
  }
}

template <int NV>
using GroupsTileFn = void (*)(const Problem&, const Digits&, const uint8_t*, int64_t, int64_t, int,
                              int64_t, float*);

// groups_tiles<FORM, NV>(MR)[r - 1]: the tile of r rows, r = 1..MR.
template <int FORM, int NV, int... R>
constexpr auto groups_tiles(std::integer_sequence<int, R...>) {
  return std::array<GroupsTileFn<NV>, sizeof...(R)>{&groups_tile<FORM, NV, R + 1>...};
}

// Rows [m0, m0 + rows) of y, channels [n0, n0 + 64) but not past N: totals [rows][64] + bias.
template <typename T>
void store_rows(const Problem& p, const float* totals, int64_t m0, int rows, int64_t n0, T* y) {
  for (int64_t n = n0; n < std::min(n0 + BLOCK, p.N); n += W) {
    const float* total = totals + (n - n0);
    if (n + W <= p.N) {
      const vec bias = p.bias ? load(p.bias + n) : vec{};
      for (int m = 0; m < rows; ++m) store(y + (m0 + m) * p.N + n, load(total + m * BLOCK) + bias);
    } else {  // the last channels, fewer than W
      for (int m = 0; m < rows; ++m)
        for (int64_t i = 0; n + i < p.N; ++i)
          store_one(y + (m0 + m) * p.N + n + i,
                    total[m * BLOCK + i] + (p.bias ? p.bias[n + i] : 0.f));
    }
  }
}

// Below this many multiply-adds a call runs on its own thread: a fork/join costs more.
constexpr int64_t GRAIN = int64_t{1} << 16;

// Work items are (panel, row tile) pairs, panel-major, spread statically over the threads: a
// thread keeps a panel in its L2 for all its row tiles. An item runs span by span of groups (of
// SPAN inputs at least), each span's tiles of channels in turn, so a span's lines (8-9 KB at G
// = 32 to 256) are in L1 for all its tiles and the weights come from memory in their order (a
// call a group of 32 had cost as much as an eighth of the time: 11.4 ms against 10.0 for
// Qwen3-0.6B's qkv at 128 rows, 1 thread). A tile narrower than the panel reads a line's part of
// it, every 256 bytes, which the hardware's prefetchers did not follow well: it asks for the
// next group's part of each line it reads (tiles of 16 channels over the whole panel, one after
// the other, ran 0.6-0.8x int8's speed from DRAM at 2-4 rows; group by group 0.8x; with the
// prefetches 1.2x, as from L3). SUB_SCALED's header (1.5 KB at G = 256) is read through its
// group (sc) and after it (scale, offset, m), not front to back: asked for at the group's start
// (1 row from DRAM, 6144 x 1024: 10 GB/s without, 20 with).
template <typename T, int FORM, int NV, int MR>
void gemm(const Problem& p, T* y, int num_threads) {
  static constexpr auto tiles_of = groups_tiles<FORM, NV>(std::make_integer_sequence<int, MR>{});
  const int64_t row_tiles = (p.M + MR - 1) / MR, panels = (p.N + BLOCK - 1) / BLOCK;
  const int64_t panel_bytes = p.K / p.G * p.group_bytes;
  const Digits& xd = x_digits;
  parallel_for(panels * row_tiles, p.M * p.N * p.K >= GRAIN, num_threads, [&](int64_t job) {
    const int64_t panel = job / row_tiles, m0 = job % row_tiles * MR;
    const int rows = static_cast<int>(std::min<int64_t>(MR, p.M - m0));
    const int channels = static_cast<int>(std::min<int64_t>(BLOCK, p.N - panel * BLOCK));
    alignas(64) float totals[MR * BLOCK] = {};
    const uint8_t* group = p.packed + panel * panel_bytes;
    const int64_t groups = p.K / p.G, span = std::max<int64_t>(1, SPAN / p.G);
    for (int64_t g = 0; g < groups; g += span, group += span * p.group_bytes) {
      const int64_t end = std::min(groups, g + span);
      for (int c = 0; c < channels; c += NV * W)
        tiles_of[rows - 1](p, xd, group, g, end, c, m0, totals);
    }
    store_rows(p, totals, m0, rows, panel * BLOCK, y);
  });
}

// The weight w[n, k] as it dequantizes, in float32 (the file's value for GGUF's: each product
// below is exact for float16 scales, the sum rounded once).
float weight_at(const Problem& p, int64_t n, int64_t k) {
  const int64_t panel_bytes = p.K / p.G * p.group_bytes;
  const uint8_t* group = p.packed + n / BLOCK * panel_bytes + k / p.G * p.group_bytes;
  const int j = static_cast<int>(n % BLOCK);
  const int64_t i = k % p.G;
  const uint8_t byte = group[p.header + i / 8 * LINE + 4 * j + i % 4];
  const int q = i % 8 < 4 ? byte & 0xF : byte >> 4;
  const float* scales = reinterpret_cast<const float*>(group);
  if (p.form == SYMMETRIC) {
    const float scale = widen_half(reinterpret_cast<const uint16_t*>(group)[j]);
    return scale * q + -8.f * scale;
  }
  if (p.form == SUB_SCALED) {
    const uint8_t* sub = group + SCALES + i / SUB * 2 * BLOCK + j;
    return scales[j] * sub[0] * q + scales[BLOCK + j] * sub[BLOCK];
  }
  return scales[j] * q + scales[BLOCK + j];
}

// A row holding an inf or a NaN, in float32 from the weights as they dequantize: the infs and
// NaNs of y are those of x @ w^T, whatever the order of the sum.
template <typename T>
void nonfinite_row(const Problem& p, const T* x, T* y) {
  for (int64_t n = 0; n < p.N; ++n) {
    float total = p.bias ? p.bias[n] : 0.f;
    for (int64_t k = 0; k < p.K; ++k) total += widen(x[k]) * weight_at(p, n, k);
    store_one(y + n, total);
  }
}

template <typename T, int FORM>
void run(const Problem& p, T* out, int num_threads) {
  if (p.M <= WIDE_MR)
    gemm<T, FORM, WIDE_NV, WIDE_MR>(p, out, num_threads);
  else if (FORM == SUB_SCALED && p.M == 2)
    gemm<T, FORM, SUB_PAIR_NV, 2>(p, out, num_threads);
  else if (p.M == 2)
    gemm<T, FORM, PAIR_NV, 2>(p, out, num_threads);
  else if (FORM == SUB_SCALED)
    gemm<T, FORM, TALL_NV, SUB_TALL_MR>(p, out, num_threads);
  else
    gemm<T, FORM, TALL_NV, TALL_MR>(p, out, num_threads);
}

template <typename T>
void linear(const Problem& p, const void* x, void* y, int num_threads) {
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(y);
  prepare(p, in, num_threads);
  if (p.form == SYMMETRIC)
    run<T, SYMMETRIC>(p, out, num_threads);
  else if (p.form == SUB_SCALED)
    run<T, SUB_SCALED>(p, out, num_threads);
  else
    run<T, AFFINE>(p, out, num_threads);
  for (int64_t m = 0; m < p.M; ++m)
    if (!x_digits.finite[m]) nonfinite_row(p, in + m * p.K, out + m * p.N);
}

}  // namespace

extern "C" int nanovllm_int4_block() { return BLOCK; }
extern "C" int nanovllm_int4_line() { return LINE; }
extern "C" int nanovllm_int4_vector_width() { return W; }
// How a vector's byte products are summed: 2 a dot-product instruction (VNNI), 1 a pair of
// multiply-adds (vpmaddubsw + vpmaddwd), 0 plain loops.
extern "C" int nanovllm_int4_dot() { return INT4_DOT; }

// x's fixed-point blocks for a group size G (a multiple of 32): G, or its largest divisor
// that is a multiple of 32 and at most 1024.
extern "C" int64_t nanovllm_int4_x_block(int64_t G) {
  int64_t B = std::min<int64_t>(G, MAX_X_BLOCK) / 32 * 32;
  while (G % B != 0) B -= 32;
  return B;
}

// Bytes of a group's scales, before its lines: 512 (AFFINE), 128 (SYMMETRIC), 512 + G / 32 * 128
// (SUB_SCALED); -1 for an unknown form.
extern "C" int64_t nanovllm_int4_header_bytes(int64_t G, int form) {
  switch (form) {
    case AFFINE: return SCALES;
    case SYMMETRIC: return 2 * BLOCK;
    case SUB_SCALED: return SCALES + G / SUB * 2 * BLOCK;
    default: return -1;
  }
}

extern "C" void nanovllm_int4_linear(const void* x, int is_bf16, const uint8_t* packed,
                                     const float* bias, void* y, int64_t M, int64_t N, int64_t K,
                                     int64_t G, int form, int num_threads) {
  const int64_t B = nanovllm_int4_x_block(G), header = nanovllm_int4_header_bytes(G, form);
  const Problem p{packed, bias, M, N, K, G, B, static_cast<Form>(form), header,
                  header + G / 8 * LINE, K / B, G / B};
  if (is_bf16)
    linear<bf16>(p, x, y, num_threads);
  else
    linear<float>(p, x, y, num_threads);
}
