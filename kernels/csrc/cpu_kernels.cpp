// CPU kernels for the engine: paged attention (decode and prefill in one varlen kernel), the KV-cache
// write, and the small elementwise ops around them that a layer otherwise runs as several torch ops.
//
// One source, compiled once per vector ISA (kernels/cpu_kernels.py passes the flags and picks the build
// at run time): AVX-512 (with native bfloat16 converts where the CPU has AVX512-BF16), AVX2, or plain
// C++. The code below is written once against a small vector layer ("vf", W floats wide) whose scalar
// version (W = 1) is the generic build.
//
// Layouts (see kernels/__init__.py): queries [T, Hq, D]; a layer's cache [num_blocks, block_size, Hkv, D]
// with D contiguous; block_tables int32 [B, max_blocks]; query_start_loc int32 [B + 1]; context_lens
// int32 [B] (tokens in cache after this step's writes).

// The ATen pieces used, not <torch/extension.h>: that header brings the whole C++ frontend (autograd, nn,
// optim) and tripled the time spent parsing headers, paid by every ISA build.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// ---- the vector layer -----------------------------------------------------------------------------
// load: storage type -> float32 lanes; store: float32 lanes -> storage type, rounding to nearest even.

#if defined(__AVX512F__)
constexpr int64_t W = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf vload(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore(c10::BFloat16* p, vf v) {
#if defined(__AVX512BF16__)
  // Native convert (round to nearest even; it flushes float32 denormals, which bfloat16 barely has).
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
}
inline void vstore(c10::Half* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in float's normal exponent range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// The first n (< W) lanes of p, the rest `fill`; and stored back, the rest of the memory untouched.
inline vf vload_part(const float* p, int64_t n, float fill) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1), p);
}
inline void vstore_part(float* p, vf v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vhsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vf vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstore(c10::BFloat16* p, vf v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 32 -> 16 bits: pack works within 128-bit lanes, so gather the two useful quarters afterwards.
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(r, 16), _mm256_setzero_si256());
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
inline void vstore(c10::Half* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vload_part(const float* p, int64_t n, float fill) {
  const __m256i m = lanes_below(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void vstore_part(float* p, vf v, int64_t n) { _mm256_maskstore_ps(p, lanes_below(n), v); }

#else  // generic: one lane, plain C++ (the compiler may still vectorize the loops)
constexpr int64_t W = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset1(float x) { return x; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline vf vmin(vf a, vf b) { return std::min(a, b); }
inline vf vfma(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline float vhsum(vf v) { return v; }
inline float vhmax(vf v) { return v; }
template <typename T> inline vf vload(const T* p) { return static_cast<float>(*p); }
template <typename T> inline void vstore(T* p, vf v) { *p = static_cast<T>(v); }
inline vf vround(vf x) { return std::nearbyint(x); }
inline vf vpow2i(vf n) { return std::ldexp(1.f, static_cast<int>(n)); }
inline vf vload_part(const float* p, int64_t n, float fill) { return n > 0 ? *p : fill; }  // n < W = 1: never
inline void vstore_part(float* p, vf v, int64_t n) {
  if (n > 0) *p = v;
}
#endif

// e^x, x clamped to [-87, 88] (e^-87 is near float's smallest normal, e^88 near its largest):
// x = n ln2 + r, |r| <= ln2 / 2, e^r by the Cephes expf polynomial (about 1 ulp), 2^n in the exponent.
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  // r = x - n ln2, with ln2 split in two so the product is exact enough.
  vf r = vsub(x, vmul(n, vset1(0.693359375f)));
  r = vsub(r, vmul(n, vset1(-2.12194440e-4f)));
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vmul(p, vpow2i(n));
}

#if defined(__AVX512F__)
// 2^x for x <= 0 (the AMX softmax's exponents): x = n + f, |f| <= 1/2, 2^f by its Taylor polynomial of degree 6
// (relative error below 2e-7, about a float's rounding), 2^n applied by vscalefps, which also takes x far
// below float's range to 0. Half the instructions of vexp: the probabilities it feeds are rounded to bf16.
inline __m512 exp2_poly(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// v[i] = sum of the W lanes of row i of P (W rows of W floats): the scores of W positions at once, so
// no position pays for a horizontal sum of its own (a transpose-and-add tree instead).
inline vf vsum_rows(const float* P) {
#if defined(__AVX512F__)
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_loadu_ps(P + (2 * i) * W), b = _mm512_loadu_ps(P + (2 * i + 1) * W);
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Each 128-bit lane of w[i] now holds partial sums of rows 4i..4i+3; add the four lanes up.
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 u[4], w[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_loadu_ps(P + (2 * i) * W), b = _mm256_loadu_ps(P + (2 * i + 1) * W);
    u[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(u[2 * i]), b = _mm256_castps_pd(u[2 * i + 1]);
    w[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
#else
  return P[0];
#endif
}

// Lanes of a equal to b, as bits (lane i -> bit i); whether any lane of a is NaN.
inline uint32_t veq_mask(vf a, vf b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)));
#else
  return a == b ? 1u : 0u;
#endif
}
inline bool vany_nan(vf a) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0;
#else
  return std::isnan(a);
#endif
}

// Locality 3 (prefetcht0, every level) for a prefill tile's rows: they are read within microseconds, and
// keeping them out of L1 leaves each read waiting on one more fill. Locality 1 (prefetcht2, into L2) for a
// decode's rows: a decode step streams the whole KV pool once and is bound by how many misses are in
// flight, and a request that need not hold an L1 fill buffer until its line arrives leaves those buffers
// to the loads; decode steps of the engine are 2-4% faster for it on an AMX Xeon (the kernel alone, one
// problem in a warm pool, shows no such gain: see benchmarks/cpu_attention.py's "step" case).
template <int Locality = 3>
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, Locality);
}

// ---- AMX tiles (bf16 prefill scores) -------------------------------------------------------------------
// Built into the AVX512-BF16 build and used only where CPUID reports AMX-BF16 and Linux grants this process
// the tile state; set_amx turns them off (tests cover both paths on one machine).
#if defined(__AVX512BF16__)
bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}
std::atomic<bool> amx_wanted{true};

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// S[r][c] = Q[r] . K[c] for rows [0, rows) (a multiple of 16) and columns [0, cols) (a multiple of 16):
// Q as bf16 pairs [rows][D / 2] (D a multiple of 32), K as pairs [D / 2][ldk], S float32 [rows][lds].
// Tiles 0-3: four 16x16 blocks of S; 4: 16 query rows x 32 dims; 5: 32 dims x 16 positions (pairs).
// amx_scores and amx_pv run on the tile configuration amx_begin loads (six tiles of 16 rows x 64 bytes), held
// from a work item's first chunk to its last (amx_end): loading it costs more than a chunk's products.
__attribute__((target("amx-tile,amx-bf16"))) void amx_begin() {
  // Filled before it is loaded, and kept: GCC does not count ldtilecfg as a read, and drops a local's stores.
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  _tile_loadconfig(&cfg);
}
__attribute__((target("amx-tile,amx-bf16"))) void amx_end() { _tile_release(); }

__attribute__((target("amx-tile,amx-bf16"))) void amx_scores(const uint32_t* Q, const uint32_t* Kp, float* S,
                                                            int64_t rows, int64_t cols, int64_t D, int64_t ldk,
                                                            int64_t lds) {
  const int64_t qstride = D * 2, kstride = ldk * 4, sstride = lds * 4;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols; c0 += 64) {
      const int64_t nb = std::min<int64_t>(4, (cols - c0) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k0 = 0; k0 < D / 2; k0 += 16) {
        _tile_loadd(4, Q + r0 * (D / 2) + k0, qstride);
        _tile_loadd(5, Kp + k0 * ldk + c0, kstride);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) {
          _tile_loadd(5, Kp + k0 * ldk + c0 + 16, kstride);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (nb > 2) {
          _tile_loadd(5, Kp + k0 * ldk + c0 + 32, kstride);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (nb > 3) {
          _tile_loadd(5, Kp + k0 * ldk + c0 + 48, kstride);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      float* out = S + r0 * lds + c0;
      _tile_stored(0, out, sstride);
      if (nb > 1) _tile_stored(1, out + 16, sstride);
      if (nb > 2) _tile_stored(2, out + 32, sstride);
      if (nb > 3) _tile_stored(3, out + 48, sstride);
    }
  }
}

// acc[r][d] += sum_j P[r][j] V[j][d] for rows [0, rows) (a multiple of 16), positions [0, cols) (a multiple of
// 32) and d in [0, D) (a multiple of 16): P as bf16 [rows][ldp], V as pairs [cols / 2][D] (positions 2 jp and
// 2 jp + 1 of dimension d in one 32-bit pair, the even one low), acc float32 [rows][D]. The accumulators are
// loaded into the tiles, so whatever rescaled them (the online softmax) stands.
// Tiles 0-3: four 16x16 blocks of acc; 4: 16 rows x 32 positions of P; 5: 32 positions x 16 dims of V.
__attribute__((target("amx-tile,amx-bf16"))) void amx_pv(const uint16_t* P, const uint32_t* Vp, float* acc,
                                                        int64_t rows, int64_t cols, int64_t D, int64_t ldp) {
  const int64_t pstride = ldp * 2, vstride = D * 4, astride = D * 4;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t nb = std::min<int64_t>(4, (D - d0) / 16);
      float* out = acc + r0 * D + d0;
      _tile_loadd(0, out, astride);
      if (nb > 1) _tile_loadd(1, out + 16, astride);
      if (nb > 2) _tile_loadd(2, out + 32, astride);
      if (nb > 3) _tile_loadd(3, out + 48, astride);
      for (int64_t k0 = 0; k0 < cols; k0 += 32) {
        const uint32_t* v = Vp + (k0 / 2) * D + d0;
        _tile_loadd(4, P + r0 * ldp + k0, pstride);
        _tile_loadd(5, v, vstride);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) {
          _tile_loadd(5, v + 16, vstride);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (nb > 2) {
          _tile_loadd(5, v + 32, vstride);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (nb > 3) {
          _tile_loadd(5, v + 48, vstride);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, out, astride);
      if (nb > 1) _tile_stored(1, out + 16, astride);
      if (nb > 2) _tile_stored(2, out + 32, astride);
      if (nb > 3) _tile_stored(3, out + 48, astride);
    }
  }
}
#endif

// ---- paged attention ---------------------------------------------------------------------------------
//
// Work item: one sequence, one KV head, a tile of up to kQueryTile consecutive query tokens, and a range
// of KV positions. Its rows are every (query token, query head of the KV head's GQA group) pair, so each
// K/V row read from the pool serves all of them. The KV range is walked in chunks of kChunk positions
// read in place through the block table, with an online (running max) softmax in float32. When there
// are fewer items than threads (a few long decodes), each item's KV range is split into parts that run
// in parallel and are merged afterwards.

constexpr int64_t kQueryTile = 32;
// Query tokens of a tile scored on AMX: each chunk's K and V are rearranged for the tiles once per work item,
// so larger tiles spread that over more rows (a multiple of 16, so every tile's rows fill whole AMX tiles).
constexpr int64_t kAmxQueryTile = 128;
// Positions per chunk. On AMX a chunk's score and P V products are a few tile multiplies between loads and
// stores of the accumulator tiles (head size 64: two per product at 64 positions), so the AVX-512 builds
// take longer chunks to spread those over more work (decode walks the same chunks and reads as fast either
// way); the AVX2 and generic builds keep a float32 chunk of K transposed for a prefill tile at 16 KiB.
constexpr int64_t kChunk = W >= 16 ? 128 : 64;
constexpr int64_t kMinSplit = 256;  // below this a KV part costs less than its merge
constexpr int64_t kTiledRows = 8;   // rows from which transposing a chunk of K pays for itself
constexpr int64_t kSharedRows = 4;  // rows below kTiledRows that share each K/V load (a GQA group)
// Rows of a prefill tile scored and accumulated together: each K or V vector loaded serves all of them.
// Four rows keep 16 accumulators in AVX-512's 32 registers; AVX2's 16 hold two rows' eight.
constexpr int64_t kTileRows = W >= 16 ? 4 : 2;
constexpr int64_t kMaxPairs = 128;  // head sizes up to 256 take the pair path
// Decode rows score a K row as whole vectors of pairs: head sizes a multiple of kRowPairs, up to kRowVecs of them.
constexpr int64_t kRowPairs = 32, kRowVecs = 8;
#if defined(__AVX512BF16__)
constexpr bool kPairDot = true;  // bf16 K and Q multiplied pairwise by vdpbf16ps (exact products, float32 sums)
#else
constexpr bool kPairDot = false;
#endif
#if defined(__AVX512F__)
using pairvec = __m512i;  // 32 bf16 values, two per 32-bit lane
#else
struct pairvec {};  // the pair paths are AVX512-BF16 only; this keeps their signatures compiling elsewhere
#endif
static_assert(kChunk % (4 * W) == 0, "scores_tiled writes whole groups of four vectors");

struct Item {
  int32_t seq, kv_head, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence (0 = its first)
  int32_t kv_begin, kv_end;               // KV positions; a query at position p also stops at p + 1
  int64_t partial;                        // first row in the partial buffers, or -1: write the output
  int64_t cost;
};

struct Merge {
  int32_t seq, kv_head, q_begin, q_end, parts;
  int64_t partial;
};

struct Scratch {
  std::vector<float> q, acc, s, m, l, kt, vf, part;
  std::vector<uint32_t> qp, kp;  // bf16 queries and transposed K as pairs along the head dimension
  std::vector<uint16_t> pb;      // a chunk's probabilities in bf16, for the AMX product with V
  std::vector<const void*> krow, vrow, vrow_f;
};

template <typename T>
struct Attention {
  const T *q, *k, *v;
  T* out;
  const int32_t *tables, *starts, *lens;
  int64_t q_s0, q_s1, o_s0, o_s1, kb, kt, kh, vb, vt, vh;
  int64_t max_blocks, block_size, group, head_dim;
  float scale;
  float *p_acc, *p_m, *p_l;  // partial results of split items: [rows, D], [rows], [rows]
  // Prefill tiles score and accumulate on AMX (bf16 pair products, float32 sums in the tile unit), where the
  // CPU has it; their queries come kAmxQueryTile at a time.
  bool amx_tiles;

  // Position in the context of the sequence's query token i.
  int64_t pos(int64_t seq, int64_t i) const {
    return lens[seq] - (starts[seq + 1] - starts[seq]) + i;
  }

  void run(const Item& it, Scratch& sc) const {
    const int64_t D = head_dim, n_q = it.q_end - it.q_begin, R = n_q * group;
    const int64_t tok0 = starts[it.seq] + it.q_begin;
    float *Q = sc.q.data(), *acc = sc.acc.data(), *S = sc.s.data(), *M = sc.m.data(), *L = sc.l.data();
    const bool tiled = R >= kTiledRows;  // how K is read: see the chunk loop
    // bf16 queries score on bf16 pairs where the CPU multiplies them natively (kept as they are, the scale
    // applied to the sums: exact for D = 64); everything else on float32 queries scaled once here.
    const bool pairs = kPairDot && std::is_same_v<T, c10::BFloat16> &&
                       (tiled ? D % 2 == 0 && D <= 2 * kMaxPairs : D % kRowPairs == 0 && D <= kRowPairs * kRowVecs);
    // V on pairs too (accumulate_pairs) where the head size is whole vectors of them.
    const bool v_pairs = pairs && D % 32 == 0;
    const bool amx = amx_tiles && tiled;
    uint32_t* QP = sc.qp.data();
    for (int64_t i = 0; i < n_q; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q + (tok0 + i) * q_s0 + (it.kv_head * group + g) * q_s1;
        const int64_t row = i * group + g;
        if (pairs) {
          // A copy loop, not memcpy: a libc call per 128-byte row costs a visible share of decode attention.
          const uint32_t* pairs_src = reinterpret_cast<const uint32_t*>(src);
          for (int64_t dp = 0; dp < D / 2; ++dp) QP[row * (D / 2) + dp] = pairs_src[dp];
        } else {
          float* dst = Q + row * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
        }
      }
    }
    std::fill(acc, acc + R * D, 0.f);
    std::fill(M, M + R, -std::numeric_limits<float>::infinity());
    std::fill(L, L + R, 0.f);
    const int32_t* table = tables + it.seq * max_blocks;
    const int64_t first_pos = pos(it.seq, it.q_begin);
    const int64_t kv_hi = std::min<int64_t>(it.kv_end, pos(it.seq, it.q_end - 1) + 1);
    const T** krow = reinterpret_cast<const T**>(sc.krow.data());
    const T** vrow = reinterpret_cast<const T**>(sc.vrow.data());

    // Many rows (prefill tiles): K is transposed into float32 once per chunk, so each row's scores are
    // broadcast-FMAs over whole vectors of positions, and half-type V rows are widened once. Few rows
    // (decode): dot products straight from the pool beat paying for the copy; up to kSharedRows rows (a
    // decode's GQA group) share every K and V load.
    float *Kt = sc.kt.data(), *Vf = sc.vf.data();
    const float** vrow_f = reinterpret_cast<const float**>(sc.vrow_f.data());

#if defined(__AVX512BF16__)
    if (amx) amx_begin();
#endif
    for (int64_t c0 = it.kv_begin; c0 < kv_hi; c0 += kChunk) {
      const int64_t cn = std::min(kChunk, kv_hi - c0);
      for (int64_t j = 0; j < cn; ++j) {
        const int64_t p = c0 + j, blk = table[p / block_size], off = p % block_size;
        krow[j] = k + blk * kb + off * kt + it.kv_head * kh;
        vrow[j] = v + blk * vb + off * vt + it.kv_head * vh;
        // The chunk's rows requested at once (read one after another, each would wait for memory), in the
        // order they are used: a tile reads K, then V, before its first product; a decode scores all of K
        // first and asks for each V row as it scores the same position (row_scores*), so the K rows do not
        // queue behind V rows not needed yet, and the V requests overlap the scoring. (Requesting a decode's
        // V here too, the next chunk's rows during this one's work, or its K during V, all put requests
        // ahead of the rows needed first, and decode steps are slower for it.)
        if (tiled) {
          prefetch(krow[j], D * static_cast<int64_t>(sizeof(T)));
          prefetch(vrow[j], D * static_cast<int64_t>(sizeof(T)));
        } else {
          prefetch<1>(krow[j], D * static_cast<int64_t>(sizeof(T)));
        }
      }
      if (tiled) {
        const int64_t cols = std::min(kChunk, (cn + 4 * W - 1) / (4 * W) * (4 * W));
        if (pairs) {
          uint32_t* Kp = sc.kp.data();
          if (amx) {
            transpose_pairs(krow, cn, cols, Kp);
          } else {
            for (int64_t j = 0; j < cn; ++j) {
              uint32_t row[kMaxPairs];
              std::memcpy(row, krow[j], D * sizeof(T));
              for (int64_t dp = 0; dp < D / 2; ++dp) Kp[dp * kChunk + j] = row[dp];
            }
            for (int64_t dp = 0; dp < D / 2; ++dp) std::fill(Kp + dp * kChunk + cn, Kp + dp * kChunk + cols, 0u);
          }
#if defined(__AVX512BF16__)
          if (amx) {  // every row's scores at once; rows past R (to a whole tile) land in unused score rows
            amx_scores(QP, Kp, S, (R + 15) / 16 * 16, cols, D, kChunk, kChunk);  // unscaled: see softmax_bf16
          }
#endif
        } else {
          for (int64_t d = 0; d < D; ++d) {
            float* dst = Kt + d * kChunk;
            for (int64_t j = 0; j < cn; ++j) dst[j] = static_cast<float>(krow[j][d]);
            std::fill(dst + cn, dst + cols, 0.f);  // scored, never used: keep them finite
          }
        }
        if (amx) {  // V as AMX pairs (positions 2 jp, 2 jp + 1 of each dimension), zero past the chunk
          vnni_pairs(vrow, cn, (cn + 31) / 32 * 32, reinterpret_cast<uint32_t*>(Vf));
        } else if (v_pairs) {  // V interleaved once per chunk for accumulate_pairs: every tile of rows reads it
          uint32_t* Vp = reinterpret_cast<uint32_t*>(Vf);
          for (int64_t jp = 0; jp < (cn + 1) / 2; ++jp) {
            for (int64_t d = 0; d < D; d += 32) {
              pairvec lo, hi;
              interleave(vrow, cn, jp, d, lo, hi);
              store_pairs(Vp + jp * D + d, lo, hi);
            }
          }
        } else {
          for (int64_t j = 0; j < cn; ++j) {
            if constexpr (std::is_same_v<T, float>) {
              vrow_f[j] = vrow[j];
            } else {
              widen(vrow[j], Vf + j * D, D);
              vrow_f[j] = Vf + j * D;
            }
          }
        }
      }
      // Causal: row r (query r / group) sees positions <= its own; later queries see at least as much.
      auto visible = [&](int64_t r) { return std::min(cn, first_pos + r / group + 1 - c0); };
      if (!tiled) {
        for (int64_t r = 0; r < R; r += kSharedRows) {
          const int64_t nr = std::min(kSharedRows, R - r);
          int64_t n_vis[kSharedRows];
          for (int64_t i = 0; i < nr; ++i) n_vis[i] = visible(r + i);
          const int64_t n = n_vis[nr - 1];  // a later row sees at least as much
          if (n <= 0) continue;
          const Rows rows{Q + r * D, QP + r * (D / 2), pairs, S + r * kChunk, M + r, L + r, acc + r * D, n_vis};
          switch (nr) {
            case 1: shared_rows<1>(rows, n, krow, vrow, r == 0, sc.part.data()); break;
            case 2: shared_rows<2>(rows, n, krow, vrow, r == 0, sc.part.data()); break;
            case 3: shared_rows<3>(rows, n, krow, vrow, r == 0, sc.part.data()); break;
            default: shared_rows<4>(rows, n, krow, vrow, r == 0, sc.part.data()); break;
          }
        }
        continue;
      }
#if defined(__AVX512BF16__)
      if (amx) {
        // Every row's softmax step, its probabilities in bf16 (zero past what the row sees, and in the rows
        // past R that fill the last tile), then P V for all rows on the tiles, into the accumulators.
        const int64_t rows16 = (R + 15) / 16 * 16, cols32 = (cn + 31) / 32 * 32;
        uint16_t* Pb = sc.pb.data();
        for (int64_t r = 0; r < rows16; ++r) {
          softmax_bf16(S + r * kChunk, r < R ? visible(r) : 0, cols32, M[r], L[r], acc + r * D, Pb + r * kChunk);
        }
        amx_pv(Pb, reinterpret_cast<const uint32_t*>(Vf), acc, rows16, cols32, D, kChunk);
        continue;
      }
#endif
      // kTileRows rows at a time. A tile's last rows may be fewer: the missing ones are scored from a real
      // row into spare score rows, weigh nothing and accumulate into spare accumulators (sc holds both).
      const int64_t spare = R;  // rows from R on are free (the buffers hold kTileRows more than a tile's rows)
      for (int64_t r = 0; r < R; r += kTileRows) {
        const int64_t nr = std::min(kTileRows, R - r);
        int64_t n_vis[kTileRows];
        const float* qs[kTileRows];
        const uint32_t* qps[kTileRows];
        float *ss[kTileRows], *as[kTileRows];
        for (int64_t i = 0; i < kTileRows; ++i) {
          const int64_t row = r + std::min(i, nr - 1);
          n_vis[i] = i < nr ? visible(row) : 0;
          qs[i] = Q + row * D;
          qps[i] = QP + row * (D / 2);
          ss[i] = S + (i < nr ? row : spare + i) * kChunk;
          as[i] = acc + (i < nr ? row : spare + i) * D;
        }
        const int64_t n = n_vis[nr - 1];  // a later row sees at least as much
        if (n <= 0) continue;
        if (amx) {
          // scored above
        } else if (pairs) {
          scores_pairs(qps, sc.kp.data(), n, ss);
        } else {
          scores_tiled(qs, Kt, n, ss);
        }
        // A row that sees fewer positions weighs the rest 0, so all accumulate over the same n.
        for (int64_t i = 0; i < kTileRows; ++i) {
          if (n_vis[i] > 0) softmax_step(ss[i], n_vis[i], M[r + i], L[r + i], as[i]);
          std::fill(ss[i] + std::max<int64_t>(n_vis[i], 0), ss[i] + n, 0.f);
        }
        if (v_pairs) {
          const uint32_t* Vp = reinterpret_cast<const uint32_t*>(Vf);
          auto pair = [&](int64_t jp, int64_t d, pairvec& lo, pairvec& hi) { load_pairs(Vp + jp * D + d, lo, hi); };
          if (D % 64 == 0) {
            accumulate_pairs<kTileRows, 2>(ss, as, n, pair);
          } else {
            accumulate_pairs<kTileRows, 1>(ss, as, n, pair);
          }
        } else {
          accumulate_rows(ss, n, vrow_f, as);
        }
      }
    }

#if defined(__AVX512BF16__)
    if (amx) amx_end();
#endif
    if (it.partial >= 0) {
      std::memcpy(p_acc + it.partial * D, acc, R * D * sizeof(float));
      std::memcpy(p_m + it.partial, M, R * sizeof(float));
      std::memcpy(p_l + it.partial, L, R * sizeof(float));
      return;
    }
    for (int64_t r = 0; r < R; ++r) {
      write_row(acc + r * D, 1.f / L[r], tok0 + r / group, it.kv_head * group + r % group);
    }
  }

  // Up to kSharedRows consecutive rows of a work item: their queries (scaled float32, or bf16 pairs when
  // ``pairs``), score rows (kChunk apart), running max and sum, accumulators, and how many of the chunk's
  // positions each may see.
  struct Rows {
    const float* q;
    const uint32_t* qp;  // the rows' bf16 query pairs, when scored on pairs
    bool pairs;
    float *s, *m, *l, *acc;
    const int64_t* n_vis;
  };

  // shared_rows' scores from float32 queries: each K row is loaded (and widened) once for all NR rows.
  // vrow_ask (or null): the chunk's V rows, each requested from memory as its position is scored.
  template <int NR>
  void row_scores(const Rows& rw, int64_t n, const T* const* krow, const T* const* vrow_ask, float* part) const {
    const int64_t D = head_dim;
    for (int64_t j0 = 0; j0 < n; j0 += W) {
      const int64_t m = std::min<int64_t>(W, n - j0);
      for (int64_t jj = 0; jj < m; ++jj) {
        const T* k = krow[j0 + jj];
        if (vrow_ask != nullptr) prefetch<1>(vrow_ask[j0 + jj], D * static_cast<int64_t>(sizeof(T)));
        vf a[NR];
        for (int i = 0; i < NR; ++i) a[i] = vzero();
        int64_t d = 0;
        for (; d + W <= D; d += W) {
          const vf kv = vload(k + d);
          for (int i = 0; i < NR; ++i) a[i] = vfma(vload(rw.q + i * D + d), kv, a[i]);
        }
        for (int i = 0; i < NR; ++i) vstore(part + (i * W + jj) * W, a[i]);
        for (; d < D; ++d) {  // head sizes off the vector grid: the rest into lane 0
          const float kd = static_cast<float>(k[d]);
          for (int i = 0; i < NR; ++i) part[(i * W + jj) * W] += rw.q[i * D + d] * kd;
        }
      }
      for (int64_t jj = m; jj < W; ++jj) {
        for (int i = 0; i < NR; ++i) vstore(part + (i * W + jj) * W, vzero());
      }
      for (int i = 0; i < NR; ++i) vstore(rw.s + i * kChunk + j0, vsum_rows(part + i * W * W));
    }
  }

  // shared_rows' scores from bf16 pairs: each K row is kRowPairs-pair vectors multiplied by the rows'
  // query pairs (held in registers) with vdpbf16ps, then summed W positions at a time as in shared_rows.
  template <int NR>
  void row_scores_pairs(const Rows& rw, int64_t n, const T* const* krow, const T* const* vrow_ask,
                        float* part) const {
#if defined(__AVX512BF16__)
    const int64_t nv = head_dim / kRowPairs;
    __m512bh qv[NR][kRowVecs];
    for (int i = 0; i < NR; ++i) {
      for (int64_t b = 0; b < nv; ++b) {
        qv[i][b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(rw.qp + i * (head_dim / 2) + b * 16));
      }
    }
    const vf vs = vset1(scale);
    for (int64_t j0 = 0; j0 < n; j0 += W) {
      const int64_t m = std::min<int64_t>(W, n - j0);
      for (int64_t jj = 0; jj < m; ++jj) {
        const T* k = krow[j0 + jj];
        if (vrow_ask != nullptr) prefetch<1>(vrow_ask[j0 + jj], head_dim * static_cast<int64_t>(sizeof(T)));
        vf a[NR];
        for (int i = 0; i < NR; ++i) a[i] = vzero();
        for (int64_t b = 0; b < nv; ++b) {
          const __m512bh kv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + b * kRowPairs));
          for (int i = 0; i < NR; ++i) a[i] = _mm512_dpbf16_ps(a[i], qv[i][b], kv);
        }
        for (int i = 0; i < NR; ++i) vstore(part + (i * W + jj) * W, a[i]);
      }
      for (int64_t jj = m; jj < W; ++jj) {
        for (int i = 0; i < NR; ++i) vstore(part + (i * W + jj) * W, vzero());
      }
      for (int i = 0; i < NR; ++i) vstore(rw.s + i * kChunk + j0, vmul(vsum_rows(part + i * W * W), vs));
    }
#else
    (void)rw, (void)n, (void)krow, (void)vrow_ask, (void)part;
    TORCH_CHECK(false, "paged_attention: bf16 pair scores need an AVX512-BF16 build");
#endif
  }

  // One chunk of n positions for NR rows at once. Scores: each K row is loaded (and widened) once for
  // all NR rows, and the per-position vector products of W positions are summed by one transpose-and-add
  // tree (vsum_rows) instead of W horizontal sums. Then each row's softmax step, and the weighted V rows
  // added to all NR accumulators from one load of each V row.
  template <int NR>
  void shared_rows(const Rows& rw, int64_t n, const T* const* krow, const T* const* vrow, bool ask_v,
                   float* part) const {
    const int64_t D = head_dim;
    if (rw.pairs) {
      row_scores_pairs<NR>(rw, n, krow, ask_v ? vrow : nullptr, part);
    } else {
      row_scores<NR>(rw, n, krow, ask_v ? vrow : nullptr, part);
    }
    for (int i = 0; i < NR; ++i) {
      float* s = rw.s + i * kChunk;
      const int64_t nv = rw.n_vis[i];
      if (nv > 0) softmax_step(s, nv, rw.m[i], rw.l[i], rw.acc + i * D);
      std::fill(s + std::max<int64_t>(nv, 0), s + n, 0.f);  // positions after the row's own weigh 0
    }
    if (rw.pairs) {
      float* ss[NR];
      float* as[NR];
      for (int i = 0; i < NR; ++i) ss[i] = rw.s + i * kChunk, as[i] = rw.acc + i * D;
      auto pair = [&](int64_t jp, int64_t d, pairvec& lo, pairvec& hi) { interleave(vrow, n, jp, d, lo, hi); };
      if (D % 64 == 0) {
        accumulate_pairs<NR, 2>(ss, as, n, pair);
      } else {
        accumulate_pairs<NR, 1>(ss, as, n, pair);
      }
      return;
    }
    constexpr int VB = W >= 16 ? 4 : (W >= 8 ? 2 : 1);  // vectors of D per pass, to stay in registers
    int64_t d = 0;
    for (; d + VB * W <= D; d += VB * W) {
      vf a[NR][VB];
      for (int i = 0; i < NR; ++i) {
        for (int b = 0; b < VB; ++b) a[i][b] = vload(rw.acc + i * D + d + b * W);
      }
      for (int64_t j = 0; j < n; ++j) {
        const T* v = vrow[j] + d;
        vf vv[VB];
        for (int b = 0; b < VB; ++b) vv[b] = vload(v + b * W);
        for (int i = 0; i < NR; ++i) {
          const vf p = vset1(rw.s[i * kChunk + j]);
          for (int b = 0; b < VB; ++b) a[i][b] = vfma(p, vv[b], a[i][b]);
        }
      }
      for (int i = 0; i < NR; ++i) {
        for (int b = 0; b < VB; ++b) vstore(rw.acc + i * D + d + b * W, a[i][b]);
      }
    }
    if (d < D) {
      for (int i = 0; i < NR; ++i) accumulate_from(rw.s + i * kChunk, n, vrow, rw.acc + i * D, d);
    }
  }

  // acc[i] += sum_j s[i][j] V[j] for NR rows on bf16 pairs: the probabilities rounded to bf16 (as flash
  // attention does before its PV product; the sums stay float32), two consecutive positions per vdpbf16ps.
  // pair(jp, d, lo, hi) gives V rows 2 jp and 2 jp + 1 interleaved 16 bits at a time over dims [d, d + 32) (an
  // odd n's last partner may be any finite row: it weighs 0). unpacklo/hi interleave within 128-bit lanes, so
  // the accumulators hold those dims permuted while the positions run (lo: d + 0-3, 8-11, ...; hi: 4-7, ...).
  // s[i] must have room up to n rounded up to 32 (kChunk does).
  template <int NR, int KB, typename Pair>
  void accumulate_pairs(float* const* s, float* const* acc, int64_t n, const Pair& pair) const {
#if defined(__AVX512BF16__)
    const int64_t np = (n + 1) / 2;
    uint32_t pp[NR][kChunk / 2];
    for (int i = 0; i < NR; ++i) {
      std::fill(s[i] + n, s[i] + (n + 31) / 32 * 32, 0.f);
      for (int64_t j0 = 0; j0 < n; j0 += 32) {
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s[i] + j0 + 16), _mm512_loadu_ps(s[i] + j0));
        _mm512_storeu_si512(pp[i] + j0 / 2, reinterpret_cast<__m512i>(b));
      }
    }
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32 * KB) {
      __m512 a[NR][2 * KB];
      for (int i = 0; i < NR; ++i) {
        for (int b = 0; b < KB; ++b) {
          const float* x = acc[i] + d0 + 32 * b;
          const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
          a[i][2 * b] = _mm512_shuffle_f32x4(x0, x1, 0x88);
          a[i][2 * b + 1] = _mm512_shuffle_f32x4(x0, x1, 0xDD);
        }
      }
      for (int64_t jp = 0; jp < np; ++jp) {
        for (int b = 0; b < KB; ++b) {
          pairvec lo, hi;
          pair(jp, d0 + 32 * b, lo, hi);
          for (int i = 0; i < NR; ++i) {
            const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pp[i][jp])));
            a[i][2 * b] = _mm512_dpbf16_ps(a[i][2 * b], p, reinterpret_cast<__m512bh>(lo));
            a[i][2 * b + 1] = _mm512_dpbf16_ps(a[i][2 * b + 1], p, reinterpret_cast<__m512bh>(hi));
          }
        }
      }
      for (int i = 0; i < NR; ++i) {
        for (int b = 0; b < KB; ++b) {
          float* x = acc[i] + d0 + 32 * b;
          const __m512 lo = a[i][2 * b], hi = a[i][2 * b + 1];
          const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, 0x44), t1 = _mm512_shuffle_f32x4(lo, hi, 0xEE);
          _mm512_storeu_ps(x, _mm512_shuffle_f32x4(t0, t0, 0xD8));
          _mm512_storeu_ps(x + 16, _mm512_shuffle_f32x4(t1, t1, 0xD8));
        }
      }
    }
