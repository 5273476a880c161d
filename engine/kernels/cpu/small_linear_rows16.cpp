// The few-row linear for bf16 weights on AVX2, over weights repacked into panels of 16 rows
// (engine/layers/packed_gemm.py pack_rows16): wp [ceil(n/16), k, 16], the 16 outputs of a panel
// side by side per input k, in the order o0 o8 o1 o9 .. o7 o15 so that one 32-byte load gives
// outputs 0-7 (shift) and 8-15 (mask). Per k each input row is broadcast once and feeds two FMAs
// (an outer product), against small_linear.cpp's dot products, whose x operands come from
// memory: at 8-64 rows 1.3-1.9x faster on a Zen 3 (84-90% of the FMA peak against 41-55%), and
// 1.1-1.2x at one row (memory-bound either way). Rows go in balanced groups of at most kGroup,
// 2 * kGroup accumulators in registers. Each output is one FMA chain over k = 0, 1, ... from
// zero, whatever group its row is in, so a row's result does not depend on the rows sharing its
// call. Built for the avx2 target only (AVX-512 builds keep small_linear.cpp's zmm path).
#include <torch/types.h>
#include <algorithm>
#include <optional>
#include <vector>
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#include "work_queue.h"

namespace {

constexpr int kGroup = 4;       // input rows per pass: 8 accumulators, no spills (measured 4 = 6)
constexpr int kMaxRows = 64;    // rows per call, as small_linear
constexpr int kAhead = 1024;    // bytes prefetched ahead on a block's first pass
struct NoState {};

// Rows [0, R) of a group against one panel: x is [k][R] float32, w the panel's [k][16] bf16.
// Prefetch: one 64-byte line per 2 k at pf + (off >> 16), off += step (16.16 fixed point, so the
// passes after the first can spread the next panel over themselves).
template <int R>
inline void panel(const float* x, const __m256i* w, int64_t k, const char* pf, uint64_t step, __m256* out) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  uint64_t off = 0;
  for (int64_t j = 0; j < k; j += 2) {
    _mm_prefetch(pf + (off >> 16), _MM_HINT_T0);
    off += step;
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      const __m256i v = _mm256_loadu_si256(w + j + u);
      const __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wh = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
      const float* xk = x + (j + u) * R;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(xk + r);
        lo[r] = _mm256_fmadd_ps(b, wl, lo[r]);
        hi[r] = _mm256_fmadd_ps(b, wh, hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[2 * r] = lo[r], out[2 * r + 1] = hi[r];
}

template <typename X>
void block(const float* xg, const int* groups, int ngroups, const c10::BFloat16* wp, int64_t k, int64_t blk, int64_t n,
           const X* bias, X* y, int64_t ys) {
  const __m256i* w = reinterpret_cast<const __m256i*>(wp + blk * k * 16);
  const int64_t n0 = blk * 16, rows = std::min<int64_t>(16, n - n0);
  alignas(64) float b16[16] = {};
  if (bias != nullptr)
    for (int64_t r = 0; r < rows; ++r) b16[r] = static_cast<float>(bias[n0 + r]);
  const char* next = reinterpret_cast<const char*>(w + k);  // the next panel
  int s = 0;
  for (int g = 0; g < ngroups; ++g) {
    const int R = groups[g];
    // the first pass reads the panel from memory, kAhead bytes prefetched ahead; the others
    // read it from cache and spread the next panel's prefetch over themselves
    const char* pf = g == 0 ? reinterpret_cast<const char*>(w) + kAhead : next + (g - 1) * k * 32 / (ngroups - 1);
    const uint64_t step = g == 0 ? uint64_t{64} << 16 : (uint64_t{64} << 16) / (ngroups - 1);
    alignas(32) __m256 acc[2 * kGroup];
    const float* x = xg + s * k;
    switch (R) {
      case 1: panel<1>(x, w, k, pf, step, acc); break;
      case 2: panel<2>(x, w, k, pf, step, acc); break;
      case 3: panel<3>(x, w, k, pf, step, acc); break;
      default: panel<4>(x, w, k, pf, step, acc); break;
    }
    for (int r = 0; r < R; ++r) {
      alignas(64) float t[16];
      _mm256_store_ps(t, _mm256_add_ps(acc[2 * r], _mm256_load_ps(b16)));
      _mm256_store_ps(t + 8, _mm256_add_ps(acc[2 * r + 1], _mm256_load_ps(b16 + 8)));
      X* yr = y + (s + r) * ys + n0;
      for (int64_t q = 0; q < rows; ++q) yr[q] = static_cast<X>(t[q]);
    }
    s += R;
  }
}

template <typename X>
void run(const torch::Tensor& x, const torch::Tensor& wp, int64_t n, const X* bias, torch::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1);
  const int ngroups = static_cast<int>((m + kGroup - 1) / kGroup);
  int groups[kMaxRows];
  for (int g = 0; g < ngroups; ++g) groups[g] = static_cast<int>(m / ngroups + (g < m % ngroups ? 1 : 0));
  std::vector<float> xg(m * k);  // group by group, [k][R]: one broadcast per row per k
  const X* xp = x.data_ptr<X>();
  for (int g = 0, s = 0; g < ngroups; s += groups[g++]) {
    const int R = groups[g];
    float* dst = xg.data() + s * k;
    for (int r = 0; r < R; ++r) {
      const X* src = xp + (s + r) * x.stride(0);
      for (int64_t j = 0; j < k; ++j) dst[j * R + r] = static_cast<float>(src[j]);
    }
  }
  const c10::BFloat16* w = wp.data_ptr<c10::BFloat16>();
  X* yp = y.data_ptr<X>();
  parallel_runs<NoState>((n + 15) / 16, [&](int64_t blk, NoState&) {
    block<X>(xg.data(), groups, ngroups, w, k, blk, n, bias, yp, y.stride(0));
  });
}

}  // namespace

bool small_linear_rows16(torch::Tensor x, torch::Tensor wp, std::optional<torch::Tensor> bias, torch::Tensor out) {
  if (!x.device().is_cpu() || x.dim() != 2 || wp.dim() != 3 || out.dim() != 2) return false;
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  if (m < 1 || m > kMaxRows || k % 2 || wp.scalar_type() != at::kBFloat16 || !wp.is_contiguous() ||
      wp.size(0) != (n + 15) / 16 || wp.size(1) != k || wp.size(2) != 16 || x.stride(1) != 1 || out.size(0) != m ||
      out.stride(1) != 1 || out.scalar_type() != x.scalar_type())
    return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) return false;
  if (bias && (!bias->is_contiguous() || bias->numel() != n || bias->scalar_type() != x.scalar_type())) return false;
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, wp, n, bias ? bias->data_ptr<float>() : nullptr, out);
  } else {
    run<c10::BFloat16>(x, wp, n, bias ? bias->data_ptr<c10::BFloat16>() : nullptr, out);
  }
  return true;
}

#else
bool small_linear_rows16(torch::Tensor, torch::Tensor, std::optional<torch::Tensor>, torch::Tensor) { return false; }
#endif
