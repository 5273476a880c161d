// AVX-512 paged decode attention, included by paged_decode.cpp when the compiler targets
// AVX-512. Same contract as the generic path. Per (sequence, KV head) work item and 16 cached
// tokens at a time: scores for the G query heads (per head, 16 dot-product vectors reduced
// together into one 16-lane vector), a vectorized exp for the online softmax, then P·V into
// float accumulators. The generic path spent most of its time in scalar exp and per-element
// conversions; this one keeps every loop 16 lanes wide.
#pragma once
#include <immintrin.h>

#include "simd512.h"
#include "work_queue.h"

namespace avx512 {

constexpr int kMaxG = 16;  // query heads per KV head handled here (GQA groups are <= 8 in practice)

using simd512::exp_ps;
using simd512::load16;

// r[i] = sum of the 16 lanes of v[i], for 16 vectors at once (45 shuffles/adds instead of 16
// separate reductions of ~9 each): pairwise within 128-bit lanes, then across lanes.
static inline __m512 sum16x16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

template <typename T>
static constexpr bool kSupported = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// One work item: query heads h*G .. h*G+G-1 of sequence i against its cached tokens.
template <int NV, typename T>
static void item(const T* qp, const T* kbase, const T* vbase, const int32_t* blocks, int64_t len, int64_t bs,
                 int64_t g, float scale, T* op) {
  constexpr int D = NV * 16;
  alignas(64) float qf[kMaxG][D];
  alignas(64) float acc[kMaxG][D];
  alignas(64) float s[kMaxG][16];
  alignas(64) float vf[16][D];
  float m[kMaxG], l[kMaxG];
  for (int64_t gi = 0; gi < g; ++gi) {
    for (int j = 0; j < NV; ++j) _mm512_store_ps(qf[gi] + 16 * j, load16(qp + gi * D + 16 * j));
    for (int j = 0; j < NV; ++j) _mm512_store_ps(acc[gi] + 16 * j, _mm512_setzero_ps());
    m[gi] = -std::numeric_limits<float>::infinity();
    l[gi] = 0.f;
  }
#if defined(__AVX512BF16__)
  // bf16 cache: dot products straight from the cache with VDPBF16PS (q is bf16 already, so
  // the conversion below is exact; the scale is applied to the scores).
  constexpr bool kDp = std::is_same_v<T, c10::BFloat16> && NV % 2 == 0;
  __m512bh qb[kDp ? kMaxG : 1][kDp ? NV / 2 : 1];
  if constexpr (kDp) {
    for (int64_t gi = 0; gi < g; ++gi)
      for (int j = 0; j < NV / 2; ++j)
        qb[gi][j] = _mm512_cvtne2ps_pbh(_mm512_load_ps(qf[gi] + 32 * j + 16), _mm512_load_ps(qf[gi] + 32 * j));
  }
#else
  constexpr bool kDp = false;
#endif
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    // Prefetch ahead: the next 16 tokens' K/V rows into L1, the 16 after those into L2. The
    // blocks are scattered over the pool, so the hardware prefetcher restarts at every block, and
    // L1 alone holds too few misses in flight (measured on random block tables, 30 layers x 256
    // sequences: next tile 1.4x, the L2 tile 1.4x more). Written inline: GCC 12 deletes a helper
    // holding only prefetches.
    for (int64_t ahead = 1; ahead <= 2; ++ahead) {
      const int64_t start = t0 + 16 * ahead;
      if (start >= len) break;
      const int64_t pn = std::min<int64_t>(16, len - start);
      for (int64_t t = 0; t < pn; ++t) {
        const int64_t pos = start + t;
        const int64_t row = (static_cast<int64_t>(blocks[pos / bs]) * bs + pos % bs) * D;
        const char* kr = reinterpret_cast<const char*>(kbase + row);
        const char* vr = reinterpret_cast<const char*>(vbase + row);
        for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(T)); c += 64) {
          if (ahead == 1) {
            _mm_prefetch(kr + c, _MM_HINT_T0);
            _mm_prefetch(vr + c, _MM_HINT_T0);
          } else {
            _mm_prefetch(kr + c, _MM_HINT_T1);
            _mm_prefetch(vr + c, _MM_HINT_T1);
          }
        }
      }
    }
    // Scores for these n tokens (they may span two cache blocks when bs is not 16): per head, 16
    // partial-sum vectors, reduced together. Rows past n are zero (masked out below).
    const T* krow[16];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      const int64_t row = (static_cast<int64_t>(blocks[pos / bs]) * bs + pos % bs) * D;
      krow[t] = kbase + row;
      const T* vr = vbase + row;
      for (int j = 0; j < NV; ++j) _mm512_store_ps(vf[t] + 16 * j, load16(vr + 16 * j));
    }
    for (int64_t gi = 0; gi < g; ++gi) {
      __m512 part[16];
      for (int64_t t = 0; t < 16; ++t) {
        __m512 a = _mm512_setzero_ps();
        if (t < n) {
          if constexpr (kDp) {
#if defined(__AVX512BF16__)
            for (int j = 0; j < NV / 2; ++j)
              a = _mm512_dpbf16_ps(a, qb[gi][j], (__m512bh)_mm512_loadu_si512(krow[t] + 32 * j));
#endif
          } else {
            for (int j = 0; j < NV; ++j) a = _mm512_fmadd_ps(_mm512_load_ps(qf[gi] + 16 * j), load16(krow[t] + 16 * j), a);
          }
        }
        part[t] = a;
      }
      _mm512_store_ps(s[gi], _mm512_mul_ps(sum16x16(part), _mm512_set1_ps(scale)));
    }
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t gi = 0; gi < g; ++gi) {
      const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, s[gi]);
      const float bmax = std::max(m[gi], _mm512_reduce_max_ps(sv));
      const float c = std::exp(m[gi] - bmax);  // rescales what was accumulated (0 at the start)
      const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(sv, _mm512_set1_ps(bmax))));
      l[gi] = l[gi] * c + _mm512_reduce_add_ps(p);
      m[gi] = bmax;
      _mm512_store_ps(s[gi], p);
      __m512 a[NV];
      for (int j = 0; j < NV; ++j) a[j] = _mm512_mul_ps(_mm512_load_ps(acc[gi] + 16 * j), _mm512_set1_ps(c));
      for (int64_t t = 0; t < n; ++t) {
        const __m512 pt = _mm512_set1_ps(s[gi][t]);
        for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(pt, _mm512_load_ps(vf[t] + 16 * j), a[j]);
      }
      for (int j = 0; j < NV; ++j) _mm512_store_ps(acc[gi] + 16 * j, a[j]);
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    const float inv = l[gi] > 0.f ? 1.f / l[gi] : 0.f;
    for (int64_t x = 0; x < D; ++x) op[gi * D + x] = static_cast<T>(acc[gi][x] * inv);
  }
}