#else
    (void)s, (void)acc, (void)n, (void)pair;
    TORCH_CHECK(false, "paged_attention: bf16 pair accumulation needs an AVX512-BF16 build");
#endif
  }

  // Interleaved V pairs (lo, then hi) to and from a chunk's buffer.
  static void store_pairs(uint32_t* dst, const pairvec& lo, const pairvec& hi) {
#if defined(__AVX512BF16__)
    _mm512_storeu_si512(dst, lo);
    _mm512_storeu_si512(dst + 16, hi);
#else
    (void)dst, (void)lo, (void)hi;
#endif
  }
  static void load_pairs(const uint32_t* src, pairvec& lo, pairvec& hi) {
#if defined(__AVX512BF16__)
    lo = _mm512_loadu_si512(src);
    hi = _mm512_loadu_si512(src + 16);
#else
    (void)src, (void)lo, (void)hi;
#endif
  }

  // The chunk's K rows [0, n) as pairs along the head dimension, transposed: dst[dp * kChunk + j] holds dims
  // 2 dp, 2 dp + 1 of position j, for j < cols (a multiple of 16; zero from n on) and D a multiple of 32.
  // Sixteen positions by sixteen pairs at a time, transposed in registers.
  void transpose_pairs(const T* const* krow, int64_t n, int64_t cols, uint32_t* dst) const {
#if defined(__AVX512BF16__)
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
      for (int64_t dp0 = 0; dp0 < head_dim / 2; dp0 += 16) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i) {
          r[i] = j0 + i < n ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(krow[j0 + i]) + dp0)
                            : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (dp0 + i) * kChunk + j0, r[i]);
      }
    }
