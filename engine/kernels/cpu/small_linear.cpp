// Linear layer for a few rows (decode at low concurrency): y[m, n] = x[m, k] . w[n, k]^T + bias.
// At one to a few rows a linear only streams its weight from memory once, and oneDNN's GEMM
// (padded to 8 rows, one kernel call per layer) stays well below the memory bandwidth. Here each
// thread walks a contiguous range of weight rows, 16 at a time: per row an F16 partial sum over
// k (4 rows in flight for independent FMA chains), the 16 partial sums reduced together into one
// 16-lane vector. Weights are float32 or bfloat16 (widened on load, so bf16 weights with float32
// activations read half the bytes; on AVX2 in even/odd lane order, with x stored to match).
// Returns false where it does not apply.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <optional>
#include <vector>
#include "simd16.h"

#if defined(ORBITAL_SIMD16)
namespace {

using simd::F16;
using simd::load16;

constexpr int64_t kMaxRows = 8;

// 16 weights of a row as float32: bf16 ones in simd::from_bf16_split's lane order (x is stored
// in that order too, see run).
template <typename W>
static inline F16 load_w(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return simd::loadu(p);
  } else {
    return simd::from_bf16_split(p);
  }
}

// 16 consecutive weight rows [n0, n0 + 16) against the m input rows (float32, in L1).
template <typename W, typename X>
void block16(const float* xf, int64_t m, const W* w, int64_t k, int64_t n0, int64_t n, const X* bias, X* y,
             int64_t ys) {
  const int64_t rows = std::min<int64_t>(16, n - n0);
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = xf + i * k;
    F16 part[16];
    for (int64_t r0 = 0; r0 < 16; r0 += 4) {
      F16 a0 = simd::zero(), a1 = a0, a2 = a0, a3 = a0;
      if (r0 < rows) {
        // Rows past the end of the weight repeat the last one (results dropped below).
        const W* w0 = w + std::min(n0 + r0, n - 1) * k;
        const W* w1 = w + std::min(n0 + r0 + 1, n - 1) * k;
        const W* w2 = w + std::min(n0 + r0 + 2, n - 1) * k;
        const W* w3 = w + std::min(n0 + r0 + 3, n - 1) * k;
        for (int64_t j = 0; j < k; j += 16) {
          const F16 xv = simd::loadu(xr + j);
          a0 = simd::fmadd(xv, load_w(w0 + j), a0);
          a1 = simd::fmadd(xv, load_w(w1 + j), a1);
          a2 = simd::fmadd(xv, load_w(w2 + j), a2);
          a3 = simd::fmadd(xv, load_w(w3 + j), a3);
        }
      }
      part[r0] = a0, part[r0 + 1] = a1, part[r0 + 2] = a2, part[r0 + 3] = a3;
    }
    alignas(64) float out[16];
    simd::store(out, simd::sum16x16(part));
    X* yr = y + i * ys + n0;
    for (int64_t r = 0; r < rows; ++r) {
      const float b = bias != nullptr ? static_cast<float>(bias[n0 + r]) : 0.f;
      yr[r] = static_cast<X>(out[r] + b);
    }
  }
}

template <typename W, typename X>
void run(const torch::Tensor& x, const torch::Tensor& w, const X* bias, torch::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  alignas(64) float xf[kMaxRows * 4096];  // x widened once (k <= 4096 checked by the caller)
  const X* xp = x.data_ptr<X>();
  constexpr bool split = simd::kBf16Split && !std::is_same_v<W, float>;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; j += 16) {
      float* dst = xf + i * k + j;
      simd::store(dst, load16(xp + i * x.stride(0) + j));
      if constexpr (split) {  // [x0 x2 .. x14 | x1 x3 .. x15], the weights' lane order
        float t[16];
        for (int q = 0; q < 8; ++q) t[q] = dst[2 * q], t[8 + q] = dst[2 * q + 1];
        std::copy(t, t + 16, dst);
      }
    }
  const W* wp = w.data_ptr<W>();
  X* yp = y.data_ptr<X>();
  const int64_t blocks = (n + 15) / 16;
  // Contiguous ranges per thread: each streams its share of the weight sequentially.
  at::parallel_for(0, blocks, 4, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) block16<W, X>(xf, m, wp, k, blk * 16, n, bias, yp, y.stride(0));
  });
}

template <typename X>
bool with_weight(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                 torch::Tensor& y) {
  const X* bp = bias ? bias->data_ptr<X>() : nullptr;
  if (w.scalar_type() == at::kFloat) {
    run<float, X>(x, w, bp, y);
  } else {
    run<c10::BFloat16, X>(x, w, bp, y);
  }
  return true;
}

bool is_f32_or_bf16(const torch::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

}  // namespace
#endif

// x [m, k] (rows contiguous), w [n, k] contiguous (float32 or bfloat16), bias [n] in x's dtype or
// None, out [m, n] in x's dtype. False (nothing written) where this op does not apply.
bool small_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, torch::Tensor out) {
#if defined(ORBITAL_SIMD16)
  if (!x.device().is_cpu() || x.dim() != 2 || w.dim() != 2 || out.dim() != 2 || w.is_mkldnn()) return false;
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  if (m < 1 || m > kMaxRows || k % 16 || k > 4096 || w.size(1) != k || !w.is_contiguous() || x.stride(1) != 1 ||
      out.size(0) != m || out.size(1) != n || out.stride(1) != 1 || !is_f32_or_bf16(x) || !is_f32_or_bf16(w) ||
      out.scalar_type() != x.scalar_type())
    return false;
  if (bias && (!bias->is_contiguous() || bias->numel() != n || bias->scalar_type() != x.scalar_type())) return false;
  if (x.scalar_type() == at::kFloat) return with_weight<float>(x, w, bias, out);
  return with_weight<c10::BFloat16>(x, w, bias, out);
#else
  return false;
#endif
}
