// Few-row products over packed weights for XLA:CPU, called through XLA's FFI
// (rlx.platform.cpu.kernels builds, loads and registers this file).
//
// y[R, N] = x[R, K] @ W for a decode step's few f32 rows, W packed as rlx stores it:
//   rlx_gguf_q8_0 / _q4_0 / _q4_1: planar GGUF rows [N, nb * bytes] (each row's f16 headers of
//     all its blocks first, Q4_1's d then m, then the 32 int8 / 16 nibble bytes of each block;
//     nibble j of byte i is element 16 j + i of its block), y = x @ W^T;
//   rlx_int8_channel: int8 values [K, N] with one f32 scale per output, y = (x @ V) * s;
//   rlx_fp4: E2M1 codes [K/2, N] (MXFP4, NVFP4) with a scale byte per block of B inputs and
//     column, decoded through a 256-entry f32 table of the scales, y = x @ W.
//
// Numerics: activations stay f32 and every sum is an f32 sum (FMAs), in another order than
// XLA's product, so results differ from x @ dequantize(W) by f32 summation rounding only. One
// row of x (a batch-1 decode step) multiplies each GGUF block's values (Q8_0 q, Q4_0 q - 8, Q4_1
// q) by x's block and applies the block's scale d to that partial sum, plus for Q4_1 its m times
// the block sum of x: d (q . x) + m sum(x). Several rows decode each weight to the f32 value the
// dequantization gives (Q8_0 d q; Q4_0 fma(d, q, -8 d) = d (q - 8), exact; Q4_1 fma(d, q, m) =
// fl(d q + m) as d q is exact) and multiply those. int8 channel scales the f32 sum, as XLA's
// path does.
//
// Threads: the work is cut into chunks (output columns; for int8 with one row of x, ranges of
// input rows by column blocks, summed apart and added in a fixed order) taken from an atomic
// counter by the calling thread and by tasks scheduled on XLA's intra-op thread pool; the caller
// runs every chunk no task has taken, so a busy pool never blocks it.

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
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSerialWork = 1 << 16;  // below this many weights one thread does it all
constexpr int64_t kPrefetchBytes = 2048;  // one-row GGUF products read this far ahead

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
  // a helper still running its last chunk: spin briefly, then give the core up (on a loaded
  // machine the helper may be waiting for this very core)
  for (int spins = 0; state->done.load(std::memory_order_acquire) < count; ++spins) {
    if (spins < 4096) _mm_pause();
    else std::this_thread::yield();
  }
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

// Block b's 32 values before its scale: Q8_0 q; Q4_0 q - 8; Q4_1 q (its m is added apart).
template <int Q>
inline void block_values(const uint8_t* row, int64_t nb, int64_t b, __m256 v[4]) {
  if constexpr (Q == kQ8_0) {
    const uint8_t* q = row + 2 * nb + 32 * b;
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
  } else {
    const uint8_t* q = row + (Q == kQ4_1 ? 4 : 2) * nb + 16 * b;
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if constexpr (Q == kQ4_0) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(Q == kQ4_0 ? _mm256_cvtepi8_epi32(parts[i])
                                           : _mm256_cvtepu8_epi32(parts[i]));
  }
}

#if defined(__AVX512F__)
// Block b's 32 values before its scale (as block_values) in two 16-lane halves.
template <int Q>
inline void block_values16(const uint8_t* row, int64_t nb, int64_t b, __m512 v[2]) {
  __m512i v0, v1;
  if constexpr (Q == kQ8_0) {
    const uint8_t* q = row + 2 * nb + 32 * b;
    v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  } else {
    const uint8_t* q = row + (Q == kQ4_1 ? 4 : 2) * nb + 16 * b;
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if constexpr (Q == kQ4_0) {
      v0 = _mm512_cvtepi8_epi32(_mm_sub_epi8(lo, _mm_set1_epi8(8)));
      v1 = _mm512_cvtepi8_epi32(_mm_sub_epi8(hi, _mm_set1_epi8(8)));
    } else {
      v0 = _mm512_cvtepu8_epi32(lo);
      v1 = _mm512_cvtepu8_epi32(hi);
    }
  }
  v[0] = _mm512_cvtepi32_ps(v0);
  v[1] = _mm512_cvtepi32_ps(v1);
}