#else
    (void)krow, (void)n, (void)cols, (void)dst;
#endif
  }

#if defined(__AVX512F__)
  // r[i] = column i of the 16 x 16 matrix of 32-bit values whose rows were r[0..16): pairs of rows interleaved,
  // then pairs of pairs, then the 128-bit lanes (each holding one column's four rows of a group) put in place.
  static void transpose16(__m512i* r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; ++g) {  // u[4 g + m], lane k: column 4 k + m of rows 4 g .. 4 g + 3
      u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int m = 0; m < 4; ++m) {
      const __m512i a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), b = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
      const __m512i c = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
      const __m512i d = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
      r[m] = _mm512_shuffle_i32x4(a, c, 0x88);
      r[4 + m] = _mm512_shuffle_i32x4(a, c, 0xDD);
      r[8 + m] = _mm512_shuffle_i32x4(b, d, 0x88);
      r[12 + m] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
  }
#endif

  // The chunk's V rows [0, n) as AMX pairs for amx_pv: dst[jp * D + d] holds dimension d of positions 2 jp
  // (low half) and 2 jp + 1, for jp < cols / 2; positions from n on are zero.
  void vnni_pairs(const T* const* vrow, int64_t n, int64_t cols, uint32_t* dst) const {
#if defined(__AVX512BF16__)
    const int64_t D = head_dim;
    for (int64_t jp = 0; jp < cols / 2; ++jp) {
      const T* v0 = 2 * jp < n ? vrow[2 * jp] : nullptr;
      const T* v1 = 2 * jp + 1 < n ? vrow[2 * jp + 1] : nullptr;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i x = v0 != nullptr ? _mm512_loadu_si512(v0 + d) : _mm512_setzero_si512();
        const __m512i y = v1 != nullptr ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
        // unpacklo/hi pair dims 0-3 and 4-7 of each 128-bit lane; the shuffles put the lanes back in order.
        const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
        const __m512i t0 = _mm512_shuffle_i32x4(lo, hi, 0x44), t1 = _mm512_shuffle_i32x4(lo, hi, 0xEE);
        _mm512_storeu_si512(dst + jp * D + d, _mm512_shuffle_i32x4(t0, t0, 0xD8));
        _mm512_storeu_si512(dst + jp * D + d + 16, _mm512_shuffle_i32x4(t1, t1, 0xD8));
      }
    }
