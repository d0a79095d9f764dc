// Paged decode attention for XLA:CPU, called from JAX through the XLA FFI
// (photon_jax/kernels/cpukernel.py builds this file and registers the handler).
//
// One query position per row against that row's own KV pages, found through its page
// table, up to its own length: every K and V element a row attends is read once, where it
// lies in the pool, and nothing else is read.  This is what the Pallas paged-attention
// kernel does on GPU; XLA:CPU has no Pallas lowering, and its batched products over the
// pool run at about half this machine's read rate (bench/kv.py), so the CPU gets this.
//
// Shapes (the pool layout of photon_jax/engine/kvpool.py, one arena):
//   q      [R, N, H]  float32   queries, head n reads kv head n / (N / K)
//   k, v   [K, P, B, H]         float32, bfloat16, int8 or float8_e4m3fn pool pages (e4m3
//                               also as uint8: its bytes, how a CPU pool stores it)
//   ks, vs [K, P, B]  float32   per-position scales of 8-bit pages (value = code * scale;
//                               ignored, and may be empty, for float32 / bfloat16 pages)
//   table  [R, M]     int32     a row's pages in logical order (page j = positions jB..jB+B-1)
//   length [R]        int32     positions a row attends (0: the row is padding)
//   out    [R, N, H]  float32
// Attribute `scale`: multiplies q.k (1 / sqrt(H)).
//
// Numerics: scores and the softmax in float32, one online-softmax pass over the row's
// pages in logical order (running max, rescaled sum and output), the division last; exp is
// our own (`ExpNonPositive`, about 1 ulp), products are fused multiply-adds.  An 8-bit
// page's scales are applied once per position (to the score and to the softmax weight),
// not per element.  Work items are (row, kv head) pairs shared out to XLA's intra-op
// threads (parallel.h).
//
// 8-bit pages are widened in registers as they are read (`AttendVec`): at a quarter of
// float32's bytes the kernel would otherwise be bound by its arithmetic, not the memory
// (bench/pipeline.py --kv-dtype compares the decode step with each pool).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 64;  // query heads per kv head (Moondream: 1)

inline float Load(const float* p, int64_t i) { return p[i]; }

inline float Load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float8_e4m3fn bytes: a distinct type for overloading (widened by Fp8ToFloat below).
struct Fp8 {
  uint8_t bits;
};

// float8_e4m3fn -> float32 by arithmetic, so the widening loop vectorizes (a 256-entry table
// lookup is a gather per element, which the compiler leaves scalar).  e4m3: sign, 4 exponent
// bits (bias 7), 3 mantissa bits.  A normal code (e > 0) is the float32 with exponent
// e - 7 + 127 and the mantissa bits on top: its 7 magnitude bits shifted up by 20 plus 120
// in the exponent field.  A subnormal (e = 0) is m * 2^-9, computed as such (never through
// a float32 denormal, which XLA's threads may flush to zero).  S.1111.111 (NaN in e4m3)
// decodes as 480: the quantizer clips to 448 and never writes it.
// Branch-free (a select by mask) so that the loop around it vectorizes.
inline float Fp8ToFloat(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t normal = (mag << 20) + (120u << 23);
  const float sub = static_cast<float>(mag) * (1.0f / 512.0f);
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub));
  const uint32_t is_normal = 0u - static_cast<uint32_t>(mag > 7u);
  const uint32_t bits = ((normal & is_normal) | (sub_bits & ~is_normal)) | sign;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// An element of a page as float32, read where it lies (no widened copy of the page: the
// 8-bit pools are read at a quarter of float32's bytes only if nothing is written back).
// kScaled: the type's codes carry a per-position scale (value = code * scale), which the
// attention applies once per position -- to the score (q . k_code) * s_k and to the
// weight p * s_v -- instead of once per element.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr bool kScaled = false;
  static float At(const float* p, int64_t i) { return p[i]; }
};

template <>
struct Elem<uint16_t> {  // bfloat16 bits: widening is exact
  static constexpr bool kScaled = false;
  static float At(const uint16_t* p, int64_t i) { return Load(p, i); }
};

