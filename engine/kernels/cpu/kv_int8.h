// int8 KV rows (engine/layers/attention/kv_int8.py): head_dim int8 values, then the row's own
// scale as 2 bytes of float16 (absmax / 127, symmetric); value = q * scale.
#pragma once
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvi8 {

constexpr int64_t kScaleBytes = 2;

static inline float row_scale(const int8_t* row, int64_t d) {
  c10::Half h;
  std::memcpy(&h, row + d, kScaleBytes);
  return static_cast<float>(h);
}

// One row of d values into dst (d + 2 bytes), as quantize_rows does.
template <typename T>
static inline void quantize_row(const T* x, int64_t d, int8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const c10::Half hs(std::min(amax / 127.f, 65504.f));
  const float s = static_cast<float>(hs);
  for (int64_t i = 0; i < d; ++i) {
    const float q = s > 0.f ? std::nearbyint(static_cast<float>(x[i]) / s) : 0.f;
    dst[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
  }
  std::memcpy(dst + d, &hs, kScaleBytes);
}

}  // namespace kvi8