#else
    (void)vrow, (void)n, (void)cols, (void)dst;
#endif
  }

  // V rows 2 jp and 2 jp + 1 of a chunk interleaved for accumulate_pairs, straight from the pool.
  static void interleave(const T* const* vrow, int64_t n, int64_t jp, int64_t d, pairvec& lo, pairvec& hi) {
#if defined(__AVX512BF16__)
    const T* v0 = vrow[2 * jp];
    const T* v1 = 2 * jp + 1 < n ? vrow[2 * jp + 1] : v0;
    const __m512i x = _mm512_loadu_si512(v0 + d), y = _mm512_loadu_si512(v1 + d);
    lo = _mm512_unpacklo_epi16(x, y);
    hi = _mm512_unpackhi_epi16(x, y);
#else
    (void)vrow, (void)n, (void)jp, (void)d, (void)lo, (void)hi;
#endif
  }

  // Scores s[0..n) of one row -> unnormalized probabilities under the row's running max m, which may
  // grow (then the sum l and the accumulator so far are rescaled to the new max). A last partial vector
  // is handled as a masked one: one e^x per position off the vector grid (libm's, scalar) cost as much
  // as the rest of a decode chunk's softmax.
  void softmax_step(float* s, int64_t n, float& m, float& l, float* acc_row) const {
    const int64_t whole = n / W * W, rest = n - whole;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    vf vm = vset1(neg_inf);
    for (int64_t j = 0; j < whole; j += W) vm = vmax(vm, vload(s + j));
    if (rest > 0) vm = vmax(vm, vload_part(s + whole, rest, neg_inf));
    const float mx = vhmax(vm);
    if (mx > m) {
      const float alpha = std::exp(m - mx);  // 0 on the first chunk (m = -inf)
      l *= alpha;
      if (alpha != 0.f) scale_row(acc_row, alpha);
      m = mx;
    }
    const vf vmax_row = vset1(m);
    vf vsum = vzero();
    for (int64_t j = 0; j < whole; j += W) {
      const vf e = vexp(vsub(vload(s + j), vmax_row));
      vstore(s + j, e);
      vsum = vadd(vsum, e);
    }
    if (rest > 0) {  // e^(-inf) would be clamped to e^-87, not 0: the spare lanes are left out of the sum
      const vf e = vexp(vsub(vload_part(s + whole, rest, 0.f), vmax_row));
      vstore_part(s + whole, e, rest);
      vsum = vadd(vsum, vload_part(s + whole, rest, 0.f));
    }
    l += vhsum(vsum);
  }

  // softmax_step for the AMX path, from unscaled scores s[0..n) (the scale applied in the exponent), into
  // bf16 probabilities p[0..cols) (cols a multiple of 32; zero from n on, all zero for n <= 0) in one pass.
  void softmax_bf16(const float* s, int64_t n, int64_t cols, float& m, float& l, float* acc_row,
                    uint16_t* p) const {
#if defined(__AVX512BF16__)
    if (n <= 0) {
      std::fill(p, p + cols, uint16_t{0});
      return;
    }
    auto below = [](int64_t k) -> __mmask16 { return k >= 16 ? 0xFFFF : k <= 0 ? 0 : (1u << k) - 1; };
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 vm = neg_inf;
    for (int64_t j = 0; j < n; j += 16) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(neg_inf, below(n - j), s + j));
    const float mx = _mm512_reduce_max_ps(vm) * scale;  // scale > 0: the max of the scaled scores
    if (mx > m) {
      const float alpha = std::exp(m - mx);  // 0 on the first chunk (m = -inf)
      l *= alpha;
      if (alpha != 0.f) scale_row(acc_row, alpha);
      m = mx;
    }
    // e^(s scale - m) as 2^(s scale log2 e - m log2 e): one FMA into base 2 for exp2_poly.
    constexpr float kLog2e = 1.44269504088896341f;
    const __m512 vs = _mm512_set1_ps(scale * kLog2e), vneg_m = _mm512_set1_ps(-m * kLog2e);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j += 32) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const __mmask16 k = below(n - j - 16 * h);
        e[h] = k == 0 ? _mm512_setzero_ps()
                      : _mm512_maskz_mov_ps(k, exp2_poly(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + j + 16 * h),
                                                                          vs, vneg_m)));
        vsum = _mm512_add_ps(vsum, e[h]);
      }
      _mm512_storeu_si512(p + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[1], e[0])));
    }
    l += _mm512_reduce_add_ps(vsum);
#else
    (void)s, (void)n, (void)cols, (void)m, (void)l, (void)acc_row, (void)p;
#endif
  }

  // s[i][0..n) = q[i] . K[j] for K transposed [D, kChunk], for kTileRows rows: four vectors of positions
  // per pass over D, each K vector loaded once for every row.
  void scores_tiled(const float* const* q, const float* Kt, int64_t n, float* const* s) const {
    for (int64_t c = 0; c < n; c += 4 * W) {
      vf a[kTileRows][4];
      for (auto& row : a) {
        for (vf& x : row) x = vzero();
      }
      const float* col = Kt + c;
      for (int64_t d = 0; d < head_dim; ++d, col += kChunk) {
        const vf k[4] = {vload(col), vload(col + W), vload(col + 2 * W), vload(col + 3 * W)};
        for (int64_t i = 0; i < kTileRows; ++i) {
          const vf x = vset1(q[i][d]);
          for (int b = 0; b < 4; ++b) a[i][b] = vfma(x, k[b], a[i][b]);
        }
      }
      for (int64_t i = 0; i < kTileRows; ++i) {
        for (int b = 0; b < 4; ++b) vstore(s[i] + c + b * W, a[i][b]);
      }
    }
  }

  // As scores_tiled, from bf16 pairs: q[i] holds D / 2 pairs of the row's (unscaled) query, Kp the chunk's
  // K as [D / 2, kChunk] pairs. Products of bf16 values are exact in float32; only the sums round.
  void scores_pairs(const uint32_t* const* q, const uint32_t* Kp, int64_t n, float* const* s) const {
#if defined(__AVX512BF16__)
    const vf vs = vset1(scale);
    for (int64_t c = 0; c < n; c += 4 * W) {
      vf a[kTileRows][4];
      for (auto& row : a) {
        for (vf& x : row) x = vzero();
      }
      const uint32_t* col = Kp + c;
      for (int64_t dp = 0; dp < head_dim / 2; ++dp, col += kChunk) {
        __m512bh k[4];
        for (int b = 0; b < 4; ++b) k[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(col + b * W));
        for (int64_t i = 0; i < kTileRows; ++i) {
          const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(q[i][dp])));
          for (int b = 0; b < 4; ++b) a[i][b] = _mm512_dpbf16_ps(a[i][b], x, k[b]);
        }
      }
      for (int64_t i = 0; i < kTileRows; ++i) {
        for (int b = 0; b < 4; ++b) vstore(s[i] + c + b * W, vmul(a[i][b], vs));
      }
    }
#else
    (void)q, (void)Kp, (void)n, (void)s;
    TORCH_CHECK(false, "paged_attention: bf16 pair scores need an AVX512-BF16 build");
#endif
  }

  // acc[i] += sum_j p[i][j] V[j] for kTileRows rows, sharing the loads of V.
  void accumulate_rows(float* const* p, int64_t n, const float* const* vrows, float* const* acc) const {
    const int64_t D = head_dim;
    int64_t d = 0;
    for (; d + 4 * W <= D; d += 4 * W) {
      vf a[kTileRows][4];
      for (int64_t i = 0; i < kTileRows; ++i) {
        for (int b = 0; b < 4; ++b) a[i][b] = vload(acc[i] + d + b * W);
      }
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vrows[j] + d;
        const vf vv[4] = {vload(v), vload(v + W), vload(v + 2 * W), vload(v + 3 * W)};
        for (int64_t i = 0; i < kTileRows; ++i) {
          const vf x = vset1(p[i][j]);
          for (int b = 0; b < 4; ++b) a[i][b] = vfma(x, vv[b], a[i][b]);
        }
      }
      for (int64_t i = 0; i < kTileRows; ++i) {
        for (int b = 0; b < 4; ++b) vstore(acc[i] + d + b * W, a[i][b]);
      }
    }
    if (d < D) {  // head sizes off the 4-vector grid: the rest one row at a time
      for (int64_t i = 0; i < kTileRows; ++i) accumulate_from(p[i], n, vrows, acc[i], d);
    }
  }

  static void widen(const T* src, float* dst, int64_t n) {
    int64_t d = 0;
    for (; d + W <= n; d += W) vstore(dst + d, vload(src + d));
    for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }

  void scale_row(float* row, float a) const {
    const vf va = vset1(a);
    int64_t d = 0;
    for (; d + W <= head_dim; d += W) vstore(row + d, vmul(vload(row + d), va));
    for (; d < head_dim; ++d) row[d] *= a;
  }

  // acc_row += sum_j p[j] * V[j] from column d on, the accumulator held in registers four vectors at a time.
  template <typename U>
  void accumulate_from(const float* p, int64_t n, const U* const* vrows, float* acc_row, int64_t d) const {
    const int64_t D = head_dim;
    for (; d + 4 * W <= D; d += 4 * W) {
      vf a0 = vload(acc_row + d), a1 = vload(acc_row + d + W), a2 = vload(acc_row + d + 2 * W),
         a3 = vload(acc_row + d + 3 * W);
      for (int64_t j = 0; j < n; ++j) {
        const vf pj = vset1(p[j]);
        const U* x = vrows[j] + d;
        a0 = vfma(pj, vload(x), a0);
        a1 = vfma(pj, vload(x + W), a1);
        a2 = vfma(pj, vload(x + 2 * W), a2);
        a3 = vfma(pj, vload(x + 3 * W), a3);
      }
      vstore(acc_row + d, a0);
      vstore(acc_row + d + W, a1);
      vstore(acc_row + d + 2 * W, a2);
      vstore(acc_row + d + 3 * W, a3);
    }
    for (; d + W <= D; d += W) {
      vf a0 = vload(acc_row + d);
      for (int64_t j = 0; j < n; ++j) a0 = vfma(vset1(p[j]), vload(vrows[j] + d), a0);
      vstore(acc_row + d, a0);
    }
    for (; d < D; ++d) {
      float a = acc_row[d];
      for (int64_t j = 0; j < n; ++j) a += p[j] * static_cast<float>(vrows[j][d]);
      acc_row[d] = a;
    }
  }

  void write_row(const float* src, float inv, int64_t token, int64_t head) const {
    T* dst = out + token * o_s0 + head * o_s1;
    const vf vi = vset1(inv);
    int64_t d = 0;
    for (; d + W <= head_dim; d += W) vstore(dst + d, vmul(vload(src + d), vi));
    for (; d < head_dim; ++d) dst[d] = static_cast<T>(src[d] * inv);
  }

  // Merges the parts of one split item: weights e^(m_p - max) put every part under the common max.
  void merge(const Merge& mg, std::vector<float>& buf) const {
    const int64_t D = head_dim, R = (mg.q_end - mg.q_begin) * group;
    buf.resize(D);
    for (int64_t r = 0; r < R; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < mg.parts; ++p) mx = std::max(mx, p_m[mg.partial + p * R + r]);
      std::fill(buf.begin(), buf.end(), 0.f);
      float l = 0.f;
      for (int64_t p = 0; p < mg.parts; ++p) {
        const int64_t row = mg.partial + p * R + r;
        if (p_l[row] == 0.f) continue;  // a part wholly after this query's position
        const float w = std::exp(p_m[row] - mx);
        l += w * p_l[row];
        const float* a = p_acc + row * D;
        for (int64_t d = 0; d < D; ++d) buf[d] += w * a[d];
      }
      write_row(buf.data(), 1.f / l, starts[mg.seq] + mg.q_begin + r / group, mg.kv_head * group + r % group);
    }
  }
};

