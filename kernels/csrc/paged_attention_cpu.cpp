// Paged decode attention for the CPU: reads K/V straight from the block pool.
//
// The torch reference gathers every sequence's blocks into a dense copy before two bmm calls; on CPU
// that copy (written, then read again) and the masked padding cost more than the arithmetic. Here one
// sequence is one work item: its blocks are streamed once for the scores of every query head, once
// more for the weighted sum of V, with a float32 softmax in between. A token's row (all KV heads) is
// contiguous in the pool, so each block is one sequential read; the next token's row is prefetched
// while the current one is used, since the loads, not the FMAs, set the pace.
//
// Layout (see kernels/__init__.py): query [B, Hq, D]; a layer's cache [num_blocks, block_size, Hkv, D]
// with D contiguous; block_tables int32 [B, max_blocks]; context_lens int32 [B].

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CHATSVC_AVX2 1
#endif

namespace {

// ---- element access: float32 math whatever the storage type ---------------------------------

#ifdef CHATSVC_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift into place.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
#ifdef CHATSVC_AVX2
  if (n % 16 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
    }
    return hsum(_mm256_add_ps(a0, a1));
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#ifdef CHATSVC_AVX2
  if (n % 8 == 0) {
    const __m256 va = _mm256_set1_ps(a);
    for (int64_t d = 0; d < n; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(va, load8(x + d), _mm256_loadu_ps(y + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < n; ++d) y[d] += a * static_cast<float>(x[d]);
}

#ifdef CHATSVC_AVX2
// e^x for x <= 0 (softmax after subtracting the max): x = n ln2 + r, |r| <= ln2 / 2, e^r by the Cephes
// expf polynomial (about 1 ulp), 2^n built in the exponent bits. Eight at a time; libm's expf is scalar
// and was a third of the kernel's time.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below this e^x is under float's normal range: ~0
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so the product is exact enough.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// s[t] = e^(s[t] - max) / sum over t, in place.
inline void softmax(float* s, int64_t n) {
  const float m = *std::max_element(s, s + n);
  float sum = 0.f;
  int64_t t = 0;
#ifdef CHATSVC_AVX2
  __m256 vsum = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum(vsum);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (t = 0; t < n; ++t) s[t] *= inv;
}

inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0);
}

// Calls fn(t, row) for the ctx tokens of a sequence in order, row pointing at token t's K or V row (all
// KV heads) in the pool, and prefetches the next row while fn uses this one.
template <typename scalar_t, typename Fn>
inline void for_each_row(const scalar_t* pool, int64_t block_stride, int64_t token_stride, int64_t row_bytes,
                         int64_t block_size, const int32_t* table, int64_t ctx, Fn&& fn) {
  const int64_t used_blocks = (ctx + block_size - 1) / block_size;
  for (int64_t b = 0, t = 0; b < used_blocks; ++b) {
    const scalar_t* block = pool + table[b] * block_stride;
    const int64_t n = std::min(block_size, ctx - t);
    for (int64_t i = 0; i < n; ++i, ++t) {
      const scalar_t* row = block + i * token_stride;
      const scalar_t* next = (i + 1 < n) ? row + token_stride
                             : (b + 1 < used_blocks ? pool + table[b + 1] * block_stride : row);
      prefetch_row(next, row_bytes);
      fn(t, row);
    }
  }
}

// ---- the kernel --------------------------------------------------------------------------------

template <typename scalar_t>
void decode_kernel(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = std::min(k_cache.size(0), v_cache.size(0));
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t k_row_bytes = ((num_kv_heads - 1) * kh + head_dim) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t v_row_bytes = ((num_kv_heads - 1) * vh + head_dim) * static_cast<int64_t>(sizeof(scalar_t));
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_q_heads * head_dim), acc(num_q_heads * head_dim), scores;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t ctx = std::min<int64_t>(lens[seq], max_blocks * block_size);
      const int32_t* table = tables + seq * max_blocks;
      const int64_t used_blocks = (ctx + block_size - 1) / block_size;
      for (int64_t i = 0; i < used_blocks; ++i) {
        TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "paged_attention_decode (cpu): block id ", table[i],
                    " of sequence ", seq, " is outside the cache (", num_blocks, " blocks)");
      }
      for (int64_t h = 0; h < num_q_heads; ++h) {
        const scalar_t* src = q_ptr + seq * q_s0 + h * q_s1;
        for (int64_t d = 0; d < head_dim; ++d) q[h * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      if (ctx > 0) {
        scores.resize(num_q_heads * ctx);
        // Scores [Hq, ctx]: each key row is loaded once for every query head (query heads h of one GQA
        // group share KV head h / group).
        for_each_row(k_ptr, kb, kt, k_row_bytes, block_size, table, ctx, [&](int64_t t, const scalar_t* row) {
          for (int64_t h = 0; h < num_q_heads; ++h) {
            scores[h * ctx + t] = dot(q.data() + h * head_dim, row + (h / group) * kh, head_dim);
          }
        });
        for (int64_t h = 0; h < num_q_heads; ++h) softmax(scores.data() + h * ctx, ctx);
        for_each_row(v_ptr, vb, vt, v_row_bytes, block_size, table, ctx, [&](int64_t t, const scalar_t* row) {
          for (int64_t h = 0; h < num_q_heads; ++h) {
            axpy(scores[h * ctx + t], row + (h / group) * vh, acc.data() + h * head_dim, head_dim);
          }
        });
      }
      for (int64_t h = 0; h < num_q_heads; ++h) {
        scalar_t* dst = o_ptr + seq * o_s0 + h * o_s1;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[h * head_dim + d]);
      }
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention_decode (cpu): tensors must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention_decode (cpu): query [B, Hq, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention_decode (cpu): query and caches must share a dtype");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(2) == v_cache.size(3),
              "paged_attention_decode (cpu): query and caches must share the head size");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_attention_decode (cpu): the head dimension must be contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "paged_attention_decode (cpu): Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_attention_decode (cpu): block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && context_lens.size(0) == query.size(0),
              "paged_attention_decode (cpu): one block table and context length per query");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty_like(query, at::MemoryFormat::Contiguous);
  switch (query.scalar_type()) {
    case at::kFloat: decode_kernel<float>(query, k_cache, v_cache, tables, lens, scale, out); break;
    case at::kBFloat16: decode_kernel<c10::BFloat16>(query, k_cache, v_cache, tables, lens, scale, out); break;
    case at::kHalf: decode_kernel<c10::Half>(query, k_cache, v_cache, tables, lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_attention_decode (cpu): dtype ", query.scalar_type(),
                         " is not supported (float32, bfloat16, float16)");
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "Decode attention over a paged KV cache (one query token per sequence)");
}
