// Paged decode attention for CPU: reads K/V straight from the block table (no gather copy),
// one pass with an online softmax. Parallel over (sequence, KV head); the G query heads that
// share a KV head are processed together so each K/V row is loaded once.
// With AVX-512 or AVX2 (the build's target, engine/kernels/cpu_ops.py) and head_dim a multiple
// of 16 the vectorized path runs (bf16 dot products in hardware where AVX512-BF16 exists); else
// the generic one.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <limits>
#include <vector>

#include "kv_int8.h"

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// Widen a row to float32. bfloat16 is the top half of a float32, so a shift does it and the
// loop vectorizes (the generic conversion does not).
template <typename T>
static inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t x = 0; x < n; ++x) dst[x] = to_f(src[x]);
}
template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t x = 0; x < n; ++x) d[x] = static_cast<uint32_t>(s[x]) << 16;
}

// int8 cache rows (kv_int8.h): n rows of stride rs, each with its own scale.
static inline void widen_i8(const int8_t* src, float* dst, int64_t n, int64_t rs, int64_t d) {
  for (int64_t t = 0; t < n; ++t) {
    const float s = kvi8::row_scale(src + t * rs, d);
    for (int64_t x = 0; x < d; ++x) dst[t * d + x] = static_cast<float>(src[t * rs + x]) * s;
  }
}

using Vec = at::vec::Vectorized<float>;

// Dot product of two float rows, SIMD across the head dimension.
static inline float dot(const float* a, const float* b, int64_t d) {
  Vec acc(0.f);
  int64_t x = 0;
  for (; x + Vec::size() <= d; x += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + x), Vec::loadu(b + x), acc);
  float out = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc);
  for (; x < d; ++x) out += a[x] * b[x];
  return out;
}

// acc = acc * c + sum_t p[t] * v[t], SIMD across the head dimension.
static inline void scale_add(float* acc, float c, const float* p, const float* v, int64_t n, int64_t d) {
  int64_t x = 0;
  for (; x + Vec::size() <= d; x += Vec::size()) {
    Vec a = Vec::loadu(acc + x) * Vec(c);
    for (int64_t t = 0; t < n; ++t) a = at::vec::fmadd(Vec(p[t]), Vec::loadu(v + t * d + x), a);
    a.store(acc + x);
  }
  for (; x < d; ++x) {
    float a = acc[x] * c;
    for (int64_t t = 0; t < n; ++t) a += p[t] * v[t * d + x];
    acc[x] = a;
  }
}

#include "simd16.h"
#if defined(ORBITAL_SIMD16)
#include "paged_decode_simd.h"
#endif

// C: the cache's element type (scalar_t, or int8_t for an int8 cache).
template <typename scalar_t, typename C = scalar_t>
static void decode_generic(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                        torch::Tensor& out) {
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2), rs = k_cache.size(3);
  const int64_t g = hq / hkv, maxb = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), m(g), l(g), sc(g * bs), kf(bs * d), vf(bs * d);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / hkv, h = w % hkv;
      const int64_t len = sl[i];
      for (int64_t gi = 0; gi < g; ++gi) {
        const scalar_t* src = qp + (i * hq + h * g + gi) * d;
        for (int64_t x = 0; x < d; ++x) qf[gi * d + x] = to_f(src[x]) * fscale;
        m[gi] = -std::numeric_limits<float>::infinity();
        l[gi] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += bs) {  // one KV block at a time
        const int64_t n = std::min<int64_t>(bs, len - t0);
        const int64_t off = (h * nb + bt[i * maxb + t0 / bs]) * bs * rs;
        const C* kr = kp + off;
        const C* vr = vp + off;
        const float* kb;
        const float* vb;
        if constexpr (std::is_same_v<C, float>) {  // already float: read the cache in place
          kb = kr;
          vb = vr;
        } else if constexpr (std::is_same_v<C, int8_t>) {
          widen_i8(kr, kf.data(), n, rs, d);
          widen_i8(vr, vf.data(), n, rs, d);
          kb = kf.data();
          vb = vf.data();
        } else {
          widen(kr, kf.data(), n * d);
          widen(vr, vf.data(), n * d);
          kb = kf.data();
          vb = vf.data();
        }
        for (int64_t gi = 0; gi < g; ++gi) {
          const float* qq = qf.data() + gi * d;
          float* s = sc.data() + gi * bs;
          for (int64_t t = 0; t < n; ++t) s[t] = dot(qq, kb + t * d, d);
          float bmax = m[gi];
          for (int64_t t = 0; t < n; ++t) bmax = std::max(bmax, s[t]);
          const float c = std::exp(m[gi] - bmax);  // rescale what was accumulated (0 at start)
          m[gi] = bmax;
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - bmax);
            sum += s[t];
          }
          l[gi] = l[gi] * c + sum;
          float* a = acc.data() + gi * d;
          scale_add(a, c, s, vb, n, d);
        }
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        scalar_t* dst = op + (i * hq + h * g + gi) * d;
        const float inv = l[gi] > 0.f ? 1.f / l[gi] : 0.f;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(acc[gi * d + x] * inv);
      }
    }
  });
}

// q [b, Hq, D]; k_cache/v_cache [Hkv, num_blocks, block_size, D] in q's dtype, or int8
// [.., D + 2] (kv_int8.h); block_tables [b, max_blocks] int32; seq_lens [b] int32 (tokens to
// attend, including the new one). Returns [b, Hq, D] in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "bad shapes");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_cache.size(3) == q.size(2) + kvi8::kScaleBytes, "int8 cache rows are head_dim + 2 bytes");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_int8", [&] {
#if defined(ORBITAL_SIMD16)
      if (decode_simd<scalar_t, int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out)) return;
#endif
      decode_generic<scalar_t, int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    });
    return out;
  }
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
#if defined(ORBITAL_SIMD16)
    if (decode_simd<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out)) return;
#endif
    decode_generic<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  });
  return out;
}
