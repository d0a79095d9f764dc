// The decode step's dense layers for XLA:CPU, called from JAX through the XLA FFI
// (photon_jax/kernels/cpukernel.py builds this file with paged_attention.cc and registers both).
//
//   y[M, N] = x[M, K] @ W + b      W [K, N] (a linear layer), or [N, K] with `transposed`
//                                  (the LM head as the engine holds it)
//
// W comes as float32, or quantized (photon_jax/model/quant.py), the kind told by its dtype:
//   int8 / float8_e4m3fn  codes q [K, N] (or [N, K]), scales s [N]:  W[k, n] = q[k, n] * s[n]
//   uint8 (int4)          q4 [K/2, N], s4 and z4 [K/g, N]:  row k's code is q4[k] & 15 for
//                         k < K/2, q4[k - K/2] >> 4 after; W[k, n] = bf16(bf16(code - z4)
//                         * s4) of group k / g, each step rounded to bfloat16 (never
//                         transposed)
// One FFI target for all four: W is an untyped buffer whose dtype names its kind, the scales
// and zero points two float32 operands, empty where the kind has none.  A quantized W is
// widened to float32 as its panels are packed, or at 1-4 rows in registers as it is streamed
// (each element once per call), so the call reads a byte (half a byte) per weight instead of
// four; the widened values are bitwise what quant.dequantize computes in float32, so the
// result is bitwise that of the float32 call on the dequantized weight.
//
// Built only with AVX2 + FMA (x86-64 CPUs since 2013-2015); elsewhere the call fails and
// `photon_dense_simd()` is 0, so Python keeps XLA's products (cpukernel.dense_fast).  Where
// the compiler targets AVX-512 (F, BW, VL), 8-bit codes at 1-4 rows stream in 512-bit
// vectors instead (Gemv512Block: the same operations lane for lane, so the same bits;
// `photon_dense_gemv512` says which runs, and can switch it).
//
// Why: a decode step multiplies a few rows (M = the batch, up to 32 or so) by every weight
// matrix.  XLA:CPU runs these skinny float32 products at 15-25 GFLOP/s on the 2-core
// machine we measure on, about a third of what the same cores do on a large product, and at
// 32 rows they are most of the step.  Here a work item is a block of 128 columns of W:
// its 8 panels of 16 columns are copied, 256 k's at a time, into one contiguous buffer (W's
// rows are N floats apart, which would put every k of a panel in the same few L1 sets; 8
// panels at once read each row of W in 512-byte runs), and register-blocked 6 x 16 tiles
// run over each panel: each W element is read from memory once per call, x stays in cache.
// At 1-4 rows a quantized [K, N] W is not packed but streamed (GemvWorker): its codes are
// widened in registers and multiplied in place, row after row of a block of columns, so the
// call runs at the rate memory delivers the codes rather than the rate of packing them.
//
// Numerics: every output is b + (x[m, 0] w[0, n] + x[m, 1] w[1, n] + ...), accumulated in
// float32 in k order with fused multiply-adds, the bias added last.  Blocks are shared out
// to XLA's intra-op threads (parallel.h).

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PHOTON_DENSE_SIMD 1
#else
#define PHOTON_DENSE_SIMD 0
#endif
// 8-bit codes at 1-4 rows in 512-bit vectors (Gemv512Block), where the compiler targets them.
#if PHOTON_DENSE_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PHOTON_GEMV512 1
#else
#define PHOTON_GEMV512 0
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 16;   // panel width: two 8-float vectors
constexpr int64_t kMR = 6;    // rows per register tile: 12 accumulators
constexpr int64_t kKC = 256;  // k's per packed panel (16 KB: half an L1)
constexpr int64_t kPB = 8;    // panels per work item, packed together (128 KB: in L2)
constexpr int64_t kNB = kPB * kNR;

// What W holds (from its dtype).
enum class Kind { kF32, kS8, kF8, kU4 };

struct Dense {
  const float* x;
  const void* w;   // float32, or codes (Kind)
  const float* s;  // kS8, kF8: scales [N]; kU4: scales [K/g, N]
  const float* z;  // kU4: zero points [K/g, N]
  const float* b;
  float* y;
  int64_t m, k, n;
  int64_t g;       // kU4: rows per group
  int64_t kcb;     // k's per packed panel: kKC, or less (see DenseImpl)
  bool transposed;
  Kind kind;
};

// Everything below to DenseImpl needs AVX2 + FMA; other CPUs keep XLA's products.
#if PHOTON_DENSE_SIMD

// float8_e4m3fn -> float32 from the format's definition: sign, 4 exponent bits (bias 7), 3
// mantissa bits; exponent 0 is subnormal (m * 2^-9); no infinities, S.1111.111 is NaN.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                         : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
      if (e == 15 && m == 7) mag = std::numeric_limits<float>::quiet_NaN();
      v[c] = (c & 0x80) ? -mag : mag;
    }
  }
};
const Fp8Table kFp8;

// c[i, 0:16] (+)= x[i, 0:kc] @ bp[0:kc, 0:16] for the MR rows of a tile; c rows kNR apart.
template <int MR>
inline void Tile(const float* x, int64_t ldx, const float* bp, int64_t kc, float* c,
                 bool accumulate) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  // Named accumulators, not an array: GCC keeps an array of vectors in memory and stores
  // it back in every iteration (measured: half the speed).
#define LOAD(i)                                   \
  if constexpr (MR > i) {                         \
    a##i##0 = _mm256_loadu_ps(c + i * kNR);       \
    a##i##1 = _mm256_loadu_ps(c + i * kNR + 8);   \
  }
  if (accumulate) {
    LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5)
  }
#undef LOAD
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  const float* x3 = x + 3 * ldx;
  const float* x4 = x + 4 * ldx;
  const float* x5 = x + 5 * ldx;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(bp + k * kNR);
    const __m256 b1 = _mm256_loadu_ps(bp + k * kNR + 8);
    __m256 a;
