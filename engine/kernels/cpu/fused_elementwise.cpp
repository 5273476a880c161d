// The per-token elementwise steps of a Llama layer, fused (CPU, AVX-512 or AVX2 via simd16.h): residual add + RMSNorm,
// SiLU-and-multiply, rotary embedding. Each is one pass over its rows, in place where it can be,
// where the PyTorch versions take 4-12 passes and as many fresh tensors. Intermediates are rounded
// to the tensor's dtype exactly where PyTorch's ops store them in it (the bf16 results equal the
// PyTorch path's up to float summation order). Each returns false when it does not apply (no
// vector ISA, an unsupported dtype or width, a strided row) and the caller runs PyTorch's version.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <optional>
#include "simd16.h"

#if defined(ORBITAL_SIMD16)
namespace {

using simd::F16;
using simd::load16;
using simd::round16;
using simd::store16;

// x <- weight * norm(residual <- x + residual) (or of x when there is no residual), per row.
template <typename T>
void rms_rows(T* x, int64_t xs, T* res, int64_t rs, const T* w, int64_t t, int64_t h, float eps) {
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      T* xr = x + i * xs;
      T* rr = res != nullptr ? res + i * rs : nullptr;
      F16 ss = simd::zero();
      for (int64_t j = 0; j < h; j += 16) {
        F16 v = load16(xr + j);
        if (rr != nullptr) {
          v = round16<T>(simd::add(v, load16(rr + j)));  // the sum is stored in T
          store16(rr + j, v);
        }
        ss = simd::fmadd(v, v, ss);
      }
      const F16 inv = simd::set1(1.f / std::sqrt(simd::reduce_add(ss) / static_cast<float>(h) + eps));
      const T* src = rr != nullptr ? rr : xr;
      for (int64_t j = 0; j < h; j += 16) {
        const F16 n = round16<T>(simd::mul(load16(src + j), inv));  // normalised, cast to T
        store16(xr + j, simd::mul(load16(w + j), n));                // times the weight in T
      }
    }
  });
}

// out = silu(gate) * up over rows [gate | up]; silu rounded to T first, as F.silu stores it.
template <typename T>
void silu_mul_rows(const T* x, int64_t xs, T* out, int64_t os, int64_t t, int64_t n) {
  const int64_t grain = std::max<int64_t>(1, 16384 / n);
  at::parallel_for(0, t, grain, [&](int64_t b, int64_t e) {
    const F16 one = simd::set1(1.f);
    for (int64_t i = b; i < e; ++i) {
      const T* g = x + i * xs;
      T* o = out + i * os;
      for (int64_t j = 0; j < n; j += 16) {
        const F16 gv = load16(g + j);
        // sigmoid from exp(-|g|) <= 1: 1/(1+e) for g >= 0, e/(1+e) below (no overflow either way)
        const F16 ex = simd::exp(simd::sub(simd::zero(), simd::abs(gv)));
        const simd::M16 neg = simd::lt(gv, simd::zero());
        const F16 sig = simd::div(simd::select(neg, ex, one), simd::add(one, ex));
        const F16 s = round16<T>(simd::mul(gv, sig));
        store16(o + j, simd::mul(s, load16(g + n + j)));
      }
    }
  });
}

// In place on the first `heads` heads of each row: neox layout, x*cos + rotate_half(x)*sin, each
// product and the sum rounded to T (the order of PyTorch's three ops).
template <typename T>
void rope_rows(T* x, int64_t xs, const int64_t* pos, const T* cos, const T* sin, int64_t t, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* c = cos + pos[i] * d;
      const T* s = sin + pos[i] * d;
      for (int64_t hh = 0; hh < heads; ++hh) {
        T* p = x + i * xs + hh * d;
        for (int64_t j = 0; j < half; j += 16) {
          const F16 x1 = load16(p + j), x2 = load16(p + half + j);
          const F16 a1 = round16<T>(simd::mul(x1, load16(c + j)));
          const F16 b1 = round16<T>(simd::mul(simd::sub(simd::zero(), x2), load16(s + j)));
          const F16 a2 = round16<T>(simd::mul(x2, load16(c + half + j)));
          const F16 b2 = round16<T>(simd::mul(x1, load16(s + half + j)));
          store16(p + j, simd::add(a1, b1));
          store16(p + half + j, simd::add(a2, b2));
        }
      }
    }
  });
}

// Calls f with a value of x's element type (float or bfloat16; rows_ok has checked which).
template <typename F>
void with_dtype(const torch::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}

bool rows_ok(const torch::Tensor& x) {
  return x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

}  // namespace
#endif

// x [T, H] rows contiguous; residual [T, H] same dtype or None; weight [H]. In place on both.
bool rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
#if defined(ORBITAL_SIMD16)
  const int64_t h = x.size(-1);
  if (!rows_ok(x) || h % 16 || !weight.is_contiguous() || weight.scalar_type() != x.scalar_type()) return false;
  if (residual && (!rows_ok(*residual) || residual->sizes() != x.sizes() || residual->scalar_type() != x.scalar_type()))
    return false;
  with_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(x.data_ptr<T>(), x.stride(0), residual ? residual->data_ptr<T>() : nullptr,
                residual ? residual->stride(0) : 0, weight.data_ptr<T>(), x.size(0), h, static_cast<float>(eps));
  });
  return true;
#else
  return false;
#endif
}

// x [T, 2N] = [gate | up]; out [T, N].
bool silu_and_mul(torch::Tensor x, torch::Tensor out) {
#if defined(ORBITAL_SIMD16)
  const int64_t n = out.size(-1);
  if (!rows_ok(x) || !rows_ok(out) || x.size(1) != 2 * n || n % 16 || out.size(0) != x.size(0) ||
      out.scalar_type() != x.scalar_type())
    return false;
  with_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), out.stride(0), x.size(0), n);
  });
  return true;
#else
  return false;
#endif
}

// x [T, W] (e.g. a fused qkv row): rotates heads 0..heads-1 of width head_dim in place.
// positions [T] int64; cos/sin [max_position, head_dim] in x's dtype.
bool rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
#if defined(ORBITAL_SIMD16)
  if (!rows_ok(x) || (head_dim / 2) % 16 || head_dim % 2 || heads * head_dim > x.size(1) || !cos.is_contiguous() ||
      !sin.is_contiguous() || cos.scalar_type() != x.scalar_type() || sin.scalar_type() != x.scalar_type() ||
      cos.size(1) != head_dim || positions.scalar_type() != at::kLong || !positions.is_contiguous() ||
      positions.size(0) != x.size(0))
    return false;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < x.size(0); ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "position out of range");
  with_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    rope_rows<T>(x.data_ptr<T>(), x.stride(0), pos, cos.data_ptr<T>(), sin.data_ptr<T>(), x.size(0), heads, head_dim);
  });
  return true;
#else
  return false;
#endif
}