// Block b's 32 weights as the dequantization gives them (as decode_block) into w[0..31].
template <int Q>
inline void store_block(const uint8_t* row, int64_t nb, int64_t b, float* w) {
  __m512 v[2];
  block_values16<Q>(row, nb, b, v);
  __m512 d = _mm512_set1_ps(f16(row + 2 * b));
  __m512 c = _mm512_set1_ps(Q == kQ4_1 ? f16(row + 2 * nb + 2 * b) : 0.0f);
  for (int i = 0; i < 2; ++i)
    _mm512_storeu_ps(w + 16 * i, Q == kQ4_1 ? _mm512_fmadd_ps(d, v[i], c) : _mm512_mul_ps(d, v[i]));
}

// Block b's 32 values before its scale, as block_values16, with the nibbles mapped to floats by a
// lane permutation of a 16-entry table (one shuffle per 16 values, no integer conversion).
template <int Q>
inline void block_values_lut(const uint8_t* q, int64_t b, __m512 table, __m512 v[2]) {
  if constexpr (Q == kQ8_0) {
    v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q + 32 * b))));
    v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q + 32 * b + 16))));
  } else {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q + 16 * b)));
    v[0] = _mm512_permutexvar_ps(bytes, table);  // the low nibble: bits 0-3 index the table
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
}

// Block b's values dotted with x's block xb, lane-wise: 16 partial sums.
template <int Q>
inline __m512 block_dot_lut(const uint8_t* q, int64_t b, __m512 table, const float* xb) {
  __m512 v[2];
  block_values_lut<Q>(q, b, table, v);
  return _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), v[1], _mm512_mul_ps(_mm512_loadu_ps(xb), v[0]));
}

// count (<= 16) f16 values at p -> f32 in out[0..16), zeros past count.
inline void halves16(const uint8_t* p, int64_t count, float* out) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __mmask16 mask = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  _mm512_store_ps(out, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)));
#else
  if (count == 16) {
    _mm512_store_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
    return;
  }
  for (int64_t j = 0; j < 16; ++j) out[j] = j < count ? f16(p + 2 * j) : 0.0f;
#endif
}

// One row of x by W's rows [n0, n1), AVX-512: the scales of 16 blocks are converted at once and
// broadcast from memory; Q4_1's m sum(x) terms are summed lane-wise beside the blocks.
template <int Q>
void gguf_one_row(const float* x, const float* xsum, int64_t K, const uint8_t* W, int64_t n0,
                  int64_t n1, float* y) {
  const int64_t nb = K / 32, row_bytes = nb * block_bytes<Q>();
  const __m512 table = Q == kQ4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3,
                                                   4, 5, 6, 7)
                                  : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                   14, 15);
  alignas(64) float d[16], m[16];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * row_bytes;
    // ask for the rows kPrefetchBytes ahead now: one stream per thread is not enough to keep
    // the memory busy (a hint only: never faults past the end of W)
    for (int64_t i = 0; i < row_bytes; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchBytes + i), _MM_HINT_T0);
    const uint8_t* q = row + (Q == kQ4_1 ? 4 : 2) * nb;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
      const int64_t count = std::min<int64_t>(16, nb - b0);
      halves16(row + 2 * b0, count, d);
      if constexpr (Q == kQ4_1) {  // xsum is zero past its nb blocks
        halves16(row + 2 * nb + 2 * b0, count, m);
        macc = _mm512_fmadd_ps(_mm512_load_ps(m), _mm512_loadu_ps(xsum + b0), macc);
      }
      int64_t j = 0;
      for (; j + 2 <= count; j += 2) {  // two chains of sums, one per accumulator
        const int64_t b = b0 + j;
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(d[j]),
                               block_dot_lut<Q>(q, b, table, x + 32 * b), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_set1_ps(d[j + 1]),
                               block_dot_lut<Q>(q, b + 1, table, x + 32 * b + 32), acc1);
      }
      if (j < count)
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(d[j]),
                               block_dot_lut<Q>(q, b0 + j, table, x + 32 * (b0 + j)), acc0);
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), macc));
  }
}
#else
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc a) { return hsum(a); }