// One layer's K and V caches, each [num_blocks, block_size, Hkv, D], as base pointers and element strides: a
// step's layers reach their caches by arithmetic on the pool, not by a tensor select per layer.
struct KvLayer {
  void *k, *v;
  int64_t kb, kt, kh, vb, vt, vh;
};

KvLayer kv_layer(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
          v_cache.stride(0),  v_cache.stride(1),  v_cache.stride(2)};
}

// Layer `layer` of a pool [layers, 2, num_blocks, block_size, Hkv, D].
KvLayer kv_layer(const at::Tensor& kv_cache, int64_t layer) {
  char* base = static_cast<char*>(kv_cache.data_ptr()) + layer * kv_cache.stride(0) * kv_cache.element_size();
  char* v = base + kv_cache.stride(1) * kv_cache.element_size();
  return {base, v, kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
          kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4)};
}

bool amx_tiles_possible(at::ScalarType dtype, int64_t head_dim) {
#if defined(__AVX512BF16__)
  return kPairDot && dtype == at::kBFloat16 && head_dim % 32 == 0 && head_dim <= 2 * kMaxPairs &&
         amx_wanted.load(std::memory_order_relaxed) && amx_supported();
#else
  (void)dtype, (void)head_dim;
  return false;
#endif
}

// A step's attention work: its batch checked and its work items laid out. Every layer of a step attends from
// the same positions over the same block tables, only through its own cache, so DecoderStack::forward plans
// once per step and runs the plan once per layer.
struct AttentionPlan {
  at::Tensor starts, tables, lens;  // int32, contiguous, checked against the cache shape
  std::vector<Item> items;          // largest first, as the threads take them
  std::vector<Merge> merges;        // split items, combined after the parallel region
  int64_t partial_rows = 0, q_tile = 0, per_grab = 1, group = 0, head_dim = 0, num_kv_heads = 0, block_size = 0;
  bool amx_tiles = false;
};

// Checks what the kernel trusts (here, not inside the parallel region) for queries of `query_sizes` [T, Hq, D]
// and `dtype` over caches of `cache_sizes` [num_blocks, block_size, Hkv, D], and lays out the work items.
AttentionPlan plan_attention(at::IntArrayRef query_sizes, at::ScalarType dtype, at::IntArrayRef cache_sizes,
                             const at::Tensor& block_tables, const c10::optional<at::Tensor>& query_start_loc,
                             const at::Tensor& context_lens) {
  const char* what = "paged_attention (cpu)";
  TORCH_CHECK(query_sizes[1] % cache_sizes[2] == 0, what, ": Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              what, ": block_tables and context_lens must be int32");
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              what, ": one block table per sequence");
  AttentionPlan plan;
  if (query_start_loc.has_value()) {
    plan.starts = query_start_loc->to(at::kInt).contiguous();
    TORCH_CHECK(plan.starts.dim() == 1 && plan.starts.size(0) == num_seqs + 1,
                what, ": query_start_loc must be [B + 1]");
  } else {  // decode: one query token per sequence
    TORCH_CHECK(query_sizes[0] == num_seqs, what, ": one query per sequence");
    plan.starts = at::arange(num_seqs + 1, context_lens.options());
  }
  plan.tables = block_tables.contiguous();
  plan.lens = context_lens.contiguous();
  const int32_t* st = plan.starts.data_ptr<int32_t>();
  const int32_t* ln = plan.lens.data_ptr<int32_t>();
  const int32_t* tb = plan.tables.data_ptr<int32_t>();
  const int64_t num_blocks = cache_sizes[0], block_size = cache_sizes[1], max_blocks = plan.tables.size(1);
  TORCH_CHECK(st[0] == 0 && st[num_seqs] == query_sizes[0], what, ": query_start_loc must run from 0 to T");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n_q = st[s + 1] - st[s], ctx = ln[s];
    TORCH_CHECK(n_q >= 0 && n_q <= ctx, what, ": sequence ", s, " has ", n_q, " queries but a context of ", ctx);
    TORCH_CHECK(ctx <= max_blocks * block_size, what, ": context of sequence ", s, " (", ctx,
                " tokens) is longer than its block table");
    for (int64_t i = 0, used = (ctx + block_size - 1) / block_size; i < used; ++i) {
      const int32_t b = tb[s * max_blocks + i];
      TORCH_CHECK(b >= 0 && b < num_blocks, what, ": block id ", b, " of sequence ", s,
                  " is outside the cache (", num_blocks, " blocks)");
    }
  }
  plan.num_kv_heads = cache_sizes[2];
  plan.group = query_sizes[1] / plan.num_kv_heads;
  plan.head_dim = query_sizes[2];
  plan.block_size = block_size;
  plan.amx_tiles = amx_tiles_possible(dtype, plan.head_dim);
  plan.q_tile = plan.amx_tiles ? kAmxQueryTile : kQueryTile;

  // Tiles, then (if threads would idle) KV parts.
  std::vector<Item>& items = plan.items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n_q = st[s + 1] - st[s];
    for (int64_t q0 = 0; q0 < n_q; q0 += plan.q_tile) {
      const int64_t q1 = std::min(n_q, q0 + plan.q_tile);
      for (int64_t h = 0; h < plan.num_kv_heads; ++h) {
        const int64_t kv_end = ln[s] - n_q + q1;  // the tile's last query's position + 1
        items.push_back({int32_t(s), int32_t(h), int32_t(q0), int32_t(q1), 0, int32_t(kv_end), -1,
                         (q1 - q0) * kv_end});
      }
    }
  }
  const int64_t threads = at::get_num_threads();
  if (!items.empty() && static_cast<int64_t>(items.size()) < threads) {
    int64_t longest = 0;
    for (const Item& it : items) longest = std::max<int64_t>(longest, it.kv_end);
    const int64_t want = (2 * threads + items.size() - 1) / items.size();
    int64_t split = std::max(kMinSplit, (longest + want - 1) / want);
    split = (split + kChunk - 1) / kChunk * kChunk;
    std::vector<Item> parts;
    for (const Item& it : items) {
      const int64_t n_parts = (it.kv_end + split - 1) / split;
      if (n_parts <= 1) {
        parts.push_back(it);
        continue;
      }
      const int64_t rows = (it.q_end - it.q_begin) * plan.group;
      plan.merges.push_back({it.seq, it.kv_head, it.q_begin, it.q_end, int32_t(n_parts), plan.partial_rows});
      for (int64_t p = 0; p < n_parts; ++p) {
        const int64_t b = p * split, e = std::min<int64_t>(it.kv_end, b + split);
        parts.push_back({it.seq, it.kv_head, it.q_begin, it.q_end, int32_t(b), int32_t(e), plan.partial_rows,
                         (it.q_end - it.q_begin) * (e - b)});
        plan.partial_rows += rows;
      }
    }
    items.swap(parts);
  }
  // Largest first: tiles of a long prefill cost far more than decodes. Items of equal cost are ordered by
  // sequence, tile and KV range, then KV head, so the KV heads of one sequence's tile sit next to each other.
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    if (x.cost != y.cost) return x.cost > y.cost;
    if (x.seq != y.seq) return x.seq < y.seq;
    if (x.q_begin != y.q_begin) return x.q_begin < y.q_begin;
    if (x.kv_begin != y.kv_begin) return x.kv_begin < y.kv_begin;
    return x.kv_head < y.kv_head;
  });
  // Handed out one tile's KV heads at a time when there are many tiles: a thread then reads the heads of the
  // same blocks one after another. A block's KV heads lie in one run of memory (head-major blocks, as the
  // engine allocates them, or token-major rows alike), so what the first head's reads and the hardware
  // prefetcher brought in serves the next heads (the "step" case of benchmarks/cpu_attention.py times a
  // decode step's attention). With few tiles, one item at a time keeps every
  // thread busy (a single decode's three heads would otherwise all go to one thread).
  const int64_t n_items = items.size();
  // AMX tiles are few and large, and balance better one at a time.
  const bool amx_items =
      plan.amx_tiles && n_items > 0 && (items[0].q_end - items[0].q_begin) * plan.group >= kTiledRows;
  plan.per_grab =
      plan.merges.empty() && !amx_items && n_items >= 8 * threads * plan.num_kv_heads ? plan.num_kv_heads : 1;
  return plan;
}

// Runs `plan` for queries [T, Hq, D] (checked against the plan by the caller) over one layer's caches.
template <typename T>
void attention_kernel(const AttentionPlan& plan, const at::Tensor& query, const KvLayer& kv, double scale,
                      at::Tensor& out) {
  Attention<T> a{};
  a.q = query.data_ptr<T>();
  a.k = static_cast<const T*>(kv.k);
  a.v = static_cast<const T*>(kv.v);
  a.out = out.data_ptr<T>();
  a.tables = plan.tables.data_ptr<int32_t>();
  a.starts = plan.starts.data_ptr<int32_t>();
  a.lens = plan.lens.data_ptr<int32_t>();
  a.q_s0 = query.stride(0), a.q_s1 = query.stride(1), a.o_s0 = out.stride(0), a.o_s1 = out.stride(1);
  a.kb = kv.kb, a.kt = kv.kt, a.kh = kv.kh, a.vb = kv.vb, a.vt = kv.vt, a.vh = kv.vh;
  a.max_blocks = plan.tables.size(1), a.block_size = plan.block_size;
  a.group = plan.group, a.head_dim = plan.head_dim;
  a.scale = static_cast<float>(scale);
  a.amx_tiles = plan.amx_tiles;
  const int64_t q_tile = plan.q_tile, partial_rows = plan.partial_rows, per_grab = plan.per_grab;
  const std::vector<Item>& items = plan.items;
  const std::vector<Merge>& merges = plan.merges;
  const int64_t threads = at::get_num_threads(), n_items = items.size();
  std::vector<float> p_acc(partial_rows * a.head_dim), p_m(partial_rows), p_l(partial_rows);
  a.p_acc = p_acc.data(), a.p_m = p_m.data(), a.p_l = p_l.data();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n_items), 1, [&](int64_t, int64_t) {
    // Per OpenMP thread, kept between calls: a step calls this once per layer, and fresh buffers would be
    // allocated and zero-filled every time.
    static thread_local Scratch sc;
    const int64_t rows = q_tile * a.group;
    sc.q.resize(rows * a.head_dim);
    sc.acc.resize((rows + kTileRows) * a.head_dim);  // + the spare rows of a tile's short last group
    sc.s.resize((rows + kTileRows) * kChunk);
    sc.qp.resize(rows * a.head_dim / 2);
    sc.kp.resize(kMaxPairs * kChunk);
    sc.pb.resize((rows + 16) * kChunk);
    sc.m.resize(rows);
    sc.l.resize(rows);
    sc.krow.resize(kChunk);
    sc.vrow.resize(kChunk);
    sc.vrow_f.resize(kChunk);
    sc.kt.resize(a.head_dim * kChunk);
    sc.vf.resize(kChunk * a.head_dim);
    sc.part.resize(kSharedRows * W * W);
    for (int64_t i; (i = next.fetch_add(per_grab)) < n_items;) {
      for (int64_t j = i; j < std::min(n_items, i + per_grab); ++j) a.run(items[j], sc);
    }
  });
  if (!merges.empty()) {
    at::parallel_for(0, merges.size(), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t i = begin; i < end; ++i) a.merge(merges[i], buf);
    });
  }
}

// ---- AMX linear (bf16 decode GEMMs) ---------------------------------------------------------------------
//
// y = x W^T for the few rows of a decode step (up to kAmxLinearRows), where the GEMM is a stream of the weights
// from memory and its products are nothing beside it. oneDNN's packed GEMM reads a weight at 10-16 GB/s on a
// 2-core AMX Xeon when it comes from memory; this one walks each thread's share of the weight in address
// order, with its lines asked for ahead of the tiles that read them, at 16-23 GB/s (1.3-1.8x the oneDNN call
// alone; benchmarks/step_ab.py measures the step). The weight is packed once (amx_pack_weight) as
// [N / 32][K / 32][2][16][16][2] bf16: per 32 output columns and 32 inputs, two 1 KiB B tiles (16 input pairs
// x 16 columns), so a thread's columns are one contiguous run of memory.

// Rows up to which amx_linear runs a projection: 1.2-1.36x oneDNN's call up to 128 rows (30 layers' weights from
// memory), near level at 192; a prefill's hundreds of rows reuse each weight tile enough for oneDNN's blocking.
constexpr int64_t kAmxLinearRows = 128;

// Bytes of weight asked for ahead of the tiles that read them, into L2 (prefetcht1): a pair of columns or
// more ahead. Into L1 (prefetcht0), or 8-16 KiB ahead, reads the weights 10-30% slower.
constexpr int64_t kAmxLinearAhead = 65536;