#define ROW(i)                                       \
  if constexpr (MR > i) {                            \
    a = _mm256_broadcast_ss(x##i + k);               \
    a##i##0 = _mm256_fmadd_ps(a, b0, a##i##0);       \
    a##i##1 = _mm256_fmadd_ps(a, b1, a##i##1);       \
  }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
#define STORE(i)                                  \
  if constexpr (MR > i) {                         \
    _mm256_storeu_ps(c + i * kNR, a##i##0);       \
    _mm256_storeu_ps(c + i * kNR + 8, a##i##1);   \
  }
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

// dst[i * ld + j] = r[j][i] for an 8 x 8 block (the head's [N, K] rows -> columns).
inline void Transpose8(const __m256* r, float* dst, int64_t ld) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

// dst[i * ld + j] = src[j * lds + i] for an 8 x 8 block.
inline void Transpose8(const float* src, int64_t lds, float* dst, int64_t ld) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  Transpose8(r, dst, ld);
}

// -- widening codes, eight at a time (one float32 op per step: the values are exact) -----

// int8 codes p[0:8] as float32.
inline __m256 Widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

#if defined(__F16C__)
// float8_e4m3fn codes as float32 times 2^-8 (`kF8Lift` puts the 2^8 into the scale:
// (v 2^-8)(s 2^8) is the exact product v s, rounded once like v * s).  The byte sign-extended
// to 16 bits and shifted up 7, bit 14 (a copy of the sign) cleared, is the float16 with
// e4m3's 4 exponent bits and 3 mantissa bits: float16's bias is 8 more, so it is the value
// times 2^-8, subnormals included, widened exactly by the hardware (float16 denormal inputs
// are not subject to a flush-to-zero mode).  The NaN codes (magnitude 0x7f, float16 0x3f80)
// get float16's all-ones exponent: NaN, as in the table (bit 14 set where adding 1 to the
// magnitude's lowest bit carries through all of its 7 bits: only there).
inline __m128i HalfOfF8(__m128i h) {  // h: the codes, sign-extended to 16 bits
  h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __m128i nan = _mm_and_si128(_mm_add_epi16(h, _mm_set1_epi16(0x80)),
                                    _mm_set1_epi16(0x4000));
  return _mm_or_si128(h, nan);
}
inline __m256 Widen8(const uint8_t* p) {
  return _mm256_cvtph_ps(
      HalfOfF8(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
// Sixteen codes: the integer steps on one 256-bit vector.
inline void Widen16(const uint8_t* p, __m256& lo, __m256& hi) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  h = _mm256_or_si256(h, _mm256_and_si256(_mm256_add_epi16(h, _mm256_set1_epi16(0x80)),
                                          _mm256_set1_epi16(0x4000)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
constexpr float kF8Lift = 256.0f;
#else
inline __m256 Widen8(const uint8_t* p) {  // the table, one element at a time
  return _mm256_setr_ps(kFp8.v[p[0]], kFp8.v[p[1]], kFp8.v[p[2]], kFp8.v[p[3]],
                        kFp8.v[p[4]], kFp8.v[p[5]], kFp8.v[p[6]], kFp8.v[p[7]]);
}
inline void Widen16(const uint8_t* p, __m256& lo, __m256& hi) {
  lo = Widen8(p);
  hi = Widen8(p + 8);
}
constexpr float kF8Lift = 1.0f;
#endif
inline void Widen16(const int8_t* p, __m256& lo, __m256& hi) {
  lo = Widen8(p);
  hi = Widen8(p + 8);
}

// One code as float32 (the scalar edges: the table for e4m3, exactly the vector's value).
inline float Code(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
inline float Code(const uint8_t* p, int64_t i) { return kFp8.v[p[i]]; }

// An 8-bit W (int8_t: int8, uint8_t: e4m3) [N, K] (`transposed`) with scales [N]: one
// panel, W[k0:k0+kc, n0:n0+cols] as bp[kc, 16], columns past `cols` zero.
template <typename T>
void PackChannelT(const Dense& d, int64_t k0, int64_t kc, int64_t n0, int64_t cols,
                  float* bp) {
  const T* q = static_cast<const T*>(d.w);
  const float* s = d.s;
  const float lift = std::is_same<T, uint8_t>::value ? kF8Lift : 1.0f;
  if (cols == kNR) {  // widen 8 x 8 blocks, scale each row, transpose them
    const int64_t k8 = kc - kc % 8;
    // The next panel's 16 rows (contiguous: all of K) are prefetched as this one starts:
    // each of its rows is read a few lines at a time, 8 rows at once, runs too short for
    // the hardware's prefetchers on a head out of cache (measured: 1.25x faster).
    if (k0 == 0 && n0 + 2 * kNR <= d.n) {
      const char* next = reinterpret_cast<const char*>(q + (n0 + kNR) * d.k);
      for (int64_t i = 0; i < kNR * d.k * static_cast<int64_t>(sizeof(T)); i += 64) {
        _mm_prefetch(next + i, _MM_HINT_T1);
      }
    }
    for (int64_t jb = 0; jb < kNR; jb += 8) {
      const T* src = q + (n0 + jb) * d.k + k0;
      __m256 sj[8];
      for (int i = 0; i < 8; ++i) sj[i] = _mm256_set1_ps(s[n0 + jb + i] * lift);
      int64_t k = 0;
      for (; k + 16 <= k8; k += 16) {
        __m256 r[8], r8[8];
        for (int i = 0; i < 8; ++i) {
          Widen16(src + i * d.k + k, r[i], r8[i]);
          r[i] = _mm256_mul_ps(r[i], sj[i]);
          r8[i] = _mm256_mul_ps(r8[i], sj[i]);
        }
        Transpose8(r, bp + k * kNR + jb, kNR);
        Transpose8(r8, bp + (k + 8) * kNR + jb, kNR);
      }
      for (; k < k8; k += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(Widen8(src + i * d.k + k), sj[i]);
        Transpose8(r, bp + k * kNR + jb, kNR);
      }
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t k = k8; k < kc; ++k)
          bp[k * kNR + jb + j] = Code(src + j * d.k, k) * s[n0 + jb + j];
    }
    return;
  }
  for (int64_t j = 0; j < kNR; ++j) {
    if (j < cols) {
      const T* src = q + (n0 + j) * d.k + k0;
      for (int64_t k = 0; k < kc; ++k) bp[k * kNR + j] = Code(src, k) * s[n0 + j];
    } else {
      for (int64_t k = 0; k < kc; ++k) bp[k * kNR + j] = 0.0f;
    }
  }
}

// The quantized [K, N] layouts pack a whole block's panels a row of W at a time: per panel a
// row is 16 (8) bytes, a quarter (eighth) of a cache line, and a panel's rows, N bytes
// apart, fall in a few L1 sets and evict each other before the next panel reads the rest of
// their lines (measured: the row-at-a-time order is 2-3x faster).  Panel p of the block
// goes to bp + p * d.kcb * kNR, as Pack writes it.

// The rows are prefetched kAhead ahead: a block's row is 2 cache lines here (1 for 4 bits),
// too short a run for the hardware's prefetchers to get ahead of a cold W (measured: 1.2-1.3x
// faster on a weight out of cache).
constexpr int64_t kAhead = 8;
inline void PrefetchRow(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// One row of a panel past the last full one: `cols` values, zeros after.
template <typename F>
inline void PackTail(float* dst, int64_t cols, F value) {
  for (int64_t j = 0; j < kNR; ++j) dst[j] = j < cols ? value(j) : 0.0f;
}

// An 8-bit W [K, N] with scales [N]: code * s, one rounding.
template <typename T>
void PackChannelRows(const Dense& d, int64_t k0, int64_t kc, int64_t n0, int64_t panels,
                     float* bp) {
  const T* q = static_cast<const T*>(d.w);
  const float* s = d.s;
  const int64_t last = std::min(kNR, d.n - (n0 + (panels - 1) * kNR));
  const int64_t full = last == kNR ? panels : panels - 1;
  const __m256 lift = _mm256_set1_ps(std::is_same<T, uint8_t>::value ? kF8Lift : 1.0f);
  __m256 sv[2 * kPB];
  for (int64_t p = 0; p < full; ++p) {
    sv[2 * p] = _mm256_mul_ps(_mm256_loadu_ps(s + n0 + p * kNR), lift);
    sv[2 * p + 1] = _mm256_mul_ps(_mm256_loadu_ps(s + n0 + p * kNR + 8), lift);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const T* src = q + (k0 + k) * d.n + n0;
    if (k0 + k + kAhead < d.k) PrefetchRow(src + kAhead * d.n, panels * kNR * sizeof(T));
    float* dst = bp + k * kNR;
    for (int64_t p = 0; p < full; ++p) {
      const T* sp = src + p * kNR;
      float* dp = dst + p * d.kcb * kNR;
      __m256 lo, hi;
      Widen16(sp, lo, hi);
      _mm256_storeu_ps(dp, _mm256_mul_ps(lo, sv[2 * p]));
      _mm256_storeu_ps(dp + 8, _mm256_mul_ps(hi, sv[2 * p + 1]));
    }
    if (full < panels) {
      const T* sp = src + full * kNR;
      const float* st = s + n0 + full * kNR;
      PackTail(dst + full * d.kcb * kNR, last, [&](int64_t j) { return Code(sp, j) * st[j]; });
    }
  }
}

// float32 -> the nearest bfloat16 (ties to even), held as float32: XLA's
// reduce_precision(x, 8, 7) bit for bit, a NaN passed unchanged as there when kNaN (the
// rounding's carry would turn some NaNs into infinities or zeros).  Without kNaN the
// select is left out (a fifth of the 4-bit widening's time): for scales and zero points
// without a NaN, which no other input can make.
template <bool kNaN>
inline __m256 RoundBf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(
      _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
      _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  if constexpr (kNaN) return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return r;
}
inline float RoundBf16(float x) {
  if (x != x) return x;
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &b, sizeof(b));
  return x;
}

// A 4-bit W (q4 [K/2, N], s4 and z4 [K/g, N]): bf16(bf16(code - z) * s), as
// quant.dequantize widens it (Moondream 2's reference rounds both steps to bfloat16): a
// subtraction, then a multiplication, each rounded to float32 and then to bfloat16 (no
// fused form exists for it, whatever -ffp-contract says).
template <bool kNaN>
inline __m256 Widen4(__m256 code, const float* z, const float* s) {
  return RoundBf16<kNaN>(_mm256_mul_ps(
      RoundBf16<kNaN>(_mm256_sub_ps(code, _mm256_loadu_ps(z))), _mm256_loadu_ps(s)));
}
inline float Widen4(float code, float z, float s) {
  return RoundBf16(RoundBf16(code - z) * s);
}

// Whether the 4-bit scales or zero points of columns [n0, n0 + cols) hold a NaN.
bool GroupPartsNaN(const Dense& d, int64_t n0, int64_t cols) {
  bool nan = false;
  for (int64_t gi = 0; gi < d.k / d.g; ++gi) {
    const float* s = d.s + gi * d.n + n0;
    const float* z = d.z + gi * d.n + n0;
    for (int64_t j = 0; j < cols; ++j) nan |= (s[j] != s[j]) | (z[j] != z[j]);
  }
  return nan;
}

template <bool kNaN>
void PackGroupRows(const Dense& d, int64_t k0, int64_t kc, int64_t n0, int64_t panels,
                   float* bp) {
  const uint8_t* q = static_cast<const uint8_t*>(d.w);
  const int64_t half = d.k / 2;
  const int64_t last = std::min(kNR, d.n - (n0 + (panels - 1) * kNR));
  const int64_t full = last == kNR ? panels : panels - 1;
  const __m128i nibble = _mm_set1_epi8(15);
  for (int64_t k = 0; k < kc; ++k) {
    const int64_t kk = k0 + k;
    const bool high = kk >= half;
    const uint8_t* src = q + (high ? kk - half : kk) * d.n + n0;
    if (kk + kAhead < d.k && (kk < half) == (kk + kAhead < half)) {
      PrefetchRow(src + kAhead * d.n, panels * kNR);
    }
    const int64_t gi = (kk / d.g) * d.n + n0;
    const float* s = d.s + gi;
    const float* z = d.z + gi;
    float* dst = bp + k * kNR;
    for (int64_t p = 0; p < full; ++p) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + p * kNR));
      if (high) v = _mm_srli_epi16(v, 4);
      v = _mm_and_si128(v, nibble);
      const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
      const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
      const float* sp = s + p * kNR;
      const float* zp = z + p * kNR;
      float* dp = dst + p * d.kcb * kNR;
      _mm256_storeu_ps(dp, Widen4<kNaN>(c0, zp, sp));
      _mm256_storeu_ps(dp + 8, Widen4<kNaN>(c1, zp + 8, sp + 8));
    }
    if (full < panels) {
      const uint8_t* sp = src + full * kNR;
      const float* st = s + full * kNR;
      const float* zt = z + full * kNR;
      PackTail(dst + full * d.kcb * kNR, last, [&](int64_t j) {
        return Widen4(static_cast<float>(high ? sp[j] >> 4 : sp[j] & 15), zt[j], st[j]);
      });
    }
  }
}

// W[k0:k0+kc, n0:n0+cols] as float32 bp[kc, 16], columns past `cols` zero.
void Pack(const Dense& d, int64_t k0, int64_t kc, int64_t n0, int64_t cols, float* bp) {
  switch (d.kind) {  // (the quantized [K, N] layouts are packed by PackBlock)
    case Kind::kS8: return PackChannelT<int8_t>(d, k0, kc, n0, cols, bp);
    case Kind::kF8: return PackChannelT<uint8_t>(d, k0, kc, n0, cols, bp);
    case Kind::kU4:
    case Kind::kF32: break;
  }
  const float* w = static_cast<const float*>(d.w);
  if (d.transposed && cols == kNR) {  // in 8 x 8 blocks; a scalar tail of k
    const int64_t k8 = kc - kc % 8;
    for (int64_t jb = 0; jb < kNR; jb += 8) {
      const float* src = w + (n0 + jb) * d.k + k0;
      for (int64_t k = 0; k < k8; k += 8) Transpose8(src + k, d.k, bp + k * kNR + jb, kNR);
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t k = k8; k < kc; ++k) bp[k * kNR + jb + j] = src[j * d.k + k];
    }
    return;
  }
  if (d.transposed) {  // W [N, K]: each of the panel's rows is contiguous in k
    for (int64_t j = 0; j < kNR; ++j) {
      if (j < cols) {
        const float* src = w + (n0 + j) * d.k + k0;
        for (int64_t k = 0; k < kc; ++k) bp[k * kNR + j] = src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) bp[k * kNR + j] = 0.0f;
      }
    }
  } else if (cols == kNR) {
    for (int64_t k = 0; k < kc; ++k) {
      std::memcpy(bp + k * kNR, w + (k0 + k) * d.n + n0, kNR * sizeof(float));
    }
  } else {
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = w + (k0 + k) * d.n + n0;
      for (int64_t j = 0; j < kNR; ++j) bp[k * kNR + j] = j < cols ? src[j] : 0.0f;
    }
  }
}

// The block's `panels` panels, W[k0:k0+kc, n0:n0+16 panels], as bp + p * d.kcb * kNR.
// `nan`: a 4-bit block's scales or zero points hold a NaN (GroupPartsNaN).
void PackBlock(const Dense& d, int64_t k0, int64_t kc, int64_t n0, int64_t panels, bool nan,
               float* bp) {
  if (!d.transposed) {
    switch (d.kind) {
      case Kind::kS8: return PackChannelRows<int8_t>(d, k0, kc, n0, panels, bp);
      case Kind::kF8: return PackChannelRows<uint8_t>(d, k0, kc, n0, panels, bp);
      case Kind::kU4:
        return nan ? PackGroupRows<true>(d, k0, kc, n0, panels, bp)
                   : PackGroupRows<false>(d, k0, kc, n0, panels, bp);
      case Kind::kF32: break;
    }
  }
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t np = n0 + p * kNR;
    Pack(d, k0, kc, np, std::min(kNR, d.n - np), bp + p * d.kcb * kNR);
  }
}