template <int Q>
inline Acc block_dot(const uint8_t* row, int64_t nb, int64_t b, const float* xb) {
  __m256 v[4];
  block_values<Q>(row, nb, b, v);
  __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), v[0]);
  __m256 u = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), v[1]);
  t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v[2], t);
  u = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v[3], u);
  return _mm256_add_ps(t, u);
}

inline Acc acc_fma(float d, Acc t, Acc acc) { return _mm256_fmadd_ps(_mm256_set1_ps(d), t, acc); }

template <int Q>
inline void store_block(const uint8_t* row, int64_t nb, int64_t b, float* w) {
  __m256 v[4];
  decode_block<Q>(row, nb, b, v);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(w + 8 * i, v[i]);
}

// One row of x by W's rows [n0, n1): sum_b d_b (v_b . x_b), plus for Q4_1 sum_b m_b xsum_b
// (xsum_b: the sum of x's block b).
template <int Q>
void gguf_one_row(const float* x, const float* xsum, int64_t K, const uint8_t* W, int64_t n0,
                  int64_t n1, float* y) {
  const int64_t nb = K / 32, row_bytes = nb * block_bytes<Q>();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * row_bytes;
    Acc acc0 = acc_zero(), acc1 = acc_zero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      acc0 = acc_fma(f16(row + 2 * b), block_dot<Q>(row, nb, b, x + 32 * b), acc0);
      acc1 = acc_fma(f16(row + 2 * b + 2), block_dot<Q>(row, nb, b + 1, x + 32 * b + 32), acc1);
    }
    if (b < nb) acc0 = acc_fma(f16(row + 2 * b), block_dot<Q>(row, nb, b, x + 32 * b), acc0);
    float sum = acc_sum(acc0) + acc_sum(acc1);
    if constexpr (Q == kQ4_1) {
      const uint8_t* m = row + 2 * nb;
      __m256 macc = _mm256_setzero_ps();
      for (b = 0; b + 8 <= nb; b += 8)
        macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(m + 2 * b))),
                               _mm256_loadu_ps(xsum + b), macc);
      sum += hsum(macc);
      for (; b < nb; ++b) sum += f16(m + 2 * b) * xsum[b];
    }
    y[n] = sum;
  }
}
#endif

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16, kTileCols = 4;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
using Vec = __m256;
constexpr int kLanes = 8, kTileCols = 3;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum(v); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