template <>
struct Elem<int8_t> {
  static constexpr bool kScaled = true;
  static float At(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
};

template <>
struct Elem<Fp8> {
  static constexpr bool kScaled = true;
  static float At(const Fp8* p, int64_t i) { return Fp8ToFloat(p[i].bits); }
};

// exp(x) for the softmax, where x = score - running max <= 0: Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial for e^r (Cephes' expf
// coefficients, about 1 ulp) times 2^n built in the exponent bits.  std::exp is a libm call
// per element that no loop around it vectorizes, and at head dim 64 with 8-bit pages the
// calls cost a quarter of the kernel.  Below -87.3 (e^x under float32's smallest normal,
// and -inf: the first page's correction) the result is 0.
inline float ExpNonPositive(float x) {
  const float lo = -87.3365f;
  const float xc = std::max(x, lo);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float y = 1.9875691500e-4f;
  y = std::fma(y, r, 1.3981999507e-3f);
  y = std::fma(y, r, 8.3334519073e-3f);
  y = std::fma(y, r, 4.1665795894e-2f);
  y = std::fma(y, r, 1.6666665459e-1f);
  y = std::fma(y, r, 5.0000001201e-1f);
  y = std::fma(y, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < lo ? 0.0f : y * two_n;
}

struct Shapes {
  int64_t rows, heads, kv_heads, group, dim, pages, page_size, table_width;
};

// One (row, kv head): the attention of that kv head's `group` query heads, element by
// element (any head dim; `AttendVec` below is the fast path when it is a multiple of 8).
// False if the row's table names a page outside the pool (the call then fails).
template <typename T>
bool AttendScalar(const Shapes& s, const float* q, const T* k, const T* v, const float* ks,
               const float* vs, const int32_t* table, const int32_t* length, float* out,
               float scale, int64_t item,
               std::vector<float>& scratch) {
  const int64_t r = item / s.kv_heads, kh = item % s.kv_heads;
  const int64_t g_n = s.group, h = s.dim, ps = s.page_size;
  const float* q_r = q + (r * s.heads + kh * g_n) * h;
  float* o = out + (r * s.heads + kh * g_n) * h;
  std::fill(o, o + g_n * h, 0.0f);
  int64_t len = std::min<int64_t>(length[r], s.table_width * ps);
  if (len <= 0) return true;

  float* sc = scratch.data();  // scores [group, page_size]
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < g_n; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  const int64_t page_elems = ps * h;
  const int64_t head_stride = s.pages * page_elems;
  const int64_t n_pages = (len + ps - 1) / ps;
  for (int64_t j = 0; j < n_pages; ++j) {
    const int64_t page = table[r * s.table_width + j];
    if (page < 0 || page >= s.pages) return false;  // a bookkeeping bug: reported
    const int64_t n = std::min<int64_t>(ps, len - j * ps);
    const int64_t at = kh * head_stride + page * page_elems;
    // The page's scales (8-bit pools only).
    const int64_t at_s = (kh * s.pages + page) * ps;
    const T* kp = k + at;
    for (int64_t g = 0; g < g_n; ++g) {
      const float* qg = q_r + g * h;
      float* sg = sc + g * ps;
      // Four positions' dot products in one pass over d: four independent accumulator
      // chains (one position's sum alone waits on its adds' latency; at head dim 64 that,
      // not the memory, bounded the step).  Each position's sum keeps its own order.
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
        const T* k0 = kp + t * h;
        const T *k1 = k0 + h, *k2 = k1 + h, *k3 = k2 + h;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t d = 0; d < h; ++d) {
          const float qd = qg[d];
          a0 = std::fma(qd, Elem<T>::At(k0, d), a0);
          a1 = std::fma(qd, Elem<T>::At(k1, d), a1);
          a2 = std::fma(qd, Elem<T>::At(k2, d), a2);
          a3 = std::fma(qd, Elem<T>::At(k3, d), a3);
        }
        sg[t] = a0;
        sg[t + 1] = a1;
        sg[t + 2] = a2;
        sg[t + 3] = a3;
      }
      for (; t < n; ++t) {
        const T* kt = kp + t * h;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < h; ++d) acc = std::fma(qg[d], Elem<T>::At(kt, d), acc);
        sg[t] = acc;
      }
      float top = m[g];
      for (t = 0; t < n; ++t) {
        if constexpr (Elem<T>::kScaled) {
          sg[t] *= ks[at_s + t] * scale;
        } else {
          sg[t] *= scale;
        }
        top = std::max(top, sg[t]);
      }
      const float corr = ExpNonPositive(m[g] - top);  // 0 on the first page (m = -inf)
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = ExpNonPositive(sg[t] - top);
        sum += sg[t];
      }
      l[g] = l[g] * corr + sum;
      m[g] = top;
      float* og = o + g * h;
      if (corr != 1.0f) {
#pragma omp simd
        for (int64_t d = 0; d < h; ++d) og[d] *= corr;
      }
    }
    const T* vp = v + at;
    for (int64_t g = 0; g < g_n; ++g) {
      float* sg = sc + g * ps;
      if constexpr (Elem<T>::kScaled) {
        for (int64_t t = 0; t < n; ++t) sg[t] *= vs[at_s + t];
      }
      float* og = o + g * h;
      // Four positions per pass over the output row: it is loaded and stored once per four
      // instead of per position.  Each element still adds p_t * v_t in position order.
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
        const T* v0 = vp + t * h;
        const T *v1 = v0 + h, *v2 = v1 + h, *v3 = v2 + h;
        const float p0 = sg[t], p1 = sg[t + 1], p2 = sg[t + 2], p3 = sg[t + 3];
#pragma omp simd
        for (int64_t d = 0; d < h; ++d) {
          float acc = og[d];
          acc = std::fma(p0, Elem<T>::At(v0, d), acc);
          acc = std::fma(p1, Elem<T>::At(v1, d), acc);
          acc = std::fma(p2, Elem<T>::At(v2, d), acc);
          acc = std::fma(p3, Elem<T>::At(v3, d), acc);
          og[d] = acc;
        }
      }
      for (; t < n; ++t) {
        const T* vt = vp + t * h;
        const float p = sg[t];
#pragma omp simd
        for (int64_t d = 0; d < h; ++d) og[d] = std::fma(p, Elem<T>::At(vt, d), og[d]);
      }
    }
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    float* og = o + g * h;
#pragma omp simd
    for (int64_t d = 0; d < h; ++d) og[d] *= inv;
  }
  return true;
}