// Runs a decode GEMM's column blocks [0, blocks) as run(b0, b1, ahead_end): blocks [b0, b1), whose kernel may ask
// for the weights of the blocks after b1 up to ahead_end. Each thread owns one contiguous run of the blocks and
// walks it from the front in address order (its stream of the weight, asked for ahead); a thread done with its
// own run takes blocks from the back of another's. An even split alone left one thread waiting on the other in
// every projection: on a 2-core VM the two cores do not run at the same speed from one region to the next.
// Each grab is a quarter of what is left of the run (at least one block), so what one thread may still be
// running when the other finishes shrinks as the run does.
template <typename Run>
void per_thread_blocks(int64_t blocks, const Run& run) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), blocks);
  if (threads <= 1) {
    if (blocks > 0) run(0, blocks, blocks);
    return;
  }
  // Run t: blocks [front, back), packed as front | back << 32 so that one compare-exchange takes a range.
  std::vector<std::atomic<uint64_t>> spans(threads);
  for (int64_t t = 0; t < threads; ++t) {
    spans[t].store(static_cast<uint64_t>(blocks * t / threads) | static_cast<uint64_t>(blocks * (t + 1) / threads) << 32);
  }
  // A quarter of what is left of run t, from its front (the owner) or its back (another thread).
  auto take = [&](int64_t t, bool front, int64_t& b0, int64_t& b1, int64_t& ahead_end) {
    uint64_t span = spans[t].load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(span & 0xFFFFFFFFu), hi = static_cast<int64_t>(span >> 32);
      if (lo >= hi) return false;
      const int64_t n = std::max<int64_t>(1, (hi - lo) / 4);
      b0 = front ? lo : hi - n, b1 = front ? lo + n : hi, ahead_end = hi;
      const uint64_t rest = front ? (static_cast<uint64_t>(b1) | static_cast<uint64_t>(hi) << 32)
                                  : (static_cast<uint64_t>(lo) | static_cast<uint64_t>(b0) << 32);
      if (spans[t].compare_exchange_weak(span, rest, std::memory_order_relaxed)) return true;
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t b0, b1, ahead_end;
      while (take(t, true, b0, b1, ahead_end)) run(b0, b1, ahead_end);
      for (int64_t i = 1; i < threads; ++i) {
        while (take((t + i) % threads, false, b0, b1, ahead_end)) run(b0, b1, b1);
      }
    }
  });
}

// A register tile of f32_linear or bf16_linear: rows of x times one block of the packed weight (w), into y. On the
// way it asks for lines of another block (ahead, or nullptr): a step's lines (one per input; a step is one input or
// a pair) at every ahead_every-th step, from ahead on, so the lines of 1 / ahead_every of that block.
template <typename T>
using DecodeTile = void (*)(const T* x, const T* w, T* y, int64_t k, int64_t n, const char* ahead,
                            int64_t ahead_every);

// Column blocks [b0, b1) of y [m, n] = x [m, k] W^T, blocks of Cols columns stored one after another (k * Cols
// values, one 64-byte line per input), in passes of up to MaxRows rows (tiles[rows - 1]) whose steps take Step
// inputs each; the weights of blocks up to ahead_end may be asked for. The next block's lines are asked for over
// all the passes of this one, a share in each and spread over its steps. Asked for in the first pass alone, they
// were in flight at a rate that held that pass up (they wait on the fill buffers its loads need too), and a
// projection whose weights came from memory ran well below its rate on weights already in cache.
template <int64_t Cols, int64_t Step, typename T, size_t MaxRows>
void decode_gemm_blocks(const DecodeTile<T> (&tiles)[MaxRows], const T* x, const T* w, T* y, int64_t m, int64_t k,
                        int64_t n, int64_t b0, int64_t b1, int64_t ahead_end) {
  static_assert(Cols * sizeof(T) == 64, "one 64-byte line of the packed weight per input");
  const int64_t passes = (m + static_cast<int64_t>(MaxRows) - 1) / static_cast<int64_t>(MaxRows);
  // Inputs whose lines one pass asks for: every passes-th step of its tile, so whole steps.
  const int64_t share = (k / Step + passes - 1) / passes * Step;
  for (int64_t b = b0; b < b1; ++b) {
    const T* wb = w + b * k * Cols;
    const char* next = b + 1 < ahead_end ? reinterpret_cast<const char*>(wb + k * Cols) : nullptr;
    for (int64_t r = 0, pass = 0; r < m; ++pass) {
      const int64_t rows = std::min<int64_t>(m - r, MaxRows);
      const char* ahead = next != nullptr ? next + pass * share * 64 : nullptr;
      tiles[rows - 1](x + r * k, wb, y + r * n + b * Cols, k, n, ahead, passes);
      r += rows;
    }
  }
}

at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(0) % 32 == 0 &&
                  weight.size(1) % 32 == 0,
              "amx_pack_weight: a bf16 weight [N, K] with N and K multiples of 32");
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.reshape({n / 32, 2, 16, k / 32, 16, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous();
}

#if defined(__AVX512BF16__)
// Columns [32 p0, 32 p1) of y for rows [0, rows16) of x (rows16 a multiple of 16, rows past the real ones
// zero); y's real rows (m) written in bf16. The weights are asked for ahead up to column pair ahead_end.
__attribute__((target("amx-tile,amx-bf16"))) void amx_linear_pairs(const c10::BFloat16* x, const c10::BFloat16* w,
                                                                  c10::BFloat16* y, int64_t m, int64_t rows16,
                                                                  int64_t k, int64_t n, int64_t p0, int64_t p1,
                                                                  int64_t ahead_end) {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  _tile_loadconfig(&cfg);
  alignas(64) float c[32 * 32];
  const int64_t steps = k / 32, xstride = k * 2, pair_bytes = steps * 2048;
  const int64_t passes = (rows16 + 31) / 32, slice = (pair_bytes / (passes * steps) + 63) / 64 * 64;
  const char* wb = reinterpret_cast<const char*>(w);
  const char* wend = wb + ahead_end * pair_bytes;
  for (int64_t p = p0; p < p1; ++p) {
    const char* wp = wb + p * pair_bytes;
    const char* ask = wp + kAmxLinearAhead;  // asked for a slice per step, in every pass over the rows
    for (int64_t r0 = 0; r0 < rows16; r0 += 32) {
      const bool two = r0 + 16 < rows16;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        const char* b = wp + s * 2048;
        for (int64_t line = 0; line < slice && ask < wend; line += 64, ask += 64) {
          _mm_prefetch(ask, _MM_HINT_T1);
        }
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 1024, 64);
        _tile_loadd(4, x + r0 * k + s * 32, xstride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, x + (r0 + 16) * k + s * 32, xstride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c, 128);
      _tile_stored(1, c + 16, 128);
      if (two) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
      }
      for (int64_t r = r0; r < std::min(m, r0 + 32); ++r) {
        const float* src = c + (r - r0) * 32;
        c10::BFloat16* dst = y + r * n + p * 32;
        vstore(dst, vload(src));
        vstore(dst + 16, vload(src + 16));
      }
    }
  }
  _tile_release();
}
#endif

bool amx_linear_supported() {
#if defined(__AVX512BF16__)
  return amx_supported();
#else
  return false;
#endif
}

// y [M, N] = x [M, K] W^T on AMX, W packed by amx_pack_weight (N = 32 * its first dimension).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed) {
  const char* what = "amx_linear (cpu)";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 6 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && x.size(1) == packed.size(1) * 32,
              what, ": x [M, K] bf16 and a weight from amx_pack_weight with K inputs");
#if defined(__AVX512BF16__)
  TORCH_CHECK(amx_supported(), what, ": this CPU or OS grants no AMX tiles");
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(0), n = pairs * 32;
  const int64_t rows16 = (m + 15) / 16 * 16;
  at::Tensor xs = x.is_contiguous() && rows16 == m ? x : at::zeros({rows16, k}, x.options());
  if (!xs.is_same(x)) xs.narrow(0, 0, m).copy_(x);
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* xp = xs.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  per_thread_blocks(pairs, [&](int64_t b0, int64_t b1, int64_t ahead_end) {
    amx_linear_pairs(xp, wp, yp, m, rows16, k, n, b0, b1, ahead_end);
  });
  return y;
#else
  TORCH_CHECK(false, what, ": built without AMX (the AVX512-BF16 build has it)");
#endif
}

// ---- float32 linear (AVX2 decode GEMMs) ----------------------------------------------------------------
//
// y = x W^T in float32 for a decode step's rows (up to kF32LinearRows) in the AVX2 build, where oneDNN's packed
// GEMM runs decode-sized row counts at well under its prefill rate: it blocks for large products, so a few
// rows leave its weight stream idle between blocks. Here each thread walks its share of the weight's columns
// 16 at a time; a column block (16 columns x K inputs, in memory order) stays in L2 while every row of x
// passes over it in register tiles of up to 6 rows x 16 columns (12 accumulators, two weight vectors and one
// broadcast: 15 of the 16 ymm registers), and the passes ask for the next block, one line per input,
// so the block after arrives while this one is multiplied. benchmarks/step_ab.py measures the step.
// The weight is packed once (f32_pack_weight) as [N / 16][K][16] float32.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define CHATSVC_F32_LINEAR 1
#endif

// Rows up to which f32_linear runs a projection; a prefill's hundreds of rows reuse each weight block enough
// for oneDNN's blocking.
constexpr int64_t kF32LinearRows = 128;

at::Tensor f32_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(0) % 16 == 0,
              "f32_pack_weight: a float32 weight [N, K] with N a multiple of 16");
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.reshape({n / 16, 16, k}).permute({0, 2, 1}).contiguous();
}

#if defined(CHATSVC_F32_LINEAR)
// Rows [0, R) of y's 16 columns at y (row stride n) from rows [0, R) of x (row stride k) and the column block
// w [k][16]; ahead, ahead_every: as DecodeTile says, a step being one input. The accumulators are named rather
// than an array, which GCC keeps on the stack.
template <int R>
inline void f32_tile(const float* x, const float* w, float* y, int64_t k, int64_t n, const char* ahead,
                     int64_t ahead_every) {
  int64_t countdown = 1;  // steps to the next line asked for
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t i = 0; i < k; ++i) {
    if (ahead != nullptr && --countdown == 0) {
      _mm_prefetch(ahead, _MM_HINT_T1);
      ahead += 64, countdown = ahead_every;
    }
    const __m256 b0 = _mm256_loadu_ps(w + i * 16), b1 = _mm256_loadu_ps(w + i * 16 + 8);
#define CHATSVC_F32_ROW(r)                                   \
  if constexpr (R > r) {                                     \
    const __m256 a = _mm256_broadcast_ss(x + r * k + i);     \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);               \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);               \
  }
    CHATSVC_F32_ROW(0)
    CHATSVC_F32_ROW(1)
    CHATSVC_F32_ROW(2)
    CHATSVC_F32_ROW(3)
    CHATSVC_F32_ROW(4)
    CHATSVC_F32_ROW(5)
#undef CHATSVC_F32_ROW
  }
#define CHATSVC_F32_STORE(r)                          \
  if constexpr (R > r) {                              \
    _mm256_storeu_ps(y + r * n, c##r##0);             \
    _mm256_storeu_ps(y + r * n + 8, c##r##1);         \
  }
  CHATSVC_F32_STORE(0)
  CHATSVC_F32_STORE(1)
  CHATSVC_F32_STORE(2)
  CHATSVC_F32_STORE(3)
  CHATSVC_F32_STORE(4)
  CHATSVC_F32_STORE(5)
#undef CHATSVC_F32_STORE
}

// f32_tile for each row count of a decode_gemm_blocks pass.
constexpr DecodeTile<float> kF32Tiles[] = {f32_tile<1>, f32_tile<2>, f32_tile<3>, f32_tile<4>, f32_tile<5>, f32_tile<6>};
#endif

bool f32_linear_supported() {
#if defined(CHATSVC_F32_LINEAR)
  return true;
#else
  return false;
#endif
}

// y [M, N] = x [M, K] W^T in float32, W packed by f32_pack_weight (N = 16 * its first dimension).
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed) {
  const char* what = "f32_linear (cpu)";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && packed.size(2) == 16 && x.size(1) == packed.size(1),
              what, ": x [M, K] float32 and a weight from f32_pack_weight with K inputs");
#if defined(CHATSVC_F32_LINEAR)
  const at::Tensor xs = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * 16;
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = xs.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  per_thread_blocks(blocks, [&](int64_t b0, int64_t b1, int64_t ahead_end) {
    decode_gemm_blocks<16, 1>(kF32Tiles, xp, wp, yp, m, k, n, b0, b1, ahead_end);
  });
  return y;
#else
  TORCH_CHECK(false, what, ": only the AVX2 build has it");
#endif
}

// ---- bf16 linear (AVX512-BF16 decode GEMMs without AMX) -----------------------------------------------
//
// f32_linear's scheme for bf16 with vdpbf16ps, in the AVX512-BF16 build where AMX tiles are absent or capped
// off: a column block is 32 columns x K inputs, as [K / 2][32][2] so one input pair of 16 columns is one
// 64-byte line and one dpbf16 operand; up to 12 rows of x pass over it in register tiles (24 accumulators,
// two weight vectors and one broadcast input pair), and the passes ask for the next block. Products
// of bf16 are exact in float32 and sums run in float32, as in oneDNN's bf16 GEMM; results round to bf16.
// The weight is packed once (bf16_pack_weight) as [N / 32][K / 2][32][2] bf16.
constexpr int64_t kBf16LinearRows = 128;

