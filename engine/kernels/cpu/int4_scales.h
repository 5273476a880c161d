// Where the int4 ops (int4_linear.cpp, int4_dequantize.cpp) find a weight's exact scales and mins:
// blocked by 64 rows, [np / 64, groups, 2, 64] (engine/layers/quant/int4_format.py block_scales), so a
// block's scales for every group lie together. Planes [2, groups, np] put each group's on another
// page (98 KB apart for a 49152-row head) and a one-row step spent ~20% of its time waiting on them.
#pragma once
#include <cstdint>

constexpr int64_t kScaleRows = 64;

// Row n's scale in group g (its min is kScaleRows further).
template <typename S>
static inline const S* planes_at(const S* sm, int64_t groups, int64_t g, int64_t n) {
  return sm + ((n / kScaleRows) * groups + g) * 2 * kScaleRows + n % kScaleRows;
}