// ---- The vectorized path: head dims that are a multiple of 8 (Moondream's are 64) -------
//
// Written with GCC/Clang vector extensions (8 floats per vector: AVX2 or AVX-512 registers
// on x86, two NEON registers on Arm), not intrinsics, so it builds on any CPU the compiler
// targets.  Per page and query head:
//   scores  eight positions at a time, each with its own accumulator vector over d (eight
//           independent FMA chains: one position's chain alone waits on the FMA latency,
//           which at head dim 64 bounded the kernel, not the memory);
//   softmax exp over eight scores at a time (`Exp8`, no libm call);
//   values  the output row in registers, eight vectors (64 floats) at a time, each position
//           adding p_t * v_t in position order.
// 8-bit codes are widened in registers: a page is read once, at one byte per element.

typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef uint32_t U8 __attribute__((vector_size(32)));

// Eight elements at p as float32 vectors, by pool type.
inline F8 Widen8(const float* p) {
  F8 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline F8 Widen8(const uint16_t* p) {  // bfloat16: the 16 bits on top of a float32
  typedef uint16_t H8 __attribute__((vector_size(16)));
  H8 b;
  std::memcpy(&b, p, sizeof(b));
  return (F8)(__builtin_convertvector(b, U8) << 16);
}

// Eight bytes as int32 lanes (signed or not, as B is).  GCC (12) widens a vector of 8
// bytes one lane at a time, so x86 gets the one instruction that does it.
template <typename B>
inline auto Bytes8(const B* p) {
  using V = std::conditional_t<std::is_signed_v<B>, I8, U8>;
#if defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_signed_v<B>) {
    return (V)_mm256_cvtepi8_epi32(b);
  } else {
    return (V)_mm256_cvtepu8_epi32(b);
  }
#else
  V x;
  for (int i = 0; i < 8; ++i) x[i] = p[i];
  return x;
#endif
}

