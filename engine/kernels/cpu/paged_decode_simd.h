// Vectorized paged decode attention (AVX-512 or AVX2 through simd16.h), included by
// paged_decode.cpp. Same contract as the generic path. Per (sequence, KV head) work item and 16
// cached tokens at a time: scores for the G query heads (per head, 16 dot-product vectors reduced
// together into one 16-lane vector), a vectorized exp for the online softmax, then P·V into
// float accumulators. The generic path spent most of its time in scalar exp and per-element
// conversions; this one keeps every loop 16 lanes wide.
#pragma once
#include <immintrin.h>

#include "kv_int8.h"
#include "simd16.h"
#include "work_queue.h"

namespace vdecode {

constexpr int kMaxG = 16;  // query heads per KV head handled here (GQA groups are <= 8 in practice)

using simd::F16;
using simd::load16;

template <typename T>
static constexpr bool kSupported = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// One work item: query heads h*G .. h*G+G-1 of sequence i against its cached tokens. C is the
// cache's element type: T, or int8_t (rows of D values and a float16 scale, applied to the
// scores and to the V rows as they are widened).
template <int NV, typename T, typename C>
static void item(const T* qp, const C* kbase, const C* vbase, const int32_t* blocks, int64_t len, int64_t bs,
                 int64_t g, float scale, T* op) {
  constexpr int D = NV * 16;
  constexpr bool kI8 = std::is_same_v<C, int8_t>;
  constexpr int64_t RS = kI8 ? D + kvi8::kScaleBytes : D;  // elements per cache row
  alignas(64) float qf[kMaxG][D];
  alignas(64) float acc[kMaxG][D];
  alignas(64) float s[kMaxG][16];
  alignas(64) float vf[16][D];
  float m[kMaxG], l[kMaxG];
  for (int64_t gi = 0; gi < g; ++gi) {
    for (int j = 0; j < NV; ++j) simd::store(qf[gi] + 16 * j, load16(qp + gi * D + 16 * j));
    for (int j = 0; j < NV; ++j) simd::store(acc[gi] + 16 * j, simd::zero());
    m[gi] = -std::numeric_limits<float>::infinity();
    l[gi] = 0.f;
  }
#if defined(__AVX512BF16__)
  // bf16 cache: dot products straight from the cache with VDPBF16PS (q is bf16 already, so
  // the conversion below is exact; the scale is applied to the scores).
  constexpr bool kDp = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && NV % 2 == 0;
  __m512bh qb[kDp ? kMaxG : 1][kDp ? NV / 2 : 1];
  if constexpr (kDp) {
    for (int64_t gi = 0; gi < g; ++gi)
      for (int j = 0; j < NV / 2; ++j)
        qb[gi][j] = _mm512_cvtne2ps_pbh(simd::load(qf[gi] + 32 * j + 16).v, simd::load(qf[gi] + 32 * j).v);
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
        const int64_t row = (static_cast<int64_t>(blocks[pos / bs]) * bs + pos % bs) * RS;
        const char* kr = reinterpret_cast<const char*>(kbase + row);
        const char* vr = reinterpret_cast<const char*>(vbase + row);
        for (int64_t c = 0; c < RS * static_cast<int64_t>(sizeof(C)); c += 64) {
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
    const C* krow[16];
    float kscale[16];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      const int64_t row = (static_cast<int64_t>(blocks[pos / bs]) * bs + pos % bs) * RS;
      krow[t] = kbase + row;
      const C* vr = vbase + row;
      if constexpr (kI8) {
        kscale[t] = kvi8::row_scale(krow[t], D);
        const F16 vs = simd::set1(kvi8::row_scale(vr, D));
        for (int j = 0; j < NV; ++j) simd::store(vf[t] + 16 * j, simd::mul(load16(vr + 16 * j), vs));
      } else {
        for (int j = 0; j < NV; ++j) simd::store(vf[t] + 16 * j, load16(vr + 16 * j));
      }
    }
    for (int64_t gi = 0; gi < g; ++gi) {
      F16 part[16];
      for (int64_t t = 0; t < 16; ++t) {
        F16 a = simd::zero();
        if (t < n) {
          if constexpr (kDp) {
#if defined(__AVX512BF16__)
            for (int j = 0; j < NV / 2; ++j)
              a.v = _mm512_dpbf16_ps(a.v, qb[gi][j], (__m512bh)_mm512_loadu_si512(krow[t] + 32 * j));
#endif
          } else {
            for (int j = 0; j < NV; ++j) a = simd::fmadd(simd::load(qf[gi] + 16 * j), load16(krow[t] + 16 * j), a);
            if constexpr (kI8) a = simd::mul(a, simd::set1(kscale[t]));
          }
        }
        part[t] = a;
      }
      simd::store(s[gi], simd::mul(simd::sum16x16(part), simd::set1(scale)));
    }
    const simd::M16 live = simd::first(n);
    for (int64_t gi = 0; gi < g; ++gi) {
      const F16 sv = simd::select(live, simd::load(s[gi]), simd::set1(-std::numeric_limits<float>::infinity()));
      const float bmax = std::max(m[gi], simd::reduce_max(sv));
      const float c = std::exp(m[gi] - bmax);  // rescales what was accumulated (0 at the start)
      const F16 p = simd::maskz(live, simd::exp(simd::sub(sv, simd::set1(bmax))));
      l[gi] = l[gi] * c + simd::reduce_add(p);
      m[gi] = bmax;
      simd::store(s[gi], p);
      F16 a[NV];
      for (int j = 0; j < NV; ++j) a[j] = simd::mul(simd::load(acc[gi] + 16 * j), simd::set1(c));
      for (int64_t t = 0; t < n; ++t) {
        const F16 pt = simd::set1(s[gi][t]);
        for (int j = 0; j < NV; ++j) a[j] = simd::fmadd(pt, simd::load(vf[t] + 16 * j), a[j]);
      }
      for (int j = 0; j < NV; ++j) simd::store(acc[gi] + 16 * j, a[j]);
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    const float inv = l[gi] > 0.f ? 1.f / l[gi] : 0.f;
    for (int64_t x = 0; x < D; ++x) op[gi * D + x] = static_cast<T>(acc[gi][x] * inv);
  }
}

template <int NV, typename T, typename C>
static void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t b = q.size(0), hq = q.size(1);
  const int64_t hkv = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2), rs = k_cache.size(3);
  const int64_t g = hq / hkv, maxb = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  constexpr int64_t D = NV * 16;
  const std::vector<int64_t> order = costliest_first(b, [&](int64_t i) { return sl[i]; });
  struct None {};
  parallel_dynamic<None>(b * hkv, [&](int64_t w, None&) {
    const int64_t i = order[w / hkv], h = w % hkv;
    item<NV, T, C>(qp + (i * hq + h * g) * D, kp + h * nb * bs * rs, vp + h * nb * bs * rs, bt + i * maxb, sl[i],
                   bs, g, static_cast<float>(scale), op + (i * hq + h * g) * D);
  });
}

}  // namespace vdecode

// False when this path does not cover the case (dtype, head_dim, group size): use the generic one.
// C: the cache's element type (T, or int8_t for an int8 cache).
template <typename T, typename C = T>
static bool decode_simd(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                          torch::Tensor& out) {
  if constexpr (!vdecode::kSupported<T>) {
    return false;
  } else {
    const int64_t d = q.size(2), g = q.size(1) / k_cache.size(0);
    if (g > vdecode::kMaxG || !k_cache.is_contiguous() || !v_cache.is_contiguous()) return false;
    switch (d) {
      case 16: vdecode::run<1, T, C>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 32: vdecode::run<2, T, C>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 64: vdecode::run<4, T, C>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 80: vdecode::run<5, T, C>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 96: vdecode::run<6, T, C>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 128: vdecode::run<8, T, C>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      case 256: vdecode::run<16, T, C>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); return true;
      default: return false;
    }
  }
}