// RG rows of x by NC decoded f32 rows w (row stride K, K a multiple of 32): y[r, c] (row
// stride N).
template <int RG, int NC>
void dot_tile(const float* x, int64_t K, const float* w, float* y, int64_t N) {
  Vec acc[RG][NC];
  for (int r = 0; r < RG; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = Vec{};
  for (int64_t k = 0; k < K; k += kLanes) {
    Vec wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = vload(w + c * K + k);
    for (int r = 0; r < RG; ++r) {
      Vec xv = vload(x + r * K + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int c = 0; c < NC; ++c) y[r * N + c] = vsum(acc[r][c]);
}

template <int NC>
void dot_rows(const float* x, int64_t R, int64_t K, const float* w, float* y, int64_t N) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) dot_tile<4, NC>(x + r * K, K, w, y + r * N, N);
  if (R - r == 3) dot_tile<3, NC>(x + r * K, K, w, y + r * N, N);
  if (R - r == 2) dot_tile<2, NC>(x + r * K, K, w, y + r * N, N);
  if (R - r == 1) dot_tile<1, NC>(x + r * K, K, w, y + r * N, N);
}

// Several rows of x: W's rows are decoded kTileCols at a time into f32 (the dequantized
// values) and multiplied by every row of x from cache.
template <int Q>
void gguf_many_rows(const float* x, int64_t R, int64_t K, const uint8_t* W, int64_t N,
                    int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / 32, row_bytes = nb * block_bytes<Q>();
  std::unique_ptr<float[]> w(new float[kTileCols * K]);
  for (int64_t n = n0; n < n1; n += kTileCols) {
    const int64_t nc = std::min<int64_t>(kTileCols, n1 - n);
    const uint8_t* next = W + (n + nc) * row_bytes;  // the next tile's rows: fetch them now
    for (int64_t i = 0; i < std::min<int64_t>(kTileCols, n1 - n - nc) * row_bytes; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t b = 0; b < nb; ++b)
        store_block<Q>(W + (n + c) * row_bytes, nb, b, w.get() + c * K + 32 * b);
    if (nc == 4) dot_rows<4>(x, R, K, w.get(), y + n, N);
    if (nc == 3) dot_rows<3>(x, R, K, w.get(), y + n, N);
    if (nc == 2) dot_rows<2>(x, R, K, w.get(), y + n, N);
    if (nc == 1) dot_rows<1>(x, R, K, w.get(), y + n, N);
  }
}

template <int Q>
void gguf_all_rows(const float* x, const float* xsum, int64_t R, int64_t K, const uint8_t* W,
                   int64_t N, int64_t n0, int64_t n1, float* y) {
  if (R == 1) gguf_one_row<Q>(x, xsum, K, W, n0, n1, y);
  else gguf_many_rows<Q>(x, R, K, W, N, n0, n1, y);
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
  // per block of x's first row (R = 1), zeros past the last block for 16-wide reads
  std::unique_ptr<float[]> xsum(new float[K / 32 + 16]());
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 s = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) s = _mm256_add_ps(s, _mm256_loadu_ps(xp + 32 * b + 8 * i));
    xsum[b] = hsum(s);
  }
  const float* xs = xsum.get();
  const int64_t step = std::max<int64_t>(16, (N / 8 + 15) / 16 * 16);  // about 8 chunks
  const int64_t count = (N + step - 1) / step;
  parallel_chunks(pool, count, N * K < kSerialWork, [=](int64_t c) {
    gguf_all_rows<Q>(xp, xs, R, K, wp, N, c * step, std::min(N, (c + 1) * step), yp);
  });
  return ffi::Error::Success();
}

// ---- int8 values [K, N], one scale per output ------------------------------------------------

// Columns [n0, n0 + 8 T) of RG rows, input rows [k0, k1) added to y (the first block: set).
// Values stream row by row (k-major), as they lie in memory.
template <int RG, int T>
void int8_panel(const float* x, int64_t K, const int8_t* V, int64_t N, int64_t n0, int64_t k0,
                int64_t k1, float* y) {
  __m256 acc[RG][T];
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < T; ++t)
      acc[r][t] = k0 ? _mm256_loadu_ps(y + r * N + n0 + 8 * t) : _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
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
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + r * N + n0 + 8 * t, acc[r][t]);
}

template <int RG>
void int8_block(const float* x, int64_t K, const int8_t* V, int64_t N, int64_t n0, int64_t n1,
                int64_t k0, int64_t k1, float* y) {
  constexpr int T = RG == 1 ? 8 : RG == 2 ? 4 : 2;
  int64_t n = n0;
  for (; n + 8 * T <= n1; n += 8 * T) int8_panel<RG, T>(x, K, V, N, n, k0, k1, y);
  for (; n + 8 <= n1; n += 8) int8_panel<RG, 1>(x, K, V, N, n, k0, k1, y);
}

