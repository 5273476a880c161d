// Where the int4 ops (int4_linear.cpp, int4_dequantize.cpp) find a weight's exact scales and mins:
// blocked by 64 rows, [np / 64, groups, 2, 64] (engine/layers/quant/int4_format.py block_scales), so a
// block's scales for every group lie together. Planes [2, groups, np] put each group's on another
// page (98 KB apart for a 49152-row head) and a one-row step spent ~20% of its time waiting on them.
#pragma once
#include <torch/types.h>
#include <cstdint>

constexpr int64_t kScaleRows = 64;

// Row n's scale in group g (its min is kScaleRows further).
template <typename S>
static inline const S* planes_at(const S* sm, int64_t groups, int64_t g, int64_t n) {
  return sm + ((n / kScaleRows) * groups + g) * 2 * kScaleRows + n % kScaleRows;
}

// PyTorch's kernel's bf16 (scale, zero) pairs, as it lays them out, [groups, np, 2], or the same
// values blocked by 64 rows, [np / 64, groups, 64, 2] (int4_format.py block_pairs): a block's pairs
// for a group lie together, as the planes' do (strided by np, a one-row step of a 49152-row head
// read each group's pairs from another page: 1.13 ms against 0.90 blocked). Row n's pair in group g.
template <typename S>
static inline const S* pairs_at(const S* sz, int64_t groups, int64_t np, bool blocked, int64_t g, int64_t n) {
  return blocked ? sz + (((n / kScaleRows) * groups + g) * kScaleRows + n % kScaleRows) * 2 : sz + (g * np + n) * 2;
}

// A 5-bit weight's high-bit plane (int4_linear.cpp): uint8 [np / block_rows, k, block_rows / 8],
// contiguous, beside nibbles of k inputs (no two-nibble weight has one).
static inline bool valid_hi_bits(const torch::Tensor& hb, int64_t np, int64_t kw, int64_t k, int64_t block_rows) {
  return hb.device().is_cpu() && hb.scalar_type() == at::kByte && hb.is_contiguous() && kw == k &&
         hb.sizes() == at::IntArrayRef({np / block_rows, k, block_rows / 8});
}
