// Linear layer for a few rows (decode at low concurrency): y[m, n] = x[m, k] . w[n, k]^T + bias.
// At one to a few rows a linear only streams its weight from memory once, and oneDNN's GEMM
// (padded to 8 rows, one kernel call per layer) stays well below the memory bandwidth. Here each
// thread walks its run of weight rows (work_queue.h parallel_runs), 16 at a time, prefetching the
// rows after the ones it reads (the hardware prefetcher alone left bf16 weights at one row 1.4x
// below the memory bandwidth): per row an F16 partial sum over k, the 16 partial sums reduced
// together into one 16-lane vector. Up to kC input rows share a pass over a block (each weight
// vector widened once for all of them); one input row takes 4 weight rows at a time instead, for
// independent FMA chains. Weights are float32 or bfloat16
// (widened on load, so bf16 weights with float32 activations read half the bytes; on AVX2 in
// even/odd lane order, with x stored to match). bf16 weights on a CPU without bf16 dot products
// take this op at every row count (engine/layers/packed_gemm.py): PyTorch's bf16 GEMM is emulated
// there, ~4x slower. Returns false where it does not apply.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <optional>
#include <vector>
#include "ops.h"
#include "simd16.h"
#include "work_queue.h"

#if defined(ORBITAL_SIMD16)
namespace {

using simd::F16;
using simd::load16;

constexpr int64_t kMaxRows = 64;  // rows per call (callers split more)
struct NoState {};

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

constexpr int kC = 4;  // input rows per pass over a block's weights (measured: 4-6 alike, 2-3 slower)

// Weight rows per tile for c input rows: R * c accumulators, so the registers hold them (and at
// one row 4 independent FMA chains).
template <int C>
constexpr int tile_rows() { return C == 1 ? 4 : C == 2 ? 2 : 1; }

// R weight rows [r0, r0 + R) of the block against C input rows: part[ci * 16 + r] = lane partial
// sums over k, lane l summing k = l, l + 16, ... in order whatever R and C are, so a row's result
// does not depend on the rows that share its call.
template <int R, int C, typename W>
static inline void tile(const float* xr, int64_t k, const W* const* wr, const char* next, bool pf, F16* part, int r0) {
  F16 acc[R][C];
  for (int q = 0; q < R; ++q)
    for (int c = 0; c < C; ++c) acc[q][c] = simd::zero();
  for (int64_t j = 0; j < k; j += 16) {
    if (pf) {  // the weight rows after these (contiguous) stream in while these are read
      const char* p = next + R * j * static_cast<int64_t>(sizeof(W));
      for (int l = 0; l < static_cast<int>(R * 16 * sizeof(W)); l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    }
    F16 wv[R];
    for (int q = 0; q < R; ++q) wv[q] = load_w(wr[q] + j);
    for (int c = 0; c < C; ++c) {
      const F16 xv = simd::loadu(xr + c * k + j);
      for (int q = 0; q < R; ++q) acc[q][c] = simd::fmadd(xv, wv[q], acc[q][c]);
    }
  }
  for (int q = 0; q < R; ++q)
    for (int c = 0; c < C; ++c) part[c * 16 + r0 + q] = acc[q][c];
}

// 16 consecutive weight rows [n0, n0 + 16) against C input rows (float32, xr = the first).
template <int C, typename W>
static inline void pass(const float* xr, const W* w, int64_t k, int64_t n0, int64_t n, bool pf, F16* part) {
  constexpr int R = tile_rows<C>();
  const int64_t rows = std::min<int64_t>(16, n - n0);
  for (int r0 = 0; r0 < 16; r0 += R) {
    if (r0 >= rows) {
      for (int c = 0; c < C; ++c)
        for (int q = 0; q < R; ++q) part[c * 16 + r0 + q] = simd::zero();
      continue;
    }
    const W* wr[R];  // rows past the end of the weight repeat the last one (results dropped)
    for (int q = 0; q < R; ++q) wr[q] = w + std::min<int64_t>(n0 + r0 + q, n - 1) * k;
    const char* next = reinterpret_cast<const char*>(w + std::min<int64_t>(n0 + r0 + R, n - 1) * k);
    tile<R, C, W>(xr, k, wr, next, pf, part, r0);
  }
}

// Block [n0, n0 + 16) for all m input rows, kC at a time: the weight block comes from memory on
// the first pass and from cache on the others.
template <typename W, typename X>
void block16(const float* xf, int64_t m, const W* w, int64_t k, int64_t n0, int64_t n, const X* bias, X* y,
             int64_t ys) {
  const int64_t rows = std::min<int64_t>(16, n - n0);
  F16 part[kC * 16];
  for (int64_t i0 = 0; i0 < m; i0 += kC) {
    const int64_t c = std::min<int64_t>(kC, m - i0);
    const float* xr = xf + i0 * k;
    const bool pf = i0 == 0;
    switch (c) {
      case 1: pass<1, W>(xr, w, k, n0, n, pf, part); break;
      case 2: pass<2, W>(xr, w, k, n0, n, pf, part); break;
      case 3: pass<3, W>(xr, w, k, n0, n, pf, part); break;
      default: pass<4, W>(xr, w, k, n0, n, pf, part); break;
    }
    for (int64_t ci = 0; ci < c; ++ci) {
      alignas(64) float out[16];
      simd::store(out, simd::sum16x16(part + ci * 16));
      X* yr = y + (i0 + ci) * ys + n0;
      for (int64_t r = 0; r < rows; ++r) {
        const float b = bias != nullptr ? static_cast<float>(bias[n0 + r]) : 0.f;
        yr[r] = static_cast<X>(out[r] + b);
      }
    }
  }
}

template <typename W, typename X>
void run(const torch::Tensor& x, const torch::Tensor& w, const X* bias, torch::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  std::vector<float> xbuf(m * k);  // x widened once
  float* xf = xbuf.data();
  const X* xp = x.data_ptr<X>();
  constexpr bool split = simd::kBf16Split && !std::is_same_v<W, float>;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; j += 16) {
      float* dst = xf + i * k + j;
      simd::storeu(dst, load16(xp + i * x.stride(0) + j));
      if constexpr (split) {  // [x0 x2 .. x14 | x1 x3 .. x15], the weights' lane order
        float t[16];
        for (int q = 0; q < 8; ++q) t[q] = dst[2 * q], t[8 + q] = dst[2 * q + 1];
        std::copy(t, t + 16, dst);
      }
    }
  const W* wp = w.data_ptr<W>();
  X* yp = y.data_ptr<X>();
  const int64_t blocks = (n + 15) / 16;
  // Each thread streams its own run of blocks and then helps with the others' (a thread that
  // something preempted does not hold the other at the end; bf16 at one row 1.08x over fixed shares).
  parallel_runs<NoState>(blocks, [&](int64_t blk, NoState&) {
    block16<W, X>(xf, m, wp, k, blk * 16, n, bias, yp, y.stride(0));
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
  if (w.dim() == 3) return small_linear_rows16(x, w, bias, out);  // bf16 panels of 16 rows (AVX2)
#if defined(ORBITAL_SIMD16)
  if (!x.device().is_cpu() || x.dim() != 2 || w.dim() != 2 || out.dim() != 2 || w.is_mkldnn()) return false;
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  if (m < 1 || m > kMaxRows || k % 16 || w.size(1) != k || !w.is_contiguous() || x.stride(1) != 1 ||
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