// y[n] += x[k] v[k, n] for k = k0, k0 + 1, ... in order, columns [n0, n8) (a multiple of 8):
// four input rows at a time (four streams of values in memory order, y read and written once per
// four rows), the last rows one at a time.
template <int S>
inline void int8_rows_into(const float* x, const int8_t* V, int64_t N, int64_t k0, int64_t n0,
                           int64_t n8, float* y) {
  const int8_t* v[4];
  for (int i = 0; i < S; ++i) v[i] = V + (k0 + i) * N;
  int64_t n = n0;
#if defined(__AVX512F__)
  __m512 x16[4];
  for (int i = 0; i < S; ++i) x16[i] = _mm512_set1_ps(x[k0 + i]);
  for (; n + 16 <= n8; n += 16) {
    if (((n - n0) & 63) == 0)  // the next four input rows' line of these columns (a hint)
      for (int i = 0; i < S; ++i) _mm_prefetch(reinterpret_cast<const char*>(v[i] + 4 * N + n),
                                               _MM_HINT_T0);
    __m512 a = _mm512_loadu_ps(y + n);
    for (int i = 0; i < S; ++i)
      a = _mm512_fmadd_ps(x16[i], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(v[i] + n)))),
                          a);
    _mm512_storeu_ps(y + n, a);
  }
#endif
  __m256 x8[4];
  for (int i = 0; i < S; ++i) x8[i] = _mm256_set1_ps(x[k0 + i]);
  for (; n < n8; n += 8) {
    __m256 a = _mm256_loadu_ps(y + n);
    for (int i = 0; i < S; ++i)
      a = _mm256_fmadd_ps(x8[i], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v[i] + n)))),
                          a);
    _mm256_storeu_ps(y + n, a);
  }
}

// One row of x by input rows [k0, k1) of V, columns [n0, n8), set in y.
void int8_one_row(const float* x, const int8_t* V, int64_t N, int64_t k0, int64_t k1, int64_t n0,
                  int64_t n8, float* y) {
  std::fill(y + n0, y + n8, 0.0f);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) int8_rows_into<4>(x, V, N, k, n0, n8, y);
  for (; k < k1; ++k) int8_rows_into<1>(x, V, N, k, n0, n8, y);
}

constexpr int64_t kRowParts = 4;       // one row of x: input-row ranges summed apart, then added
constexpr int64_t kColumnBlock = 4096;  // ... and at most this many columns per task

// One row of x (a batch-1 decode step): tasks of contiguous input rows (whole rows of values
// where N <= kColumnBlock, so each task streams one region of memory) by column blocks. Part p
// of the input rows sums into its own buffer (part 0: y); the parts are added in order, then
// scaled, so the result does not depend on which thread ran what.
void int8_row_product(ffi::ThreadPool& pool, const float* x, int64_t K, const int8_t* V,
                      int64_t N, const float* scale, float* y) {
  const int64_t n8 = N / 8 * 8;
  const bool serial = N * K < kSerialWork;
  const int64_t rows = serial ? std::max<int64_t>(K, 1) : std::max<int64_t>(4, (K / kRowParts + 3) / 4 * 4);
  const int64_t parts = (K + rows - 1) / rows;
  const int64_t width = std::min<int64_t>(kColumnBlock, n8);
  const int64_t blocks = width ? (n8 + width - 1) / width : 0;
  std::unique_ptr<float[]> part(new float[(parts - 1) * N + 1]);
  float* pp = part.get();
  parallel_chunks(pool, parts * blocks, serial, [=](int64_t t) {
    const int64_t p = t / blocks, b = t % blocks;
    int8_one_row(x, V, N, p * rows, std::min(K, (p + 1) * rows), b * width,
                 std::min(n8, (b + 1) * width), p ? pp + (p - 1) * N : y);
  });
  for (int64_t p = 1; p < parts; ++p)
    for (int64_t n = 0; n < n8; ++n) y[n] += pp[(p - 1) * N + n];
  for (int64_t n = 0; n < n8; ++n) y[n] *= scale[n];
  for (int64_t n = n8; n < N; ++n) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; ++k) s = std::fma(x[k], float(V[k * N + n]), s);
    y[n] = s * scale[n];
  }
}