at::Tensor bf16_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(0) % 32 == 0 &&
                  weight.size(1) % 2 == 0,
              "bf16_pack_weight: a bf16 weight [N, K] with N a multiple of 32 and K even");
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.reshape({n / 32, 32, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
// Rows [0, R) of y's 32 columns at y (row stride n) from rows [0, R) of x (row stride k) and the column block
// w [k / 2][32][2]; ahead, ahead_every: as DecodeTile says, a step being an input pair.
template <int R>
inline void bf16_tile(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t k, int64_t n,
                      const char* ahead, int64_t ahead_every) {
  int64_t countdown = 1;  // steps to the next pair of lines asked for
  __m512 c0a = _mm512_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a, c3a = c0a, c3b = c0a,
         c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a, c6a = c0a, c6b = c0a, c7a = c0a, c7b = c0a, c8a = c0a,
         c8b = c0a, c9a = c0a, c9b = c0a, c10a = c0a, c10b = c0a, c11a = c0a, c11b = c0a;
  const int64_t pairs = k / 2;
  const int32_t* xi = reinterpret_cast<const int32_t*>(x);  // input pair j of row r: xi[r * pairs + j]
  for (int64_t j = 0; j < pairs; ++j) {
    if (ahead != nullptr && --countdown == 0) {
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      ahead += 128, countdown = ahead_every;
    }
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * 64));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * 64 + 32));
#define CHATSVC_BF16_ROW(r)                                                               \
  if constexpr (R > r) {                                                                  \
    const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xi[r * pairs + j]));  \
    c##r##a = _mm512_dpbf16_ps(c##r##a, a, b0);                                           \
    c##r##b = _mm512_dpbf16_ps(c##r##b, a, b1);                                           \
  }
    CHATSVC_BF16_ROW(0)
    CHATSVC_BF16_ROW(1)
    CHATSVC_BF16_ROW(2)
    CHATSVC_BF16_ROW(3)
    CHATSVC_BF16_ROW(4)
    CHATSVC_BF16_ROW(5)
    CHATSVC_BF16_ROW(6)
    CHATSVC_BF16_ROW(7)
    CHATSVC_BF16_ROW(8)
    CHATSVC_BF16_ROW(9)
    CHATSVC_BF16_ROW(10)
    CHATSVC_BF16_ROW(11)
#undef CHATSVC_BF16_ROW
  }
#define CHATSVC_BF16_STORE(r)                                                                         \
  if constexpr (R > r) {                                                                              \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n), (__m256i)_mm512_cvtneps_pbh(c##r##a));      \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + 16), (__m256i)_mm512_cvtneps_pbh(c##r##b)); \
  }
  CHATSVC_BF16_STORE(0)
  CHATSVC_BF16_STORE(1)
  CHATSVC_BF16_STORE(2)
  CHATSVC_BF16_STORE(3)
  CHATSVC_BF16_STORE(4)
  CHATSVC_BF16_STORE(5)
  CHATSVC_BF16_STORE(6)
  CHATSVC_BF16_STORE(7)
  CHATSVC_BF16_STORE(8)
  CHATSVC_BF16_STORE(9)
  CHATSVC_BF16_STORE(10)
  CHATSVC_BF16_STORE(11)
#undef CHATSVC_BF16_STORE
}

// bf16_tile for each row count of a decode_gemm_blocks pass.
constexpr DecodeTile<c10::BFloat16> kBf16Tiles[] = {bf16_tile<1>, bf16_tile<2>, bf16_tile<3>,  bf16_tile<4>,
                                                    bf16_tile<5>, bf16_tile<6>, bf16_tile<7>,  bf16_tile<8>,
                                                    bf16_tile<9>, bf16_tile<10>, bf16_tile<11>, bf16_tile<12>};
#endif

bool bf16_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// y [M, N] = x [M, K] W^T in bf16 (float32 sums), W packed by bf16_pack_weight (N = 32 * its first dimension).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed) {
  const char* what = "bf16_linear (cpu)";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.size(2) == 32 &&
                  x.size(1) == packed.size(1) * 2,
              what, ": x [M, K] bf16 and a weight from bf16_pack_weight with K inputs");
#if defined(__AVX512BF16__)
  const at::Tensor xs = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * 32;
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* xp = xs.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  per_thread_blocks(blocks, [&](int64_t b0, int64_t b1, int64_t ahead_end) {
    decode_gemm_blocks<32, 2>(kBf16Tiles, xp, wp, yp, m, k, n, b0, b1, ahead_end);
  });
  return y;
#else
  TORCH_CHECK(false, what, ": only the AVX512-BF16 build has it");
#endif
}

// Whether bf16 prefill scores may use AMX tiles; returns whether they now will (the CPU and OS allowing).
bool set_amx(bool enable) {
#if defined(__AVX512BF16__)
  amx_wanted = enable;
  return enable && amx_supported();
#else
  (void)enable;
  return false;
#endif
}

// Whether bf16 prefill scores use AMX tiles now (set_amx's last answer).
bool amx_in_use() {
#if defined(__AVX512BF16__)
  return amx_wanted.load(std::memory_order_relaxed) && amx_supported();
#else
  return false;
#endif
}

// The checks of a query [T, Hq, D] against caches [num_blocks, block_size, Hkv, D] that every call makes.
void check_attention_shapes(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const char* what = "paged_attention (cpu)";
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              what, ": tensors must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              what, ": query [T, Hq, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              what, ": query and caches must share a dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), what, ": K and V caches must have the same shape");
  TORCH_CHECK(query.size(2) == k_cache.size(3), what, ": query and caches must share the head size");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              what, ": the head dimension must be contiguous");
}

at::Tensor run_attention(const AttentionPlan& plan, const at::Tensor& query, const KvLayer& kv, double scale) {
  auto out = at::empty(query.sizes(), query.options());
  switch (query.scalar_type()) {
    case at::kFloat: attention_kernel<float>(plan, query, kv, scale, out); break;
    case at::kBFloat16: attention_kernel<c10::BFloat16>(plan, query, kv, scale, out); break;
    case at::kHalf: attention_kernel<c10::Half>(plan, query, kv, scale, out); break;
    default:
      TORCH_CHECK(false, "paged_attention (cpu): dtype ", query.scalar_type(),
                  " is not supported (float32, bfloat16, float16)");
  }
  return out;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const c10::optional<at::Tensor>& query_start_loc,
                           const at::Tensor& context_lens, double scale) {
  check_attention_shapes(query, k_cache, v_cache);
  const AttentionPlan plan =
      plan_attention(query.sizes(), query.scalar_type(), k_cache.sizes(), block_tables, query_start_loc, context_lens);
  return run_attention(plan, query, kv_layer(k_cache, v_cache), scale);
}

// ---- KV-cache write --------------------------------------------------------------------------------

// slot_mapping [T] int64 checked against a cache of num_slots slots (-1: a padding token, not stored).
at::Tensor checked_slots(const at::Tensor& slot_mapping, int64_t tokens, int64_t num_slots) {
  const char* what = "write_kv_cache (cpu)";
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens,
              what, ": slot_mapping must be int64 [T]");
  auto slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, what, ": slot ", slots[t], " of token ", t,
                " is outside the cache (", num_slots, " slots)");
  }
  return slots_t;
}

// Each token's K and V rows [T, Hkv, D] (head dimension contiguous) to its slot of one layer's caches; the
// slots already checked.
void store_kv(const at::Tensor& key, const at::Tensor& value, const KvLayer& kv, int64_t block_size,
              const int64_t* slots) {
  const int64_t tokens = key.size(0), heads = key.size(1);
  auto copy = [&](const at::Tensor& src, void* cache, int64_t cb_e, int64_t ct_e, int64_t ch_e) {
    const char* s = static_cast<const char*>(src.data_ptr());
    char* c = static_cast<char*>(cache);
    const int64_t es = src.element_size(), bytes = src.size(2) * es;
    const int64_t s0 = src.stride(0) * es, s1 = src.stride(1) * es;
    const int64_t cb = cb_e * es, ct = ct_e * es, ch = ch_e * es;
    // All heads of a token in one piece when both sides hold them back to back.
    const bool whole_row = s1 == bytes && ch == bytes;
    // A token is two row copies of a few hundred bytes: a decode step's tokens are copied inline (see
    // kElemsPerTask), only a long prefill chunk is split over the team.
    at::parallel_for(0, tokens, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slots[t] < 0) continue;  // padding: not stored
        char* dst = c + (slots[t] / block_size) * cb + (slots[t] % block_size) * ct;
        const char* row = s + t * s0;
        if (whole_row) {
          std::memcpy(dst, row, heads * bytes);
        } else {
          for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * ch, row + h * s1, bytes);
        }
      }
    });
  };
  copy(key, kv.k, kv.kb, kv.kt, kv.kh);
  copy(value, kv.v, kv.vb, kv.vt, kv.vh);
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  const char* what = "write_kv_cache (cpu)";
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              what, ": key/value [T, Hkv, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              what, ": key/value must have their cache's dtype");
  TORCH_CHECK(key.sizes() == value.sizes() && k_cache.sizes() == v_cache.sizes() &&
                  key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
              what, ": shapes do not match");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              what, ": the head dimension must be contiguous");
  const int64_t block_size = k_cache.size(1);
  const at::Tensor slots = checked_slots(slot_mapping, key.size(0), k_cache.size(0) * block_size);
  store_kv(key, value, kv_layer(k_cache, v_cache), block_size, slots.data_ptr<int64_t>());
}

// ---- elementwise ops around attention ----------------------------------------------------------------
//
// float32 math; for half types each result is rounded to the storage type where torch's composite ops
// (and the HF reference) round, so the ops match them op for op. In float32 that rounding is a no-op and
// plain mul/add/sub (no FMA) round exactly as torch's own kernels.

template <typename T>
inline vf rnd(vf x) {  // x rounded to T and back
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[W];
    vstore(tmp, x);
    return vload(tmp);
  }
}

