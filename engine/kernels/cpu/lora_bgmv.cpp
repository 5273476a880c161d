// LoRA deltas of a decode step's rows, each row with its own adapter (Punica's BGMV), in one call
// per linear: for row i (of x and y: rows[i]) and its adapter slot s = slots[i],
//   t = A[s, :last] . x_i                                                     (shrink)
//   y_i[first_p : first_p + cols_p] += t[p * R : p * R + w_p] . Bt_p[s, :w_p]  (expand, piece p)
// read straight from the stacked slot tensors (engine/lora/layer.py), where PyTorch's forms either
// copy every row's weights out first (index_select, then bmm) or pay per adapter (grouped_mm).
// Sums run in float32 whatever the dtype (float32 or bfloat16, the same for x, y and the weights),
// each in a fixed order, so a row's result does not depend on the other rows of the call; y is
// rounded once, as it is written. Returns false (nothing written) where it does not apply.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#include "ops.h"
#include "simd16.h"

#if defined(ORBITAL_SIMD16)
namespace {

template <typename T>
static inline simd::F16 load_t(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return simd::loadu(p);
  } else {
    return simd::from_bf16(p);
  }
}

template <typename T>
static inline void store_t(T* p, simd::F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    simd::storeu(p, v);
  } else {
    simd::to_bf16(p, v);
  }
}

// dot(a[0:k], b[0:k]) in float32: two 16-lane accumulators, then the tail.
template <typename T>
static inline float dot(const T* a, const T* b, int64_t k) {
  simd::F16 acc0 = simd::zero(), acc1 = simd::zero();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    acc0 = simd::fmadd(load_t(a + j), load_t(b + j), acc0);
    acc1 = simd::fmadd(load_t(a + j + 16), load_t(b + j + 16), acc1);
  }
  for (; j + 16 <= k; j += 16) acc0 = simd::fmadd(load_t(a + j), load_t(b + j), acc0);
  float s = simd::reduce_add(simd::add(acc0, acc1));
  for (; j < k; ++j) s += static_cast<float>(a[j]) * static_cast<float>(b[j]);
  return s;
}

struct Piece {
  int64_t index;   // its place among the linear's pieces: its columns of t start at index * R
  int64_t first;   // its first column of y
  int64_t cols;    // its columns of y
  int64_t width;   // the rank columns it uses in this call
  int64_t blocks;  // 16-column blocks of its output
};

template <typename T>
void run(const torch::Tensor& x, const int64_t* rows, const int64_t* slots, int64_t n, const torch::Tensor& A,
         int64_t last, const std::vector<torch::Tensor>& bts, const std::vector<Piece>& pieces, int64_t R,
         torch::Tensor& y) {
  const int64_t k = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* ap = A.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t xs = x.stride(0), ys = y.stride(0), as0 = A.stride(0), as1 = A.stride(1);
  std::vector<float> t(n * last);
  at::parallel_for(0, n * last, 8, [&](int64_t b, int64_t e) {
    for (int64_t q = b; q < e; ++q) {
      const int64_t i = q / last, c = q % last;
      t[q] = dot(ap + slots[i] * as0 + c * as1, xp + rows[i] * xs, k);
    }
  });
  int64_t blocks = 0;
  for (const Piece& pc : pieces) blocks += pc.blocks;
  // One task per (row, piece, 16 output columns); each column sums over the rank in order.
  at::parallel_for(0, n * blocks, 4, [&](int64_t b, int64_t e) {
    for (int64_t q = b; q < e; ++q) {
      const int64_t i = q / blocks;
      int64_t r = q % blocks;
      size_t p = 0;
      while (r >= pieces[p].blocks) r -= pieces[p++].blocks;
      const Piece& pc = pieces[p];
      const torch::Tensor& bt_all = bts[pc.index];
      const int64_t o0 = r * 16, cols = std::min<int64_t>(16, pc.cols - o0);
      const T* bt = bt_all.data_ptr<T>() + slots[i] * bt_all.stride(0) + o0;
      const int64_t bs = bt_all.stride(1);
      const float* ti = t.data() + i * last + pc.index * R;
      T* yr = yp + rows[i] * ys + pc.first + o0;
      if (cols == 16) {
        simd::F16 acc = simd::zero();
        for (int64_t c = 0; c < pc.width; ++c) acc = simd::fmadd(simd::set1(ti[c]), load_t(bt + c * bs), acc);
        store_t(yr, simd::add(load_t(yr), acc));
      } else {
        for (int64_t o = 0; o < cols; ++o) {
          float s = 0.f;
          for (int64_t c = 0; c < pc.width; ++c) s += ti[c] * static_cast<float>(bt[c * bs + o]);
          yr[o] = static_cast<T>(static_cast<float>(yr[o]) + s);
        }
      }
    }
  });
}

}  // namespace
#endif

bool lora_bgmv(torch::Tensor x, torch::Tensor rows, torch::Tensor slots, torch::Tensor A, int64_t last,
               std::vector<torch::Tensor> bts, std::vector<int64_t> firsts, std::vector<int64_t> widths, int64_t R,
               torch::Tensor y) {
#if defined(ORBITAL_SIMD16)
  const auto dt = x.scalar_type();
  if (dt != torch::kFloat32 && dt != torch::kBFloat16) return false;
  if (!x.device().is_cpu() || x.dim() != 2 || y.dim() != 2 || A.dim() != 3 || x.size(0) != y.size(0)) return false;
  if (A.scalar_type() != dt || y.scalar_type() != dt || rows.scalar_type() != torch::kInt64 ||
      slots.scalar_type() != torch::kInt64 || !rows.is_contiguous() || !slots.is_contiguous() ||
      rows.numel() != slots.numel())
    return false;
  if (x.stride(1) != 1 || y.stride(1) != 1 || A.stride(2) != 1 || A.size(2) != x.size(1) || last > A.size(1))
    return false;
  if (bts.size() != firsts.size() || bts.size() != widths.size() || static_cast<int64_t>(bts.size()) * R < last)
    return false;
  std::vector<Piece> pieces;
  for (size_t p = 0; p < bts.size(); ++p) {
    const torch::Tensor& b = bts[p];
    if (b.scalar_type() != dt || b.dim() != 3 || b.stride(2) != 1 || b.size(0) != A.size(0) || widths[p] > b.size(1) ||
        widths[p] > R || firsts[p] < 0 || firsts[p] + b.size(2) > y.size(1) ||
        (widths[p] > 0 && static_cast<int64_t>(p) * R + widths[p] > last))
      return false;
    if (widths[p] > 0) pieces.push_back({static_cast<int64_t>(p), firsts[p], b.size(2), widths[p], (b.size(2) + 15) / 16});
  }
  const int64_t n = rows.numel();
  if (n == 0 || pieces.empty() || last == 0) return true;  // nothing to add
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (rp[i] < 0 || rp[i] >= x.size(0) || sp[i] < 0 || sp[i] >= A.size(0)) return false;
  if (dt == torch::kFloat32) {
    run<float>(x, rp, sp, n, A, last, bts, pieces, R, y);
  } else {
    run<at::BFloat16>(x, rp, sp, n, A, last, bts, pieces, R, y);
  }
  return true;
#else
  return false;
#endif
}
