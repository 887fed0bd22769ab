// Few-row products over packed weights for XLA:CPU, called through XLA's FFI
// (rlx.quant.cpu_kernels builds, loads and registers this file).
//
// y[R, N] = x[R, K] @ W for a decode step's few f32 rows, W packed as rlx stores it:
//   rlx_gguf_q8_0 / _q4_0 / _q4_1: planar GGUF rows [N, nb * bytes] (each row's f16 headers of
//     all its blocks first, Q4_1's d then m, then the 32 int8 / 16 nibble bytes of each block;
//     nibble j of byte i is element 16 j + i of its block), y = x @ W^T;
//   rlx_int8_channel: int8 values [K, N] with one f32 scale per output, y = (x @ V) * s.
//
// Numerics: activations stay f32. Each block's weights are decoded to f32 exactly as the
// dequantization does (Q8_0 d q; Q4_0 d (q - 8) = fma(d, q, -8 d), exact; Q4_1 fma(d, q, m) =
// fl(d q + m) since d q is exact), then multiplied and summed in f32 with FMAs in another order
// than XLA's product: the result differs from x @ dequantize(W) by f32 summation rounding only.
// int8 channel applies its scale to the f32 sum, as the XLA path does.
//
// Threads: the output columns are cut into chunks taken from an atomic counter by the calling
// thread and by tasks scheduled on XLA's intra-op thread pool; the caller runs every chunk no
// task has taken, so a busy pool never blocks it.

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "rlx CPU kernels need AVX2, FMA and F16C"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSerialWork = 1 << 19;  // below this many weights one thread does it all

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

struct Chunks {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t count = 0;
};

// Runs fn(c) for every chunk c in [0, count) on the caller and up to pool threads.
template <class Fn>
void parallel_chunks(ffi::ThreadPool& pool, int64_t count, bool serial, Fn fn) {
  int64_t helpers = serial ? 0 : std::min<int64_t>(pool.num_threads(), count) - 1;
  if (helpers <= 0) {
    for (int64_t c = 0; c < count; ++c) fn(c);
    return;
  }
  auto state = std::make_shared<Chunks>();
  state->count = count;
  auto work = [state, fn]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < state->count;) {
      fn(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work]() { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < count) _mm_pause();
}

// ---- GGUF planar rows ----------------------------------------------------------------------

enum Kind { kQ8_0, kQ4_0, kQ4_1 };

template <int Q>
constexpr int64_t block_bytes() { return Q == kQ8_0 ? 34 : Q == kQ4_0 ? 18 : 20; }

// Block b of a planar row of nb blocks -> its 32 f32 weights in w[0..3].
template <int Q>
inline void decode_block(const uint8_t* row, int64_t nb, int64_t b, __m256 w[4]) {
  __m256 d = _mm256_set1_ps(f16(row + 2 * b));
  if constexpr (Q == kQ8_0) {
    const uint8_t* q = row + 2 * nb + 32 * b;
    for (int i = 0; i < 4; ++i) {
      __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    }
  } else {
    const int64_t head = Q == kQ4_1 ? 4 : 2;
    const uint8_t* q = row + head * nb + 16 * b;
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    __m256 c = Q == kQ4_1 ? _mm256_set1_ps(f16(row + 2 * nb + 2 * b))
                          : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), c);
  }
}

// Output columns [n0, n1) of RG rows of x (row stride K), into y (row stride N).
template <int Q, int RG>
void gguf_rows(const float* x, int64_t K, const uint8_t* W, int64_t N, int64_t n0, int64_t n1,
               float* y) {
  constexpr int A = RG == 1 ? 4 : RG <= 4 ? 2 : 1;  // independent accumulators per row
  const int64_t nb = K / 32, row_bytes = nb * block_bytes<Q>();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * row_bytes;
    __m256 acc[RG][A];
    for (int r = 0; r < RG; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      decode_block<Q>(row, nb, b, w);
      for (int r = 0; r < RG; ++r)
        for (int i = 0; i < 4; ++i)
          acc[r][i % A] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + 32 * b + 8 * i), w[i],
                                          acc[r][i % A]);
    }
    for (int r = 0; r < RG; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
      y[r * N + n] = hsum(s);
    }
  }
}

template <int Q>
void gguf_all_rows(const float* x, int64_t R, int64_t K, const uint8_t* W, int64_t N,
                   int64_t n0, int64_t n1, float* y) {
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) gguf_rows<Q, 8>(x + r * K, K, W, N, n0, n1, y + r * N);
  if (r + 4 <= R) gguf_rows<Q, 4>(x + r * K, K, W, N, n0, n1, y + r * N), r += 4;
  if (r + 2 <= R) gguf_rows<Q, 2>(x + r * K, K, W, N, n0, n1, y + r * N), r += 2;
  if (r < R) gguf_rows<Q, 1>(x + r * K, K, W, N, n0, n1, y + r * N);
}