template <int NV, typename T>
static void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t b = q.size(0), hq = q.size(1);
  const int64_t hkv = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2);
  const int64_t g = hq / hkv, maxb = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  constexpr int64_t D = NV * 16;
  const std::vector<int64_t> order = costliest_first(b, [&](int64_t i) { return sl[i]; });
  struct None {};
  parallel_dynamic<None>(b * hkv, [&](int64_t w, None&) {
    const int64_t i = order[w / hkv], h = w % hkv;
    item<NV, T>(qp + (i * hq + h * g) * D, kp + h * nb * bs * D, vp + h * nb * bs * D, bt + i * maxb, sl[i], bs, g,
                static_cast<float>(scale), op + (i * hq + h * g) * D);
  });
}

}  // namespace avx512

// False when this path does not cover the case (dtype, head_dim, group size): use the generic one.
template <typename T>
static bool decode_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                          torch::Tensor& out) {
  if constexpr (!avx512::kSupported<T>) {
    return false;
  } else {
    const int64_t d = q.size(2), g = q.size(1) / k_cache.size(0);
    if (g > avx512::kMaxG || !k_cache.is_contiguous() || !v_cache.is_contiguous()) return false;
    switch (d) {
      case 16: avx512::run<1, T>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 32: avx512::run<2, T>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 64: avx512::run<4, T>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 80: avx512::run<5, T>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 96: avx512::run<6, T>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 128: avx512::run<8, T>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 256: avx512::run<16, T>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      default: return false;
    }
  }
}