#if defined(__AVX512F__)
// RG rows of x by a decoded f32 panel w [kb, 32] (input rows k0.., columns n..n+32), added to y
// (the first block: set).
template <int RG>
void int8_tile512(const float* x, int64_t K, const float* w, int64_t k0, int64_t kb, float* y,
                  int64_t N, int64_t n) {
  __m512 acc[RG][2];
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < 2; ++t)
      acc[r][t] = k0 ? _mm512_loadu_ps(y + r * N + n + 16 * t) : _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kb; ++kk) {
    __m512 w0 = _mm512_loadu_ps(w + 32 * kk), w1 = _mm512_loadu_ps(w + 32 * kk + 16);
    for (int r = 0; r < RG; ++r) {
      __m512 xr = _mm512_set1_ps(x[r * K + k0 + kk]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < 2; ++t) _mm512_storeu_ps(y + r * N + n + 16 * t, acc[r][t]);
}

// Several rows of x, columns [n0, n32) (a multiple of 32): each block of up to 128 input rows x
// 32 columns is decoded once into f32 and multiplied by every row of x, 8 rows at a time.
void int8_many512(const float* x, int64_t R, int64_t K, const int8_t* V, int64_t N, int64_t n0,
                  int64_t n32, float* y) {
  constexpr int64_t kBlock = 128;
  alignas(64) float w[kBlock * 32];
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t kb = std::min(kBlock, K - k0);
    for (int64_t n = n0; n < n32; n += 32) {
      for (int64_t kk = 0; kk < kb; ++kk)
        for (int t = 0; t < 2; ++t)
          _mm512_store_ps(w + 32 * kk + 16 * t,
                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                              reinterpret_cast<const __m128i*>(V + (k0 + kk) * N + n + 16 * t)))));
      int64_t r = 0;
      for (; r + 8 <= R; r += 8) int8_tile512<8>(x + r * K, K, w, k0, kb, y + r * N, N, n);
      if (r + 4 <= R) int8_tile512<4>(x + r * K, K, w, k0, kb, y + r * N, N, n), r += 4;
      if (r + 2 <= R) int8_tile512<2>(x + r * K, K, w, k0, kb, y + r * N, N, n), r += 2;
      if (r < R) int8_tile512<1>(x + r * K, K, w, k0, kb, y + r * N, N, n);
    }
  }
}
#endif