// One row of x times 4 panels (bp: ldb apart; their rows of c: ldc apart), for the
// row a batch leaves past its 6-row tiles when that is one (M = 1, 7, 13, ...).  A 1-row
// tile over one panel keeps 2 sums in flight and waits on their multiply-adds' latency at
// every k; over 4 panels it keeps 8.  Each sum still runs in k order: the same bits.
inline void RowTile4(const float* x, const float* bp, int64_t ldb, int64_t kc, float* c,
                     int64_t ldc, bool accumulate) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00;
  const float* b0 = bp;
  const float* b1 = bp + ldb;
  const float* b2 = bp + 2 * ldb;
  const float* b3 = bp + 3 * ldb;
#define LOAD(p)                                   \
  a##p##0 = _mm256_loadu_ps(c + p * ldc);         \
  a##p##1 = _mm256_loadu_ps(c + p * ldc + 8);
  if (accumulate) {
    LOAD(0) LOAD(1) LOAD(2) LOAD(3)
  }
#undef LOAD
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 a = _mm256_broadcast_ss(x + k);
#define PANEL(p)                                                              \
  a##p##0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b##p + k * kNR), a##p##0);     \
  a##p##1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b##p + k * kNR + 8), a##p##1);
    PANEL(0) PANEL(1) PANEL(2) PANEL(3)