inline F8 Widen8(const int8_t* p) { return __builtin_convertvector(Bytes8(p), F8); }

// e4m3, eight at a time, as value * 2^-8 (`kWiden` puts the 2^8 back into the position's
// scale, exactly: a power of two).  Where the CPU converts half floats (F16C, x86 since
// 2012), the byte sign-extended to 16 bits and shifted up 7 is the float16 whose 4 exponent
// bits and 3 mantissa bits are e4m3's (bit 14, a copy of the sign, cleared): float16's bias
// is 8 more than e4m3's, so that is the value times 2^-8, subnormals included, and the
// hardware widens it to float32 exactly (float16 denormal inputs are not subject to the
// flush-to-zero mode XLA's threads may run in).  Elsewhere, the arithmetic of Fp8ToFloat
// on whole vectors: a subnormal code decoded as the normal float32 2^-6 * (1 + m/8) minus
// 2^-6 (= m * 2^-9, exact), so no lane takes another path and no float32 denormal appears.
inline F8 Widen8(const Fp8* p) {
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7),
                                  _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return (F8)_mm256_cvtph_ps(h);
#else
  const U8 u = Bytes8(reinterpret_cast<const uint8_t*>(p));
  const U8 mag = u & 0x7fu;
  const U8 sub = (U8)(mag < 8u);  // all ones for a subnormal code: 120 - sub = 121
  const F8 f = (F8)((mag << 20) + ((120u - sub) << 23));
  const F8 lift = (F8)(sub & 0x3c800000u);  // 2^-6 where subnormal, +0.0 elsewhere
  return (F8)((U8)(f - lift) | ((u & 0x80u) << 24)) * (1.0f / 256.0f);
#endif
}

// What Widen8 leaves out of a type's values (folded into its scales): 2^8 for e4m3.
template <typename T>
constexpr float kWiden = 1.0f;
template <>
constexpr float kWiden<Fp8> = 256.0f;

inline float Sum8(F8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// ExpNonPositive on eight values (x <= 0): the same reduction and polynomial, with n
// rounded to nearest by the 1.5 * 2^23 shift (exact for |n| < 2^22), so it vectorizes.
inline F8 Exp8(F8 x) {
  const float lo = -87.3365f;
  const I8 below = (I8)(x < lo);  // all ones where x < lo (bitwise selects: no vector ?:,
                                  // which not every compiler takes)
  const F8 xc = (F8)((below & (I8)(F8{} + lo)) | (~below & (I8)x));
  const float shift = 12582912.0f;  // 1.5 * 2^23
  const F8 n = (xc * 1.44269504088896341f + shift) - shift;
  F8 r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  F8 y = 1.9875691500e-4f + 0.0f * r;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const F8 two_n = (F8)((__builtin_convertvector(n, I8) + 127) << 23);
  return (F8)(~below & (I8)(y * two_n));
}

// o[0:C*8] += sum over t < n of p[t] * v_t[0:C*8] (v_t = vp + t * h), in position order,
// the C output vectors held in registers across the page.
template <int C, typename T>
inline void AddValues(float* o, const T* vp, int64_t h, const float* p, int64_t n) {
  F8 acc[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) std::memcpy(&acc[c], o + 8 * c, sizeof(F8));
  for (int64_t t = 0; t < n; ++t) {
    const F8 pt = F8{} + p[t];
    const T* vt = vp + t * h;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] += pt * Widen8(vt + 8 * c);
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) std::memcpy(o + 8 * c, &acc[c], sizeof(F8));
}

// sg[t] = q . k_t for the P positions t0..t0+P-1 (k_t = kp + t * h), one accumulator each.
template <int P, typename T>
inline void Scores(const float* q, const T* kp, int64_t h, int64_t t0, float* sg) {
  F8 acc[P] = {};
  for (int64_t d = 0; d < h; d += 8) {
    const F8 qd = Widen8(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < P; ++i) acc[i] += qd * Widen8(kp + (t0 + i) * h + d);
  }
#pragma GCC unroll 8
  for (int i = 0; i < P; ++i) sg[t0 + i] = Sum8(acc[i]);
}