// Columns [n0, n1) of R > 1 rows (blocks of 128 input rows, each multiplied by every
// row of x while in cache; AVX-512: decoded once per block); then the scales. Columns past the
// last multiple of 8 are summed one by one.
void int8_columns(const float* x, int64_t R, int64_t K, const int8_t* V, int64_t N, int64_t n0,
                  int64_t n1, const float* scale, float* y) {
  constexpr int64_t kBlock = 128;
  const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
  int64_t nv = n0;  // columns before nv done by the AVX-512 path
#if defined(__AVX512F__)
  if (R > 1) nv = n0 + (n8 - n0) / 32 * 32, int8_many512(x, R, K, V, N, n0, nv, y);
#endif
  for (int64_t k0 = 0; k0 < K && nv < n8; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) int8_block<4>(x + r * K, K, V, N, nv, n8, k0, k1, y + r * N);
    if (r + 2 <= R) int8_block<2>(x + r * K, K, V, N, nv, n8, k0, k1, y + r * N), r += 2;
    if (r < R) int8_block<1>(x + r * K, K, V, N, nv, n8, k0, k1, y + r * N);
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t n = n0; n < n8; ++n) y[r * N + n] *= scale[n];
    for (int64_t n = n8; n < n1; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(x[r * K + k], float(V[k * N + n]), s);
      y[r * N + n] = s * scale[n];
    }
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
  if (R == 1) {
    int8_row_product(pool, xp, K, vp, N, sp, yp);
    return ffi::Error::Success();
  }
  // one chunk per thread: each reads long runs of every input row (narrower column chunks read
  // short strided runs, slower from memory)
  const bool serial = N * K < kSerialWork;
  const int64_t parts = serial ? 1 : std::max<int64_t>(1, pool.num_threads());
  const int64_t step = std::max<int64_t>(64, (N / parts + 63) / 64 * 64);
  const int64_t count = (N + step - 1) / step;
  parallel_chunks(pool, count, serial, [=](int64_t c) {
    int8_columns(xp, R, K, vp, N, c * step, std::min(N, (c + 1) * step), sp, yp);
  });
  return ffi::Error::Success();
}

// ---- FP4: E2M1 values [K/2, N], one scale byte per block of B inputs and column -----------
// Two codes a byte along K (input row 2p in the low nibble of packed row p, 2p + 1 in the high
// one), scale bytes [K/B, N] (MXFP4's E8M0 exponents, NVFP4's e4m3 bits) and table[256]: each
// scale byte's f32 scale as the dequantization applies it (NVFP4: times its per-matrix scale2),
// computed by the format's own decode on the caller's side. Each panel of up to 128 input rows
// x 32 columns is decoded once into the dequantized f32 weights e2m1(code) * scale (the same
// one rounded product as the dequantization) and multiplied by every row of x from cache.

alignas(64) constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr int64_t kFp4Rows = 128;  // input rows decoded per panel

// The 32 codes at v (packed row p, columns n..n+32) times the scales s[32]: input row 2p's
// weights into w0[0..32), row 2p + 1's into w1[0..32).
inline void fp4_decode_pair(const uint8_t* v, const float* s, float* w0, float* w1) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_load_ps(kE2M1);
  for (int t = 0; t < 2; ++t) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16 * t)));
    __m512 sc = _mm512_loadu_ps(s + 16 * t);
    _mm512_storeu_ps(w0 + 16 * t, _mm512_mul_ps(_mm512_permutexvar_ps(b, table), sc));  // bits 0-3
    _mm512_storeu_ps(w1 + 16 * t,
                     _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), sc));
  }
#else
  const __m256 magnitude = _mm256_load_ps(kE2M1);  // codes 0-7; bit 3 is the sign
  const __m256i sign_bit = _mm256_set1_epi32(8);
  for (int t = 0; t < 4; ++t) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * t)));
    __m256 sc = _mm256_loadu_ps(s + 8 * t);
    for (int half = 0; half < 2; ++half) {
      __m256i c = half ? _mm256_srli_epi32(b, 4) : b;
      __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, sign_bit), 28));
      __m256 value = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitude, c), sign);
      _mm256_storeu_ps((half ? w1 : w0) + 8 * t, _mm256_mul_ps(value, sc));
    }
  }
#endif
}