#undef PANEL
  }
#define STORE(p)                                  \
  _mm256_storeu_ps(c + p * ldc, a##p##0);         \
  _mm256_storeu_ps(c + p * ldc + 8, a##p##1);
  STORE(0) STORE(1) STORE(2) STORE(3)
#undef STORE
}

template <int MR>
void Tiles(const Dense& d, const float* bp, int64_t k0, int64_t kc, float* c, int64_t m0) {
  Tile<MR>(d.x + m0 * d.k + k0, d.k, bp, kc, c + m0 * kNR, k0 > 0);
}

// One block: columns [n0, n0 + 16 * kPB) of y, as panels of 16, through [M, 16] buffers `c`
// (one per panel).  Packing the block's panels together reads W's rows in runs of 512 bytes
// instead of 64 (measured: 1.2-1.5x faster on a [K, N] weight).
void Block(const Dense& d, int64_t block, float* bp, float* c) {
  const int64_t n0 = block * kNB;
  const int64_t panels = std::min(kPB, (d.n - n0 + kNR - 1) / kNR);
  // A last lone row goes 4 panels at a time (RowTile4), the panels past a multiple of 4 alone.
  const int64_t lone = d.m % kMR == 1 ? panels - panels % 4 : 0;
  const bool nan = d.kind == Kind::kU4 && GroupPartsNaN(d, n0, std::min(kNB, d.n - n0));
  for (int64_t k0 = 0; k0 < d.k; k0 += d.kcb) {
    const int64_t kc = std::min(d.kcb, d.k - k0);
    PackBlock(d, k0, kc, n0, panels, nan, bp);
    for (int64_t p = 0; p < lone; p += 4) {
      RowTile4(d.x + (d.m - 1) * d.k + k0, bp + p * d.kcb * kNR, d.kcb * kNR, kc,
               c + (p * d.m + d.m - 1) * kNR, d.m * kNR, k0 > 0);
    }
    for (int64_t p = 0; p < panels; ++p) {
      const float* pp = bp + p * d.kcb * kNR;
      float* cp = c + p * d.m * kNR;
      int64_t m = 0;
      for (; m + kMR <= d.m; m += kMR) Tiles<6>(d, pp, k0, kc, cp, m);
      switch (d.m - m) {
        case 5: Tiles<5>(d, pp, k0, kc, cp, m); break;
        case 4: Tiles<4>(d, pp, k0, kc, cp, m); break;
        case 3: Tiles<3>(d, pp, k0, kc, cp, m); break;
        case 2: Tiles<2>(d, pp, k0, kc, cp, m); break;
        case 1:
          if (p >= lone) Tiles<1>(d, pp, k0, kc, cp, m);
          break;
        default: break;
      }
    }
  }
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t np = n0 + p * kNR, cols = std::min(kNR, d.n - np);
    for (int64_t i = 0; i < d.m; ++i) {
      float* yi = d.y + i * d.n + np;
      const float* ci = c + (p * d.m + i) * kNR;
      for (int64_t j = 0; j < cols; ++j) yi[j] = ci[j] + d.b[np + j];
    }
  }
}

// -- a few rows: a streaming product, no packing ---------------------------------------------
//
// At 1-4 rows a tile does 1-4 multiply-adds per packed value, so packing (widening, a store
// and a reload per weight) is most of the call: at 1 row it ran at a third of the rate memory
// could deliver the codes.  A quantized [K, N] W is then read where it lies: a work
// item is a block of columns; its rows are swept kGemvKC at a time, and within a sweep each
// group of 8 x NV columns loads its accumulators (one 8-float vector per row of x and 8
// columns), runs its k's in order (row k's codes widened in registers exactly as the packing
// widens them, times the scales held in registers, x[m, k] times that added with one fused
// multiply-add) and parks them again.  The block's rows are so read in runs of its whole
// width, row after row (the hardware's prefetchers follow such runs; a group's strip down K
// alone, one line every N bytes, they do not, and its lines alias in L1 when N is a multiple
// of 4 KB), the sweep ahead prefetched.  Each output is 0 + x[m, 0] w[0, n] + x[m, 1] w[1, n]
// + ... in k order, the bias added last, as in the tiles (which park theirs every kKC k's):
// the same bits.

