// The decode step's dense layers for XLA:CPU, called from JAX through the XLA FFI
// (photon_jax/kernels/cpukernel.py builds this file with paged_attention.cc and registers both).
//
//   y[M, N] = x[M, K] @ W + b      W [K, N] (a linear layer), or [N, K] with `transposed`
//                                  (the LM head as the engine holds it)
//
// Built only with AVX2 + FMA (x86-64 CPUs since 2013-2015); elsewhere the call fails and
// `photon_dense_simd()` is 0, so Python keeps XLA's products (cpukernel.dense_fast).
//
// Why: a decode step multiplies a few rows (M = the batch, up to 32 or so) by every weight
// matrix.  XLA:CPU runs these skinny float32 products at 15-25 GFLOP/s on the 2-core
// machine we measure on, about a third of what the same cores do on a large product, and at
// 32 rows they are most of the step.  Here a work item is a block of 128 columns of W:
// its 8 panels of 16 columns are copied, 256 k's at a time, into one contiguous buffer (W's
// rows are N floats apart, which would put every k of a panel in the same few L1 sets; 8
// panels at once read each row of W in 512-byte runs), and register-blocked 6 x 16 tiles
// run over each panel: each W element is read from memory once per call, x stays in cache.
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

#include <algorithm>
#include <cstdint>
#include <cstring>
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

struct Dense {
  const float* x;
  const float* w;
  const float* b;
  float* y;
  int64_t m, k, n;
  bool transposed;
};

// Everything below to DenseImpl needs AVX2 + FMA; other CPUs keep XLA's products.
#if PHOTON_DENSE_SIMD

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

// dst[i * ld + j] = src[j * lds + i] for an 8 x 8 block (the head's [N, K] rows -> columns).
inline void Transpose8(const float* src, int64_t lds, float* dst, int64_t ld) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
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

// W[k0:k0+kc, n0:n0+cols] as bp[kc, 16], columns past `cols` zero.
void Pack(const Dense& d, int64_t k0, int64_t kc, int64_t n0, int64_t cols, float* bp) {
  if (d.transposed && cols == kNR) {  // in 8 x 8 blocks; a scalar tail of k
    const int64_t k8 = kc - kc % 8;
    for (int64_t jb = 0; jb < kNR; jb += 8) {
      const float* src = d.w + (n0 + jb) * d.k + k0;
      for (int64_t k = 0; k < k8; k += 8) Transpose8(src + k, d.k, bp + k * kNR + jb, kNR);
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t k = k8; k < kc; ++k) bp[k * kNR + jb + j] = src[j * d.k + k];
    }
    return;
  }
  if (d.transposed) {  // W [N, K]: each of the panel's rows is contiguous in k
    for (int64_t j = 0; j < kNR; ++j) {
      if (j < cols) {
        const float* src = d.w + (n0 + j) * d.k + k0;
        for (int64_t k = 0; k < kc; ++k) bp[k * kNR + j] = src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) bp[k * kNR + j] = 0.0f;
      }
    }
  } else if (cols == kNR) {
    for (int64_t k = 0; k < kc; ++k) {
      std::memcpy(bp + k * kNR, d.w + (k0 + k) * d.n + n0, kNR * sizeof(float));
    }
  } else {
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = d.w + (k0 + k) * d.n + n0;
      for (int64_t j = 0; j < kNR; ++j) bp[k * kNR + j] = j < cols ? src[j] : 0.0f;
    }
  }
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
  for (int64_t k0 = 0; k0 < d.k; k0 += kKC) {
    const int64_t kc = std::min(kKC, d.k - k0);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t np = n0 + p * kNR;
      Pack(d, k0, kc, np, std::min(kNR, d.n - np), bp + p * kKC * kNR);
    }
    for (int64_t p = 0; p < panels; ++p) {
      const float* pp = bp + p * kKC * kNR;
      float* cp = c + p * d.m * kNR;
      int64_t m = 0;
      for (; m + kMR <= d.m; m += kMR) Tiles<6>(d, pp, k0, kc, cp, m);
      switch (d.m - m) {
        case 5: Tiles<5>(d, pp, k0, kc, cp, m); break;
        case 4: Tiles<4>(d, pp, k0, kc, cp, m); break;
        case 3: Tiles<3>(d, pp, k0, kc, cp, m); break;
        case 2: Tiles<2>(d, pp, k0, kc, cp, m); break;
        case 1: Tiles<1>(d, pp, k0, kc, cp, m); break;
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

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> y, bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || bd.size() != 1 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("dense: x [M,K], w [K,N] or [N,K], b [N], y [M,N]");
  }
  Dense d{x.typed_data(), w.typed_data(), b.typed_data(), y->typed_data(),
          xd[0], xd[1], transposed ? wd[0] : wd[1], transposed};
  if ((transposed ? wd[1] : wd[0]) != d.k || bd[0] != d.n || yd[0] != d.m || yd[1] != d.n ||
      d.k <= 0) {
    return ffi::Error::InvalidArgument("dense: inconsistent shapes");
  }
  if (d.m == 0 || d.n == 0) return ffi::Error::Success();
#if PHOTON_DENSE_SIMD
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhotonDense, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
