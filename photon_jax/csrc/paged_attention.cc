// Paged decode attention for XLA:CPU, called from JAX through the XLA FFI
// (photon_jax/cpukernel.py builds this file and registers the handler).
//
// One query position per row against that row's own KV pages, found through its page
// table, up to its own length: every K and V element a row attends is read once, where it
// lies in the pool, and nothing else is read.  This is what the Pallas paged-attention
// kernel does on GPU; XLA:CPU has no Pallas lowering, and its batched products over the
// pool run at about half this machine's read rate (bench/kv.py), so the CPU gets this.
//
// Shapes (the pool layout of photon_jax/kvpool.py, one arena):
//   q      [R, N, H]  float32   queries, head n reads kv head n / (N / K)
//   k, v   [K, P, T, H]         float32, bfloat16, int8 or float8_e4m3fn pool pages (e4m3
//                               also as uint8: its bytes, how a CPU pool stores it)
//   ks, vs [K, P, T]  float32   per-position scales of 8-bit pages (value = code * scale;
//                               ignored, and may be empty, for float32 / bfloat16 pages)
//   table  [R, M]     int32     a row's pages in logical order (page j = positions jT..jT+T-1)
//   length [R]        int32     positions a row attends (0: the row is padding)
//   out    [R, N, H]  float32
// Attribute `scale`: multiplies q.k (1 / sqrt(H)).
//
// Numerics: scores and the softmax in float32, one online-softmax pass over the row's
// pages in logical order (running max, rescaled sum and output), the division last.
// Work items are (row, kv head) pairs shared out to XLA's intra-op threads (parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// Rows [t0, t0 + n) of a page, as float32: a pointer into the page itself (float32 pools)
// or into `buf` after widening (bfloat16 pools; 8-bit pools: code times its position's
// scale, `sc` pointing at the page's scales).
inline const float* Rows(const float* page, const float*, int64_t h, int64_t, float*) {
  return page;
}

inline const float* Rows(const uint16_t* page, const float*, int64_t h, int64_t n,
                         float* buf) {
  for (int64_t i = 0; i < n * h; ++i) buf[i] = Load(page, i);
  return buf;
}

inline const float* Rows(const int8_t* page, const float* sc, int64_t h, int64_t n,
                         float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    const float s = sc[t];
#pragma omp simd
    for (int64_t d = 0; d < h; ++d) buf[t * h + d] = static_cast<float>(page[t * h + d]) * s;
  }
  return buf;
}

inline const float* Rows(const Fp8* page, const float* sc, int64_t h, int64_t n, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    const float s = sc[t];
#pragma omp simd
    for (int64_t d = 0; d < h; ++d) buf[t * h + d] = Fp8ToFloat(page[t * h + d].bits) * s;
  }
  return buf;
}

struct Shapes {
  int64_t rows, heads, kv_heads, group, dim, pages, page_size, table_width;
};

// One (row, kv head): the attention of that kv head's `group` query heads.
// False if the row's table names a page outside the pool (the call then fails).
template <typename T>
bool AttendOne(const Shapes& s, const float* q, const T* k, const T* v, const float* ks,
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

  // scratch: scores [group, page_size], then two page buffers (bf16 widening).
  float* sc = scratch.data();
  float* kbuf = sc + g_n * ps;
  float* vbuf = kbuf + ps * h;
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
    // The page's scales (8-bit pools only: float32 / bfloat16 Rows ignore the pointer).
    const int64_t at_s = (kh * s.pages + page) * ps;
    const float* kp = Rows(k + at, ks + at_s, h, n, kbuf);
    for (int64_t g = 0; g < g_n; ++g) {
      const float* qg = q_r + g * h;
      float* sg = sc + g * ps;
      float top = m[g];
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kp + t * h;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < h; ++d) acc += qg[d] * kt[d];
        sg[t] = acc * scale;
        top = std::max(top, sg[t]);
      }
      const float corr = std::exp(m[g] - top);  // exp(-inf) = 0 on the first page
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = std::exp(sg[t] - top);
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
    const float* vp = Rows(v + at, vs + at_s, h, n, vbuf);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = vp + t * h;
      for (int64_t g = 0; g < g_n; ++g) {
        const float p = sc[g * ps + t];
        float* og = o + g * h;
#pragma omp simd
        for (int64_t d = 0; d < h; ++d) og[d] += p * vt[d];
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

// One thread's share of the (row, kv head) items, with its own scratch: scores
// [group, page_size], then two page buffers (bf16 widening).
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
    if (scratch.empty()) scratch.resize(s.group * s.page_size + 2 * s.page_size * s.dim);
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
    return ffi::Error::InvalidArgument("paged attention: q [R,N,H], k/v [K,P,T,H], table [R,M]");
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
      return Attend(pool, s, qp, static_cast<const uint16_t*>(k.untyped_data()),
                    static_cast<const uint16_t*>(v.untyped_data()), tp, lp, op, scale);
    case ffi::S8:
    case ffi::U8:
    case ffi::F8E4M3FN: {
      const int64_t n_scales = s.kv_heads * s.pages * s.page_size;
      if (ks.element_count() != n_scales || vs.element_count() != n_scales) {
        return ffi::Error::InvalidArgument("paged attention: 8-bit k/v need scales [K,P,T]");
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