constexpr int64_t kGemvRows = 4;     // M up to this goes this way (measured, see DenseImpl)
constexpr int64_t kGemvKC = 8;       // rows per sweep; prefetched one sweep ahead
constexpr int64_t kGemvWidth = 2048; // columns per work item at most
constexpr int kGemvVecs = 4;         // 8-column vectors per group at most

// Vectors per group (measured): 4 at 1-2 rows of x (32 columns, 4-8 sums in flight), 2 at
// 3-4 (6-8 accumulators: with 4 the 16 registers no longer hold them, x and the codes).
template <int MR>
constexpr int GemvGroupVecs() { return MR <= 2 ? 4 : 2; }

// Rows [k0, k1) of one sweep that share a 4-bit group and half of K (8-bit: the sweep).
struct GemvSpan {
  int64_t k0, k1;
  int64_t group;  // 4 bits: k0 / g
  bool high;      // 4 bits: k0 >= K / 2, the high nibbles
};

// The codes of one row of W for a group of columns, widened and scaled exactly as the packing
// widens them: `Get<mode, v>(k)` is W[k, n0 + 8 v : n0 + 8 v + 8], Get2 that and the next 8.
// `Start(span)` readies a span's rows; `Mode()` picks the loop's variant for them.
template <typename T>
struct ChannelRow {  // int8 (T = int8_t), e4m3 (uint8_t): code * s
  static constexpr int kModes = 1;
  const T* q;              // W[0, n0]
  int64_t ld;              // N
  __m256 s[kGemvVecs];     // the group's scales (e4m3: times kF8Lift)
  ChannelRow(const Dense& d, int64_t n0, int nv) : q(static_cast<const T*>(d.w) + n0), ld(d.n) {
    const __m256 lift = _mm256_set1_ps(std::is_same<T, uint8_t>::value ? kF8Lift : 1.0f);
    for (int v = 0; v < kGemvVecs; ++v) {
      s[v] = v < nv ? _mm256_mul_ps(_mm256_loadu_ps(d.s + n0 + 8 * v), lift) : lift;
    }
  }
  void Start(const GemvSpan&) {}
  int Mode() const { return 0; }
  const char* Ptr(int64_t k) const { return reinterpret_cast<const char*>(q + k * ld); }
  template <int kMode, int V>
  __m256 Get(int64_t k) const {
    return _mm256_mul_ps(Widen8(q + k * ld + 8 * V), s[V]);
  }
  template <int kMode, int V>
  void Get2(int64_t k, __m256& w0, __m256& w1) const {
    Widen16(q + k * ld + 8 * V, w0, w1);  // e4m3: the integer steps on 16 codes at once
    w0 = _mm256_mul_ps(w0, s[V]);
    w1 = _mm256_mul_ps(w1, s[V + 1]);
  }
};

struct GroupRow {  // 4 bits: bf16(bf16(code - z) * s); modes: 1 the high nibbles, 2 a NaN
  static constexpr int kModes = 4;
  const uint8_t* q;    // q4[0, n0]
  const float* s0;     // s4[0, n0]
  const float* z0;     // z4[0, n0]
  int64_t ld, half;
  int nv;
  const uint8_t* row;  // where row k of the span is row + k * ld
  int mode = 0;
  __m256 s[kGemvVecs], z[kGemvVecs];
  GroupRow(const Dense& d, int64_t n0, int nv_)
      : q(static_cast<const uint8_t*>(d.w) + n0), s0(d.s + n0), z0(d.z + n0), ld(d.n),
        half(d.k / 2), nv(nv_), row(q) {}
  // The span's scales and zero points, and whether one is a NaN (then the roundings keep it,
  // as the packing's do for a block with one; elsewhere both variants give the same bits).
  void Start(const GemvSpan& sp) {
    row = sp.high ? q - half * ld : q;
    const float* sg = s0 + sp.group * ld;
    const float* zg = z0 + sp.group * ld;
    int nan = 0;
    for (int v = 0; v < kGemvVecs; ++v) {
      if (v < nv) {
        s[v] = _mm256_loadu_ps(sg + 8 * v);
        z[v] = _mm256_loadu_ps(zg + 8 * v);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(s[v], z[v], _CMP_UNORD_Q));
      } else {
        s[v] = z[v] = _mm256_setzero_ps();
      }
    }
    mode = (sp.high ? 1 : 0) + (nan ? 2 : 0);
  }
  int Mode() const { return mode; }
  const char* Ptr(int64_t k) const { return reinterpret_cast<const char*>(row + k * ld); }
  template <int kMode, int V>
  __m256 Get(int64_t k) const {
    __m256i c = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k * ld + 8 * V)));
    if constexpr ((kMode & 1) != 0) c = _mm256_srli_epi32(c, 4);
    c = _mm256_and_si256(c, _mm256_set1_epi32(15));
    constexpr bool kNaN = (kMode & 2) != 0;
    return RoundBf16<kNaN>(_mm256_mul_ps(
        RoundBf16<kNaN>(_mm256_sub_ps(_mm256_cvtepi32_ps(c), z[V])), s[V]));
  }
  template <int kMode, int V>
  void Get2(int64_t k, __m256& w0, __m256& w1) const {
    w0 = Get<kMode, V>(k);
    w1 = Get<kMode, V + 1>(k);
  }
};