template <int Q>
ffi::Error gguf_product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("x and w must be 2-D");
  const int64_t R = xd[0], K = xd[1], N = wd[0];
  if (K % 32 || wd[1] != K / 32 * block_bytes<Q>())
    return ffi::Error::InvalidArgument("w rows must hold K / 32 blocks; got K = " +
                                       std::to_string(K) + ", " + std::to_string(wd[1]) + " bytes");
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t step = std::max<int64_t>(16, (N / 8 + 15) / 16 * 16);  // about 8 chunks
  const int64_t count = (N + step - 1) / step;
  parallel_chunks(pool, count, N * K < kSerialWork, [=](int64_t c) {
    gguf_all_rows<Q>(xp, R, K, wp, N, c * step, std::min(N, (c + 1) * step), yp);
  });
  return ffi::Error::Success();
}

// ---- int8 values [K, N], one scale per output ------------------------------------------------

// Columns [n0, n0 + 8 T) of RG rows.
template <int RG, int T>
void int8_cols(const float* x, int64_t K, const int8_t* V, int64_t N, int64_t n0,
               const float* scale, float* y) {
  __m256 acc[RG][T];
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* v = V + k * N + n0;
    __m256 w[T];
    for (int t = 0; t < T; ++t)
      w[t] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * t))));
    for (int r = 0; r < RG; ++r) {
      __m256 xr = _mm256_broadcast_ss(x + r * K + k);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(xr, w[t], acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    __m256 s = _mm256_loadu_ps(scale + n0 + 8 * t);
    for (int r = 0; r < RG; ++r) _mm256_storeu_ps(y + r * N + n0 + 8 * t, _mm256_mul_ps(acc[r][t], s));
  }
}

template <int RG>
void int8_rows(const float* x, int64_t K, const int8_t* V, int64_t N, int64_t n0, int64_t n1,
               const float* scale, float* y) {
  constexpr int T = RG == 1 ? 8 : RG == 2 ? 4 : 2;
  int64_t n = n0;
  for (; n + 8 * T <= n1; n += 8 * T) int8_cols<RG, T>(x, K, V, N, n, scale, y);
  for (; n + 8 <= n1; n += 8) int8_cols<RG, 1>(x, K, V, N, n, scale, y);
  for (; n < n1; ++n)
    for (int r = 0; r < RG; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(x[r * K + k], float(V[k * N + n]), s);
      y[r * N + n] = s * scale[n];
    }
}

ffi::Error int8_channel_product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> scale,
                                ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), vd = v.dimensions();
  if (xd.size() != 2 || vd.size() != 2 || vd[0] != xd[1] || scale.element_count() != vd[1])
    return ffi::Error::InvalidArgument("expected x [R, K], values [K, N], scale [N]");
  const int64_t R = xd[0], K = xd[1], N = vd[1];
  const float* xp = x.typed_data();
  const int8_t* vp = v.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  const int64_t step = std::max<int64_t>(64, (N / 8 + 63) / 64 * 64);
  const int64_t count = (N + step - 1) / step;
  parallel_chunks(pool, count, N * K < kSerialWork, [=](int64_t c) {
    const int64_t n0 = c * step, n1 = std::min(N, n0 + step);
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) int8_rows<4>(xp + r * K, K, vp, N, n0, n1, sp, yp + r * N);
    if (r + 2 <= R) int8_rows<2>(xp + r * K, K, vp, N, n0, n1, sp, yp + r * N), r += 2;
    if (r < R) int8_rows<1>(xp + r * K, K, vp, N, n0, n1, sp, yp + r * N);
  });
  return ffi::Error::Success();
}

}  // namespace

#define RLX_GGUF_HANDLER(name, kind)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, gguf_product<kind>,                                \
                                ffi::Ffi::Bind()                                         \
                                    .Ctx<ffi::ThreadPool>()                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()                        \
                                    .Arg<ffi::Buffer<ffi::U8>>()                         \
                                    .Ret<ffi::Buffer<ffi::F32>>());

RLX_GGUF_HANDLER(rlx_gguf_q8_0, kQ8_0)
RLX_GGUF_HANDLER(rlx_gguf_q4_0, kQ4_0)
RLX_GGUF_HANDLER(rlx_gguf_q4_1, kQ4_1)

XLA_FFI_DEFINE_HANDLER_SYMBOL(rlx_int8_channel, int8_channel_product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