// As AttendScalar, for head dims that are a multiple of 8.
template <typename T>
bool AttendVec(const Shapes& s, const float* q, const T* k, const T* v, const float* ks,
               const float* vs, const int32_t* table, const int32_t* length, float* out,
               float scale, int64_t item, std::vector<float>& scratch) {
  constexpr bool kScaled = Elem<T>::kScaled;
  const int64_t r = item / s.kv_heads, kh = item % s.kv_heads;
  const int64_t g_n = s.group, h = s.dim, ps = s.page_size;
  const float* q_r = q + (r * s.heads + kh * g_n) * h;
  float* o = out + (r * s.heads + kh * g_n) * h;
  std::fill(o, o + g_n * h, 0.0f);
  const int64_t len = std::min<int64_t>(length[r], s.table_width * ps);
  if (len <= 0) return true;

  const int64_t ps8 = (ps + 7) / 8 * 8;
  float* sc = scratch.data();  // scores [group, page_size rounded up to 8]
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < g_n; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  const int64_t page_elems = ps * h;
  const int64_t n_pages = (len + ps - 1) / ps;
  for (int64_t j = 0; j < n_pages; ++j) {
    const int64_t page = table[r * s.table_width + j];
    if (page < 0 || page >= s.pages) return false;  // a bookkeeping bug: reported
    const int64_t n = std::min<int64_t>(ps, len - j * ps);
    const int64_t at = (kh * s.pages + page) * page_elems;
    const float* ksp = ks + (kh * s.pages + page) * ps;  // the page's scales (8-bit only)
    const float* vsp = vs + (kh * s.pages + page) * ps;
    const T* kp = k + at;
    const T* vp = v + at;
    for (int64_t g = 0; g < g_n; ++g) {
      const float* qg = q_r + g * h;
      float* sg = sc + g * ps8;
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) Scores<8>(qg, kp, h, t, sg);
      for (; t + 4 <= n; t += 4) Scores<4>(qg, kp, h, t, sg);
      for (; t < n; ++t) Scores<1>(qg, kp, h, t, sg);
      float top = m[g];
      for (t = 0; t < n; ++t) {
        sg[t] *= kScaled ? ksp[t] * (scale * kWiden<T>) : scale;
        top = std::max(top, sg[t]);
      }
      for (; t < ps8; ++t) sg[t] = -std::numeric_limits<float>::infinity();  // exp: 0
      F8 sum8 = {};
      for (t = 0; t < ps8; t += 8) {
        F8 x;
        std::memcpy(&x, sg + t, sizeof(x));
        x = Exp8(x - top);
        sum8 += x;
        std::memcpy(sg + t, &x, sizeof(x));
      }
      const float corr = ExpNonPositive(m[g] - top);  // 0 on the first page (m = -inf)
      l[g] = l[g] * corr + Sum8(sum8);
      m[g] = top;
      float* og = o + g * h;
      if (corr != 1.0f) {
        for (int64_t d = 0; d < h; ++d) og[d] *= corr;
      }
      if (kScaled) {
        for (t = 0; t < n; ++t) sg[t] *= vsp[t] * kWiden<T>;
      }
      int64_t d = 0;
      for (; d + 64 <= h; d += 64) AddValues<8>(og + d, vp + d, h, sg, n);
      for (; d + 32 <= h; d += 32) AddValues<4>(og + d, vp + d, h, sg, n);
      for (; d < h; d += 8) AddValues<1>(og + d, vp + d, h, sg, n);
    }
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    float* og = o + g * h;
    for (int64_t d = 0; d < h; ++d) og[d] *= inv;
  }
  return true;
}

template <typename T>
bool AttendOne(const Shapes& s, const float* q, const T* k, const T* v, const float* ks,
               const float* vs, const int32_t* table, const int32_t* length, float* out,
               float scale, int64_t item, std::vector<float>& scratch) {
  if (s.dim % 8 == 0) {
    return AttendVec(s, q, k, v, ks, vs, table, length, out, scale, item, scratch);
  }
  return AttendScalar(s, q, k, v, ks, vs, table, length, out, scale, item, scratch);
}