// A group's rows of one sweep (its spans): MR rows of x times NV vectors of columns from n0,
// into the accumulators parked in c (MR rows, ldc apart; zeros if !load), or, if `last`,
// into y = the sums + b.
template <int MR, int NV, typename Row>
inline void GemvRun(const Dense& d, const GemvSpan* spans, int nspans, int64_t n0, Row& row,
                    bool load, float* c, int64_t ldc, bool last) {
  static_assert(MR >= 1 && MR <= kGemvRows && NV >= 1 && NV <= kGemvVecs, "");
  // Named accumulators, not an array (see Tile).
#define GEMV_ROWS(F, v) F(0, v) F(1, v) F(2, v) F(3, v)
#define GEMV_EACH(F) GEMV_ROWS(F, 0) GEMV_ROWS(F, 1) GEMV_ROWS(F, 2) GEMV_ROWS(F, 3)
#define GEMV_DECL(i, v) __m256 a##i##v = _mm256_setzero_ps();
  GEMV_EACH(GEMV_DECL)
#undef GEMV_DECL
#define GEMV_LOAD(i, v) \
  if constexpr (MR > i && NV > v) a##i##v = _mm256_loadu_ps(c + i * ldc + 8 * v);
  if (load) {
    GEMV_EACH(GEMV_LOAD)
  }
#undef GEMV_LOAD
  const float* x0 = d.x;
  const float* x1 = d.x + d.k;
  const float* x2 = d.x + 2 * d.k;
  const float* x3 = d.x + 3 * d.k;
  const int64_t ahead = kGemvKC * d.n;  // the next sweep's row (past W's end: harmless)
#define GEMV_ROWS_W(F, v, w) F(0, v, w) F(1, v, w) F(2, v, w) F(3, v, w)
#define GEMV_FMA(i, v, w) \
  if constexpr (MR > i) a##i##v = _mm256_fmadd_ps(xb##i, w, a##i##v);
#define GEMV_PAIR(v, u)                                   \
  if constexpr (NV > u) {                                 \
    __m256 w0, w1;                                        \
    row.template Get2<kMode, v>(k, w0, w1);               \
    GEMV_ROWS_W(GEMV_FMA, v, w0) GEMV_ROWS_W(GEMV_FMA, u, w1) \
  } else if constexpr (NV > v) {                          \
    const __m256 w0 = row.template Get<kMode, v>(k);      \
    GEMV_ROWS_W(GEMV_FMA, v, w0)                           \
  }
#define GEMV_LOOP(mode)                                                     \
  {                                                                         \
    constexpr int kMode = mode;                                             \
    for (int64_t k = sp.k0; k < sp.k1; ++k) {                               \
      _mm_prefetch(row.Ptr(k) + ahead, _MM_HINT_T0);                        \
      __m256 xb0 = _mm256_broadcast_ss(x0 + k), xb1, xb2, xb3;              \
      if constexpr (MR > 1) xb1 = _mm256_broadcast_ss(x1 + k);              \
      if constexpr (MR > 2) xb2 = _mm256_broadcast_ss(x2 + k);              \
      if constexpr (MR > 3) xb3 = _mm256_broadcast_ss(x3 + k);              \
      (void)xb1;                                                            \
      (void)xb2;                                                            \
      (void)xb3;                                                            \
      GEMV_PAIR(0, 1) GEMV_PAIR(2, 3)                                       \
    }                                                                       \
  }
  for (int i = 0; i < nspans; ++i) {
    const GemvSpan& sp = spans[i];
    row.Start(sp);
    switch (row.Mode()) {
      case 0: GEMV_LOOP(0) break;
      case 1: if constexpr (Row::kModes > 1) GEMV_LOOP(1) break;
      case 2: if constexpr (Row::kModes > 2) GEMV_LOOP(2) break;
      case 3: if constexpr (Row::kModes > 3) GEMV_LOOP(3) break;
      default: break;
    }
  }
#undef GEMV_LOOP
#undef GEMV_PAIR
#undef GEMV_FMA
#undef GEMV_ROWS_W
  const float* b = d.b + n0;
  float* y = d.y + n0;
#define GEMV_STORE(i, v)                                                           \
  if constexpr (MR > i && NV > v) {                                                \
    if (last) {                                                                    \
      _mm256_storeu_ps(y + i * d.n + 8 * v,                                        \
                       _mm256_add_ps(a##i##v, _mm256_loadu_ps(b + 8 * v)));        \
    } else {                                                                       \
      _mm256_storeu_ps(c + i * ldc + 8 * v, a##i##v);                              \
    }                                                                              \
  }
  GEMV_EACH(GEMV_STORE)
#undef GEMV_STORE
#undef GEMV_EACH
#undef GEMV_ROWS
}

// W[k, n] for one of the last columns past the last full vector (the packing's scalar edge).
inline float GemvScalar(const Dense& d, int64_t k, int64_t n) {
  switch (d.kind) {
    case Kind::kS8: return Code(static_cast<const int8_t*>(d.w) + k * d.n, n) * d.s[n];
    case Kind::kF8: return Code(static_cast<const uint8_t*>(d.w) + k * d.n, n) * d.s[n];
    case Kind::kU4: {
      const uint8_t* q = static_cast<const uint8_t*>(d.w);
      const int64_t half = d.k / 2, gi = (k / d.g) * d.n + n;
      const int code = k < half ? q[k * d.n + n] & 15 : q[(k - half) * d.n + n] >> 4;
      return Widen4(static_cast<float>(code), d.z[gi], d.s[gi]);
    }
    case Kind::kF32: break;
  }
  return static_cast<const float*>(d.w)[k * d.n + n];
}

// One sweep (its spans) of columns [n0, n0 + cols): groups of GemvGroupVecs vectors, then
// of 2 and 1, then the last columns one at a time.
template <int MR, typename Row>
void GemvSweep(const Dense& d, const GemvSpan* spans, int nspans, int64_t n0, int64_t cols,
               float* c) {
  const bool load = spans[0].k0 > 0, last = spans[nspans - 1].k1 == d.k;
  int64_t j = 0;
#define GEMV_GROUPS(NV)                                                            \
  for (; j + 8 * (NV) <= cols; j += 8 * (NV)) {                                    \
    Row row(d, n0 + j, NV);                                                        \
    GemvRun<MR, NV>(d, spans, nspans, n0 + j, row, load, c + j, cols, last);       \
  }
  constexpr int G = GemvGroupVecs<MR>();
  GEMV_GROUPS(G)
  if constexpr (G > 2) { GEMV_GROUPS(2) }
  if constexpr (G > 1) { GEMV_GROUPS(1) }
#undef GEMV_GROUPS
  for (; j < cols; ++j) {
    const int64_t n = n0 + j;
    for (int64_t i = 0; i < MR; ++i) {
      float acc = load ? c[i * cols + j] : 0.0f;
      const float* xi = d.x + i * d.k;
      for (int s = 0; s < nspans; ++s) {
        for (int64_t k = spans[s].k0; k < spans[s].k1; ++k) {
          acc = std::fma(xi[k], GemvScalar(d, k, n), acc);
        }
      }
      if (last) {
        d.y[i * d.n + n] = acc + d.b[n];
      } else {
        c[i * cols + j] = acc;
      }
    }
  }
}

// -- The streaming path in 512-bit vectors, for 8-bit codes (where AVX-512 is built) -------
//
// Measured on the 2-core machine (a Xeon with AVX-512): with 256-bit vectors the int8 stream
// is bound by the float pipes, not by memory.  Each 8 codes take a widening, a convert, the
// multiply by the scale and the multiply-add, and one core so reads codes at ~16 GB/s even
// out of L2, where XLA's float32 dot streams its weights from memory at ~34 GB/s on the two.
// A 512-bit vector does the same four steps for 16 codes.  Lane for lane the operations are
// the 256-bit path's (the same widening, the same product rounded once, the same fused
// multiply-add in k order), so the sums are the same bits.  The last columns of a block
// (fewer than 16) are masked loads and stores instead of a scalar loop.
#if PHOTON_GEMV512

// 16 codes (the lanes of `m`; the rest read as 0 and never stored) as float32.
inline __m512 Widen16x(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
#if defined(__F16C__)
// e4m3 codes as float32 times 2^-8 (the 256-bit Widen16's integer steps, on 16 codes).
inline __m512 Widen16x(const uint8_t* p, __mmask16 m) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, p));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  h = _mm256_or_si256(h, _mm256_and_si256(_mm256_add_epi16(h, _mm256_set1_epi16(0x80)),
                                          _mm256_set1_epi16(0x4000)));
  return _mm512_cvtph_ps(h);
}
#else
inline __m512 Widen16x(const uint8_t* p, __mmask16 m) {
  alignas(64) float v[16];
  for (int i = 0; i < 16; ++i) v[i] = (m >> i) & 1 ? kFp8.v[p[i]] : 0.0f;
  return _mm512_load_ps(v);
}
#endif

// Rows [k0, k1) of MR rows of x times NV vectors of 16 columns from n0 (the last one masked
// by `tail`), into the sums parked in c (ldc apart; zeros if !load), or, if `last`, into
// y = the sums + b.
template <int MR, int NV, typename T>
inline void Gemv512Run(const Dense& d, int64_t k0, int64_t k1, int64_t n0, __mmask16 tail,
                       bool load, float* c, int64_t ldc, bool last) {
  static_assert(MR >= 1 && MR <= kGemvRows && NV >= 1 && NV <= 4, "");
  const T* q = static_cast<const T*>(d.w) + n0;
  const __m512 lift = _mm512_set1_ps(std::is_same<T, uint8_t>::value ? kF8Lift : 1.0f);
  auto mask = [&](int v) -> __mmask16 { return v == NV - 1 ? tail : __mmask16(0xFFFF); };
  __m512 s0 = lift, s1 = lift, s2 = lift, s3 = lift;
#define G512_SCALE(v) \
  if constexpr (NV > v) s##v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask(v), d.s + n0 + 16 * v), lift);
  G512_SCALE(0) G512_SCALE(1) G512_SCALE(2) G512_SCALE(3)
#undef G512_SCALE
  // Named accumulators, not an array (see Tile).
#define G512_ROWS(F, v) F(0, v) F(1, v) F(2, v) F(3, v)
#define G512_EACH(F) G512_ROWS(F, 0) G512_ROWS(F, 1) G512_ROWS(F, 2) G512_ROWS(F, 3)
#define G512_DECL(i, v) __m512 a##i##v = _mm512_setzero_ps();
  G512_EACH(G512_DECL)
#undef G512_DECL
#define G512_LOAD(i, v) \
  if constexpr (MR > i && NV > v) a##i##v = _mm512_maskz_loadu_ps(mask(v), c + i * ldc + 16 * v);
  if (load) {
    G512_EACH(G512_LOAD)
  }
#undef G512_LOAD
  const float* x0 = d.x;
  const float* x1 = d.x + d.k;
  const float* x2 = d.x + 2 * d.k;
  const float* x3 = d.x + 3 * d.k;
  const int64_t ahead = kGemvKC * d.n;  // the next sweep's row (past W's end: harmless)
#define G512_FMA(i, v, w) \
  if constexpr (MR > i) a##i##v = _mm512_fmadd_ps(xb##i, w, a##i##v);
#define G512_VEC(v)                                                                   \
  if constexpr (NV > v) {                                                             \
    const __m512 w = _mm512_mul_ps(Widen16x(row + 16 * v, mask(v)), s##v);            \
    G512_FMA(0, v, w) G512_FMA(1, v, w) G512_FMA(2, v, w) G512_FMA(3, v, w)           \
  }
  for (int64_t k = k0; k < k1; ++k) {
    const T* row = q + k * d.n;
    _mm_prefetch(reinterpret_cast<const char*>(row) + ahead, _MM_HINT_T0);
    __m512 xb0 = _mm512_set1_ps(x0[k]), xb1, xb2, xb3;
    if constexpr (MR > 1) xb1 = _mm512_set1_ps(x1[k]);
    if constexpr (MR > 2) xb2 = _mm512_set1_ps(x2[k]);
    if constexpr (MR > 3) xb3 = _mm512_set1_ps(x3[k]);
    (void)xb1;
    (void)xb2;
    (void)xb3;
    G512_VEC(0) G512_VEC(1) G512_VEC(2) G512_VEC(3)
  }
#undef G512_VEC
#undef G512_FMA
  const float* b = d.b + n0;
  float* y = d.y + n0;
#define G512_STORE(i, v)                                                                 \
  if constexpr (MR > i && NV > v) {                                                      \
    if (last) {                                                                          \
      _mm512_mask_storeu_ps(y + i * d.n + 16 * v, mask(v),                               \
                            _mm512_add_ps(a##i##v, _mm512_maskz_loadu_ps(mask(v), b + 16 * v))); \
    } else {                                                                             \
      _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mask(v), a##i##v);                     \
    }                                                                                    \
  }
  G512_EACH(G512_STORE)
#undef G512_STORE
#undef G512_EACH
#undef G512_ROWS
}

// One work item of 8-bit codes: columns [n0, n0 + cols), a sweep of kGemvKC rows at a time,
// each over groups of 64 columns, then 32, then 16, then the last (masked).
template <int MR, typename T>
void Gemv512Block(const Dense& d, int64_t n0, int64_t cols, float* c) {
  const __mmask16 full = 0xFFFF;
  for (int64_t k0 = 0; k0 < d.k; k0 += kGemvKC) {
    const int64_t k1 = std::min(d.k, k0 + kGemvKC);
    const bool load = k0 > 0, last = k1 == d.k;
    int64_t j = 0;
    for (; j + 64 <= cols; j += 64) Gemv512Run<MR, 4, T>(d, k0, k1, n0 + j, full, load, c + j, cols, last);
    if (j + 32 <= cols) {
      Gemv512Run<MR, 2, T>(d, k0, k1, n0 + j, full, load, c + j, cols, last);
      j += 32;
    }
    if (j + 16 <= cols) {
      Gemv512Run<MR, 1, T>(d, k0, k1, n0 + j, full, load, c + j, cols, last);
      j += 16;
    }
    if (j < cols) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (cols - j)) - 1);
      Gemv512Run<MR, 1, T>(d, k0, k1, n0 + j, tail, load, c + j, cols, last);
    }
  }
}

// Whether the 512-bit stream is taken (photon_dense_gemv512): on unless switched off, so that
// one process can run and check the 256-bit stream beside it.  Read once per work item: a
// switch during a call may mix the two streams across its items, which give the same bits.
std::atomic<bool> g_gemv512{true};
#endif  // PHOTON_GEMV512

// One work item: columns [n0, n0 + cols), every k, a sweep at a time; c: its parked sums.
template <int MR>
void GemvBlock(const Dense& d, int64_t n0, int64_t cols, float* c) {
#if PHOTON_GEMV512
  if (g_gemv512.load(std::memory_order_relaxed)) {
    if (d.kind == Kind::kS8) return Gemv512Block<MR, int8_t>(d, n0, cols, c);
    if (d.kind == Kind::kF8) return Gemv512Block<MR, uint8_t>(d, n0, cols, c);
  }
#endif
  GemvSpan spans[kGemvKC];
  const int64_t half = d.k / 2;
  for (int64_t k0 = 0; k0 < d.k; k0 += kGemvKC) {
    const int64_t k1 = std::min(d.k, k0 + kGemvKC);
    int n = 0;
    if (d.kind == Kind::kU4) {  // split where a group or the half of K ends
      for (int64_t k = k0; k < k1; ++n) {
        const int64_t group = k / d.g;
        int64_t e = std::min(k1, (group + 1) * d.g);
        if (k < half) e = std::min(e, half);
        spans[n] = GemvSpan{k, e, group, k >= half};
        k = e;
      }
    } else {
      spans[n++] = GemvSpan{k0, k1, 0, false};
    }
    switch (d.kind) {
      case Kind::kS8: GemvSweep<MR, ChannelRow<int8_t>>(d, spans, n, n0, cols, c); break;
      case Kind::kF8: GemvSweep<MR, ChannelRow<uint8_t>>(d, spans, n, n0, cols, c); break;
      case Kind::kU4: GemvSweep<MR, GroupRow>(d, spans, n, n0, cols, c); break;
      case Kind::kF32: break;
    }
  }
}

// One thread's share of the column blocks (`nb` columns each), with its parked sums.
struct GemvWorker {
  Dense d;
  int64_t nb;
  std::vector<float> buf;

  bool operator()(int64_t item) {
    if (buf.empty()) buf.resize(d.m * nb);
    const int64_t n0 = item * nb, cols = std::min(nb, d.n - n0);
    switch (d.m) {
      case 1: GemvBlock<1>(d, n0, cols, buf.data()); return true;
      case 2: GemvBlock<2>(d, n0, cols, buf.data()); return true;
      case 3: GemvBlock<3>(d, n0, cols, buf.data()); return true;
      case 4: GemvBlock<4>(d, n0, cols, buf.data()); return true;
      default: return false;
    }
  }
};

// Columns per work item: W's width shared among the threads in multiples of 64 (the longer
// a block's rows, the better memory streams them), at most kGemvWidth; 4 bits: also at most
// what keeps a block's half of q4 (read again for the high nibbles) in L2.
int64_t GemvWidth(const Dense& d, int64_t threads) {
  const int64_t nb = std::min(kGemvWidth, ((d.n + threads - 1) / threads + 63) / 64 * 64);
  if (d.kind != Kind::kU4) return nb;
  return std::min(nb, std::max<int64_t>(64, (256 << 10) / (d.k / 2) / 64 * 64));
}

// One thread's share of the blocks, with its own packing and output buffers.
struct DenseWorker {
  Dense d;
  std::vector<float> buf;

  bool operator()(int64_t block) {
    if (buf.empty()) buf.resize(kPB * (kKC + d.m) * kNR);
    Block(d, block, buf.data(), buf.data() + kPB * kKC * kNR);
    return true;
  }
};

#endif  // PHOTON_DENSE_SIMD

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::F32> z,
                     ffi::ResultBuffer<ffi::F32> y, bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || bd.size() != 1 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("dense: x [M,K], w [K,N] or [N,K], b [N], y [M,N]");
  }
  Kind kind;
  switch (w.element_type()) {
    case ffi::F32: kind = Kind::kF32; break;
    case ffi::S8: kind = Kind::kS8; break;
    case ffi::F8E4M3FN: kind = Kind::kF8; break;
    case ffi::U8: kind = Kind::kU4; break;
    default:
      return ffi::Error::InvalidArgument(
          "dense: w must be float32, int8 or float8_e4m3fn codes, or uint8 (4-bit) codes");
  }
  Dense d{x.typed_data(), w.untyped_data(), s.typed_data(), z.typed_data(), b.typed_data(),
          y->typed_data(), xd[0], xd[1], transposed ? wd[0] : wd[1], 0, kKC, transposed, kind};
  // A quantized [K, N] W for a few rows (5-8: fewer are streamed, below) is packed 32 k's
  // deep: the block's 8 panels then stay in L1 (16 KB) from their packing to their tiles
  // instead of going through L2 (measured: 1.35x faster at 1 row, 1.1x at 8, nothing at 13;
  // the [N, K] head loses by it, its packing reading W's rows in shorter runs).  The sums
  // are the same: each output's still runs in k order through its buffer row in c.
  if (kind != Kind::kF32 && !transposed && d.m <= 8) d.kcb = 32;
  const int64_t wk = kind == Kind::kU4 ? 2 * wd[0] : (transposed ? wd[1] : wd[0]);
  if (wk != d.k || bd[0] != d.n || yd[0] != d.m || yd[1] != d.n || d.k <= 0) {
    return ffi::Error::InvalidArgument("dense: inconsistent shapes");
  }
  if ((kind == Kind::kS8 || kind == Kind::kF8) &&
      (s.dimensions().size() != 1 || s.dimensions()[0] != d.n)) {
    return ffi::Error::InvalidArgument("dense: 8-bit codes need scales [N]");
  }
  if (kind == Kind::kU4) {
    auto sd = s.dimensions(), zd = z.dimensions();
    if (transposed || sd.size() != 2 || zd.size() != 2 || sd[0] != zd[0] || sd[1] != d.n ||
        zd[1] != d.n || sd[0] <= 0 || d.k % sd[0]) {
      return ffi::Error::InvalidArgument(
          "dense: 4-bit codes [K/2,N] need scales and zeros [K/g,N] (never transposed)");
    }
    d.g = d.k / sd[0];
  }
  if (d.m == 0 || d.n == 0) return ffi::Error::Success();