template <typename T>
inline float rnd1(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Elements per task of the elementwise ops: a decode step's rows (tens of thousands of elements, a few
// microseconds of work) run inline on the calling thread, since waking the OpenMP team costs more than
// splitting them saves (the engine process's OpenMP workers spin only briefly, GOMP_SPINCOUNT=10000, so a
// parallel region after a pause is a futex wake-up).
constexpr int64_t kElemsPerTask = 65536;
inline int64_t rows_per_task(int64_t row_elems) {
  return std::max<int64_t>(1, kElemsPerTask / std::max<int64_t>(row_elems, 1));
}

template <typename T>
void add_rms_norm_kernel(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T *xr = xp + row * xs, *rr = rp + row * rs;
      vf acc = vzero();
      int64_t d = 0;
      for (; d + W <= n; d += W) {
        const vf z = rnd<T>(vadd(vload(xr + d), vload(rr + d)));
        vstore(rr + d, z);
        acc = vfma(z, z, acc);
      }
      float ss = vhsum(acc);
      for (; d < n; ++d) {
        const float z = rnd1<T>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
        rr[d] = static_cast<T>(z);
        ss += z * z;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      const vf vinv = vset1(inv);
      for (d = 0; d + W <= n; d += W) {
        vstore(xr + d, vmul(rnd<T>(vmul(vload(rr + d), vinv)), vload(wp + d)));
      }
      for (; d < n; ++d) {
        xr[d] = static_cast<T>(rnd1<T>(static_cast<float>(rr[d]) * inv) * static_cast<float>(wp[d]));
      }
    }
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const char* what = "fused_add_rms_norm (cpu)";
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              what, ": x and residual [rows, N], weight [N]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              what, ": x, residual and weight must share a dtype");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1 && weight.stride(0) == 1, what, ": rows must be contiguous");
  switch (x.scalar_type()) {
    case at::kFloat: add_rms_norm_kernel<float>(x, residual, weight, eps); break;
    case at::kBFloat16: add_rms_norm_kernel<c10::BFloat16>(x, residual, weight, eps); break;
    case at::kHalf: add_rms_norm_kernel<c10::Half>(x, residual, weight, eps); break;
    default: TORCH_CHECK(false, what, ": dtype ", x.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
}

template <typename T>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = out.size(0), n = out.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, rows_per_task(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T *gate = xp + row * xs, *up = gate + n;
      T* o = op + row * os;
      int64_t d = 0;
      for (; d + W <= n; d += W) {
        const vf g = vload(gate + d);
        // silu(g) = g / (1 + e^-g), as torch computes it.
        const vf silu = rnd<T>(vdiv(g, vadd(vset1(1.f), vexp(vsub(vzero(), g)))));
        vstore(o + d, vmul(silu, vload(up + d)));
      }
      for (; d < n; ++d) {
        const float g = static_cast<float>(gate[d]);
        o[d] = static_cast<T>(rnd1<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[d]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const char* what = "silu_and_mul (cpu)";
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, what, ": input [rows, 2 I], rows contiguous");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: silu_and_mul_kernel<float>(x, out); break;
    case at::kBFloat16: silu_and_mul_kernel<c10::BFloat16>(x, out); break;
    case at::kHalf: silu_and_mul_kernel<c10::Half>(x, out); break;
    default: TORCH_CHECK(false, what, ": dtype ", x.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
  return out;
}

template <typename T>
void rotary_kernel(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = qk.size(0), heads = qk.size(1), half = qk.size(2) / 2;
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  T* xp = qk.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, rows_per_task(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T *c = cp + t * cs, *s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        T *x1 = xp + t * s0 + h * s1, *x2 = x1 + half;
        int64_t d = 0;
        for (; d + W <= half; d += W) {
          const vf a = vload(x1 + d), b = vload(x2 + d), vc = vload(c + d), vs = vload(s + d);
          // Each product rounded on its own (no FMA), as torch's x1 * cos - x2 * sin.
          vstore(x1 + d, vsub(rnd<T>(vmul(a, vc)), rnd<T>(vmul(b, vs))));
          vstore(x2 + d, vadd(rnd<T>(vmul(b, vc)), rnd<T>(vmul(a, vs))));
        }
        for (; d < half; ++d) {
          const float a = static_cast<float>(x1[d]), b = static_cast<float>(x2[d]);
          const float fc = static_cast<float>(c[d]), fs = static_cast<float>(s[d]);
          x1[d] = static_cast<T>(rnd1<T>(a * fc) - rnd1<T>(b * fs));
          x2[d] = static_cast<T>(rnd1<T>(b * fc) + rnd1<T>(a * fs));
        }
      }
    }
  });
}

void rotary_embedding(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  const char* what = "rotary_embedding (cpu)";
  TORCH_CHECK(qk.dim() == 3 && qk.size(2) % 2 == 0 && qk.stride(2) == 1, what, ": qk [T, H, D], D contiguous and even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qk.size(0) &&
                  cos.size(1) == qk.size(2) / 2 && cos.stride(1) == 1 && sin.stride(1) == 1,
              what, ": cos and sin [T, D / 2], rows contiguous");
  TORCH_CHECK(cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              what, ": cos and sin must have qk's dtype");
  switch (qk.scalar_type()) {
    case at::kFloat: rotary_kernel<float>(qk, cos, sin); break;
    case at::kBFloat16: rotary_kernel<c10::BFloat16>(qk, cos, sin); break;
    case at::kHalf: rotary_kernel<c10::Half>(qk, cos, sin); break;
    default: TORCH_CHECK(false, what, ": dtype ", qk.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
}

// ---- greedy sampling --------------------------------------------------------------------------------
//
// Index of each row's largest value, the first one on ties, and the first NaN if the row has one: what
// torch.argmax returns, in one vector pass for the maximum and one for its position (torch's own reduction
// keeps an index per element and runs several times slower on a [rows, vocab] logits tensor).

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  vf m = vset1(-std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    const vf v = vload(x + d);
    nan |= vany_nan(v);
    m = vmax(m, v);
  }
  float mx = vhmax(m);
  for (int64_t i = d; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    nan |= std::isnan(v);
    mx = std::max(mx, v);
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(static_cast<float>(x[i]))) return i;
    }
  }
  const vf vmx = vset1(mx);
  for (d = 0; d + W <= n; d += W) {
    const uint32_t hit = veq_mask(vload(x + d), vmx);
    if (hit != 0) return d + __builtin_ctz(hit);
  }
  for (; d < n; ++d) {
    if (static_cast<float>(x[d]) == mx) return d;
  }
  return 0;  // n == 0 is refused by the caller
}

at::Tensor argmax_rows(const at::Tensor& x) {
  const char* what = "argmax_rows (cpu)";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              what, ": x [rows, n] on the CPU, n > 0, rows contiguous");
  const int64_t rows = x.size(0), n = x.size(1), rs = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto run = [&](auto* p) {
    at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * rs, n);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(x.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, what, ": dtype ", x.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
  return out;
}

// ---- the decoder layers in one call -------------------------------------------------------------------
//
// The model's layer loop as LlamaForCausalLM.forward runs it (engine/model/llama.py), op for op with the
// same kernels (oneDNN's packed linears through the dispatcher, the ops above), so its output is the same
// bits; only the Python between the ops is gone. That Python (module calls, views, the bindings) runs on
// one core between parallel regions while the other threads wait at the next one, and in a decode step of
// few rows, whose regions are short, it is a large share of the step.

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                            c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, weight, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

struct LayerWeights {
  at::Tensor input_norm, qkv, o, post_norm, gate_up, down;  // the projections packed for oneDNN
  c10::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  c10::optional<at::Tensor> qkv_decode, o_decode, gate_up_decode, down_decode;  // and for a decode GEMM
};

// A projection as engine.model.linear.Linear.matmul runs it: a decode's few rows on the decode GEMM of the
// weight's packing where it has one (never with a bias; amx_linear or bf16_linear for bf16, f32_linear for
// float32), oneDNN's packed GEMM otherwise.
at::Tensor project(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& decode,
                   const c10::optional<at::Tensor>& bias) {
  if (decode.has_value() && !bias.has_value()) {
    if (decode->dim() == 6) {  // amx_pack_weight's tiles
      if (x.size(0) <= kAmxLinearRows) return amx_linear(x, *decode);
    } else if (decode->scalar_type() == at::kBFloat16) {
      if (x.size(0) <= kBf16LinearRows) return bf16_linear(x, *decode);
    } else if (x.size(0) <= kF32LinearRows) {
      return f32_linear(x, *decode);
    }
  }
  return packed_linear(x, packed, bias);
}

class DecoderStack {
 public:
  DecoderStack(std::vector<LayerWeights> layers, at::Tensor final_norm, double eps, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double scale)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: a model has at least one layer");
  }

  // h: the embeddings [T, hidden]; cos, sin [T, D / 2]; kv_cache [layers, 2, blocks, block_size, Hkv, D].
  // query_start_loc None: every sequence is a one-token decode. num_tokens: the real rows when T is padded
  // (the rest only keep the GEMM shapes few: attention neither stores nor attends from them).
  // Returns the final-normed hidden states [T, hidden].
  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const c10::optional<at::Tensor>& query_start_loc, const at::Tensor& context_lens,
                     int64_t num_tokens) const {
    TORCH_CHECK(h.dim() == 2 && kv_cache.dim() == 6 && kv_cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                    kv_cache.size(1) == 2,
                "DecoderStack: h [T, hidden] and a kv_cache of one [2, ...] entry per layer");
    const int64_t t = h.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    // The plan and the slots are checked for num_tokens rows; the layers read and store that many of h's.
    TORCH_CHECK(num_tokens >= 0 && num_tokens <= t, "DecoderStack: num_tokens ", num_tokens, " of ", t, " rows");
    const bool padded = num_tokens < t;
    const int64_t hidden = h.size(1);
    // Every layer attends from the same rows over the same tables and stores to the same slots: checked and
    // planned once (every layer's cache has the same shape and strides).
    TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.scalar_type() == h.scalar_type() &&
                    kv_cache.size(4) == num_kv_heads_ && kv_cache.size(5) == head_dim_ && kv_cache.stride(5) == 1,
                "DecoderStack: kv_cache [layers, 2, blocks, block_size, Hkv, D] in h's dtype, D contiguous");
    const at::IntArrayRef cache_sizes = kv_cache.sizes().slice(2);  // one layer's K or V cache
    const std::array<int64_t, 3> q_sizes{num_tokens, num_heads_, head_dim_};
    const AttentionPlan plan =
        plan_attention(q_sizes, h.scalar_type(), cache_sizes, block_tables, query_start_loc, context_lens);
    const int64_t block_size = cache_sizes[1];
    const at::Tensor slots = checked_slots(slot_mapping, num_tokens, cache_sizes[0] * block_size);
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerWeights& w = layers_[i];
      if (i == 0) {
        residual = h;
        h = at::rms_norm(h, {hidden}, w.input_norm, eps_);
      } else {
        fused_add_rms_norm(h, residual, w.input_norm, eps_);
      }
      const at::Tensor qkv = project(h, w.qkv, w.qkv_decode, w.qkv_bias);
      at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({t, num_heads_ + num_kv_heads_, head_dim_});
      rotary_embedding(qk, cos, sin);
      at::Tensor q = qk.narrow(1, 0, num_heads_), k = qk.narrow(1, num_heads_, num_kv_heads_);
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads_, head_dim_});
      const KvLayer kv = kv_layer(kv_cache, static_cast<int64_t>(i));
      at::Tensor attn;
      if (padded) {
        attn = at::empty(q.sizes(), q.options());
        q = q.narrow(0, 0, num_tokens), k = k.narrow(0, 0, num_tokens), v = v.narrow(0, 0, num_tokens);
      }
      store_kv(k, v, kv, block_size, slots.data_ptr<int64_t>());
      at::Tensor out = run_attention(plan, q, kv, scale_);
      if (padded) {
        attn.narrow(0, 0, num_tokens).copy_(out);
      } else {
        attn = out;
      }
      h = project(attn.reshape({t, q_size}), w.o, w.o_decode, w.o_bias);
      fused_add_rms_norm(h, residual, w.post_norm, eps_);
      h = project(silu_and_mul(project(h, w.gate_up, w.gate_up_decode, w.gate_up_bias)), w.down, w.down_decode,
                  w.down_bias);
    }
    fused_add_rms_norm(h, residual, final_norm_, eps_);
    return h;
  }

 private:
  std::vector<LayerWeights> layers_;
  at::Tensor final_norm_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Causal attention of each sequence's queries over its paged context (decode when query_start_loc is None)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("context_lens"), py::arg("scale"));
  m.def("write_kv_cache", &write_kv_cache, "Store each token's K/V at its slot (-1 = skip), in place",
        py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual) * weight, in place",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "[rows, 2 I] -> silu(first half) * second half [rows, I]", py::arg("x"));
  m.def("rotary_embedding", &rotary_embedding, "Rotate-half RoPE on qk [T, H, D] in place", py::arg("qk"),
        py::arg("cos"), py::arg("sin"));
  m.def("amx_pack_weight", &amx_pack_weight, "A bf16 weight [N, K] in amx_linear's tile order", py::arg("weight"));
  m.def("amx_linear_supported", &amx_linear_supported, "Whether amx_linear runs here (this build, CPU and OS)");
  m.def("amx_linear", &amx_linear, "x [M, K] W^T on AMX tiles (bf16), W from amx_pack_weight", py::arg("x"),
        py::arg("packed"));
  m.def("f32_pack_weight", &f32_pack_weight, "A float32 weight [N, K] in f32_linear's column blocks",
        py::arg("weight"));
  m.def("f32_linear_supported", &f32_linear_supported, "Whether f32_linear runs here (the AVX2 build)");
  m.def("f32_linear", &f32_linear, "x [M, K] W^T in float32 for a decode's rows, W from f32_pack_weight",
        py::arg("x"), py::arg("packed"));
  m.def("bf16_pack_weight", &bf16_pack_weight, "A bf16 weight [N, K] in bf16_linear's column blocks",
        py::arg("weight"));
  m.def("bf16_linear_supported", &bf16_linear_supported, "Whether bf16_linear runs here (the AVX512-BF16 build)");
  m.def("bf16_linear", &bf16_linear, "x [M, K] W^T in bf16 (float32 sums) for a decode's rows without AMX",
        py::arg("x"), py::arg("packed"));
  m.def("argmax_rows", &argmax_rows, "Index of each row's maximum (first on ties, first NaN if any), as torch.argmax",
        py::arg("x"));
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"), py::arg("gate_up"),
           py::arg("down"), py::arg("qkv_bias"), py::arg("o_bias"), py::arg("gate_up_bias"), py::arg("down_bias"),
           py::arg("qkv_decode") = py::none(), py::arg("o_decode") = py::none(), py::arg("gate_up_decode") = py::none(),
           py::arg("down_decode") = py::none());
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<LayerWeights>, at::Tensor, double, int64_t, int64_t, int64_t, double>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"))
      .def("forward", &DecoderStack::forward, "The decoder layers and the final norm over a step's hidden states",
           py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("query_start_loc"), py::arg("context_lens"), py::arg("num_tokens"),
           py::call_guard<py::gil_scoped_release>());
  m.def("set_amx", &set_amx, "Allow AMX tiles for bf16 prefill scores (default) or not; returns whether used",
        py::arg("enable"));
  m.def("amx_in_use", &amx_in_use, "Whether bf16 prefill scores use AMX tiles now");
  m.attr("vector_width") = W;
  m.attr("amx_linear_rows") = kAmxLinearRows;
  m.attr("f32_linear_rows") = kF32LinearRows;
  m.attr("bf16_linear_rows") = kBf16LinearRows;
}