// RG rows of x by a decoded f32 panel w [kb, 32] (input rows k0.., columns n..n+32), added to y
// (the first panel: set).
template <int RG>
void fp4_tile(const float* x, int64_t K, const float* w, int64_t k0, int64_t kb, float* y,
              int64_t N, int64_t n) {
  constexpr int T = 32 / kLanes;
  Vec acc[RG][T];
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = k0 ? vload(y + r * N + n + kLanes * t) : Vec{};
  for (int64_t kk = 0; kk < kb; ++kk) {
    Vec wv[T];
    for (int t = 0; t < T; ++t) wv[t] = vload(w + 32 * kk + kLanes * t);
    for (int r = 0; r < RG; ++r) {
      Vec xr = vset1(x[r * K + k0 + kk]);
      for (int t = 0; t < T; ++t) acc[r][t] = vfma(xr, wv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < T; ++t) vstore(y + r * N + n + kLanes * t, acc[r][t]);
}

struct Fp4 {
  const uint8_t* v;      // [K/2, N]
  const uint8_t* scale;  // [K/B, N]
  const float* table;    // [256]
  int64_t K, N, B;
};

// Columns [n0, n1) of R rows of x: whole panels of 32 columns, then the last columns one by one.
void fp4_columns(const Fp4& m, const float* x, int64_t R, int64_t n0, int64_t n1, float* y) {
  constexpr int kRows = kLanes == 16 ? 8 : 2;  // rows of x per tile (accumulators in registers)
  alignas(64) float w[kFp4Rows * 32];
  alignas(64) float s[32];
  const int64_t n32 = n0 + (n1 - n0) / 32 * 32, K = m.K, N = m.N;
  for (int64_t k0 = 0; k0 < K; k0 += kFp4Rows) {
    const int64_t kb = std::min(kFp4Rows, K - k0);
    for (int64_t n = n0; n < n32; n += 32) {
      for (int64_t kk = 0; kk < kb; kk += 2) {
        if ((k0 + kk) % m.B == 0)  // a new block of scales (B is even)
          for (int j = 0; j < 32; ++j) s[j] = m.table[m.scale[(k0 + kk) / m.B * N + n + j]];
        fp4_decode_pair(m.v + (k0 + kk) / 2 * N + n, s, w + 32 * kk, w + 32 * (kk + 1));
      }
      int64_t r = 0;
      for (; r + kRows <= R; r += kRows) fp4_tile<kRows>(x + r * K, K, w, k0, kb, y + r * N, N, n);
      if constexpr (kRows == 8)
        if (r + 4 <= R) fp4_tile<4>(x + r * K, K, w, k0, kb, y + r * N, N, n), r += 4;
      if constexpr (kRows >= 4)
        if (r + 2 <= R) fp4_tile<2>(x + r * K, K, w, k0, kb, y + r * N, N, n), r += 2;
      if (r < R) fp4_tile<1>(x + r * K, K, w, k0, kb, y + r * N, N, n);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = n32; n < n1; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t byte = m.v[k / 2 * N + n];
        const float wv = kE2M1[k % 2 ? byte >> 4 : byte & 15] * m.table[m.scale[k / m.B * N + n]];
        acc = std::fma(x[r * K + k], wv, acc);
      }
      y[r * N + n] = acc;
    }
}

ffi::Error fp4_product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> v,
                       ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::F32> table,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), vd = v.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || vd.size() != 2 || sd.size() != 2 || table.element_count() != 256)
    return ffi::Error::InvalidArgument("expected x [R, K], values [K/2, N], scale [K/B, N], "
                                       "table [256]");
  const int64_t R = xd[0], K = xd[1], N = vd[1], G = sd[0];
  if (vd[0] * 2 != K || sd[1] != N || G == 0 || K % G || (K / G) % 2)
    return ffi::Error::InvalidArgument("values must be [K/2, N] and scale [K/B, N] with an even B "
                                       "dividing K = " + std::to_string(K));
  const Fp4 m{v.typed_data(), scale.typed_data(), table.typed_data(), K, N, K / G};
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const bool serial = N * K < kSerialWork;
  const int64_t parts = serial ? 1 : std::max<int64_t>(1, pool.num_threads()) * 4;
  const int64_t step = std::max<int64_t>(64, (N / parts + 31) / 32 * 32);
  const int64_t count = (N + step - 1) / step;
  parallel_chunks(pool, count, serial, [=](int64_t c) {
    fp4_columns(m, xp, R, c * step, std::min(N, (c + 1) * step), yp);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(rlx_fp4, fp4_product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