#if PHOTON_DENSE_SIMD
  // A quantized [K, N] W at 1-4 rows is streamed (GemvWorker).  Measured on the 2-core
  // machine, [2048, 2048] int8 codes out of cache at 1 row: 0.37-0.45 ms (9-11 GB/s of
  // codes, near what memory delivers) against 1.5 packed; at 5 rows packing wins again for
  // e4m3 and 4 bits, whose widening dominates either way.
  if (kind != Kind::kF32 && !transposed && d.m <= kGemvRows) {
    const int64_t nb = GemvWidth(d, std::max<int64_t>(1, pool.num_threads()));
    const int64_t items = (d.n + nb - 1) / nb;
    photon::ParallelFor(pool, items, items, GemvWorker{d, nb, {}});
    return ffi::Error::Success();
  }
  const int64_t blocks = (d.n + kNB - 1) / kNB;
  photon::ParallelFor(pool, blocks, blocks, DenseWorker{d, {}});
  return ffi::Error::Success();
#else
  (void)pool;
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "dense: built without AVX2 and FMA (photon_dense_simd() is 0); use XLA's "
                    "products");
#endif
}

}  // namespace

// 1 if the tiles above use AVX2 + FMA: only then is this faster than XLA's own products.
extern "C" int photon_dense_simd() { return PHOTON_DENSE_SIMD; }

// 1 if 8-bit codes at 1-4 rows stream in 512-bit vectors (Gemv512Block), 0: in 256-bit ones.
// `on` 0 or 1 switches the 512-bit stream off or on (where it is built) for later calls; -1
// leaves it.  The bits are the same either way: this is for tests and benchmarks.
extern "C" int photon_dense_gemv512(int on) {
#if PHOTON_GEMV512
  if (on >= 0) g_gemv512.store(on != 0);
  return g_gemv512.load() ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhotonDense, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::AnyBuffer>()          // w: floats or codes
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales (float w: empty)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // zeros (else empty)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