// One thread's share of the (row, kv head) items, with its own scratch: scores
// [group, page_size].
template <typename T>
struct AttendWorker {
  Shapes s;
  const float* q;
  const T* k;
  const T* v;
  const float* ks;
  const float* vs;
  const int32_t* table;
  const int32_t* length;
  float* out;
  float scale;
  std::vector<float> scratch;

  bool operator()(int64_t item) {
    if (scratch.empty()) scratch.resize(s.group * ((s.page_size + 7) / 8 * 8));
    return AttendOne(s, q, k, v, ks, vs, table, length, out, scale, item, scratch);
  }
};

template <typename T>
ffi::Error Attend(ffi::ThreadPool pool, const Shapes& s, const float* q, const T* k,
                  const T* v, const int32_t* table, const int32_t* length, float* out,
                  float scale, const float* ks = nullptr, const float* vs = nullptr) {
  const int64_t items = s.rows * s.kv_heads;
  // Enough items per thread that scheduling stays small next to the work.
  if (!photon::ParallelFor(pool, items, items / 2,
                           AttendWorker<T>{s, q, k, v, ks, vs, table, length, out, scale, {}})) {
    return ffi::Error::InvalidArgument("paged attention: a page table names a page outside "
                                       "the pool");
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> vs,
                          ffi::Buffer<ffi::S32> table,
                          ffi::Buffer<ffi::S32> length, ffi::ResultBuffer<ffi::F32> out,
                          float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || v.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("paged attention: q [R,N,H], k/v [K,P,B,H], table [R,M]");
  }
  Shapes s{qd[0], qd[1], kd[0], 0, qd[2], kd[1], kd[2], td[1]};
  if (s.kv_heads <= 0 || s.heads % s.kv_heads || kd[3] != s.dim || td[0] != s.rows ||
      length.dimensions()[0] != s.rows || k.element_type() != v.element_type()) {
    return ffi::Error::InvalidArgument("paged attention: inconsistent shapes or dtypes");
  }
  s.group = s.heads / s.kv_heads;
  if (s.group > kMaxGroup) {
    return ffi::Error::InvalidArgument("paged attention: more than 64 query heads per kv head");
  }
  const float* qp = q.typed_data();
  const int32_t* tp = table.typed_data();
  const int32_t* lp = length.typed_data();
  float* op = out->typed_data();
  switch (k.element_type()) {
    case ffi::F32:
      return Attend(pool, s, qp, k.typed_data<float>(), v.typed_data<float>(), tp, lp, op,
                    scale);
    case ffi::BF16:
    case ffi::U16:  // bfloat16 bits (`kvpool`: XLA:CPU pools keep bfloat16 as uint16)
      return Attend(pool, s, qp, static_cast<const uint16_t*>(k.untyped_data()),
                    static_cast<const uint16_t*>(v.untyped_data()), tp, lp, op, scale);
    case ffi::S8:
    case ffi::U8:
    case ffi::F8E4M3FN: {
      const int64_t n_scales = s.kv_heads * s.pages * s.page_size;
      if (ks.element_count() != n_scales || vs.element_count() != n_scales) {
        return ffi::Error::InvalidArgument("paged attention: 8-bit k/v need scales [K,P,B]");
      }
      if (k.element_type() == ffi::S8) {
        return Attend(pool, s, qp, static_cast<const int8_t*>(k.untyped_data()),
                      static_cast<const int8_t*>(v.untyped_data()), tp, lp, op, scale,
                      ks.typed_data(), vs.typed_data());
      }
      return Attend(pool, s, qp, static_cast<const Fp8*>(k.untyped_data()),
                    static_cast<const Fp8*>(v.untyped_data()), tp, lp, op, scale,
                    ks.typed_data(), vs.typed_data());
    }
    default:
      return ffi::Error::InvalidArgument(
          "paged attention: k/v must be float32, bfloat16, int8 or float8_e4m3fn");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhotonPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
