// Write this step's K and V rows into the paged cache at their slots. index_copy_ on the
// head-major cache view went through a generic strided path (~0.5 GB/s, ~7% of a prefill
// step); this copies each (token, head) row of head_dim values directly.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cstring>

// kv_cache [2, Hkv, num_blocks, block_size, D]; k, v [T, Hkv, D] (rows of D contiguous);
// slot_mapping [T] int64 (block * block_size + offset).
void write_kv(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous [2, Hkv, nb, bs, D]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "k/v must be [T, Hkv, D]");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(), "dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  const int64_t t = k.size(0), hkv = kv_cache.size(1), slots = kv_cache.size(2) * kv_cache.size(3), d = kv_cache.size(4);
  TORCH_CHECK(k.size(1) == hkv && k.size(2) == d && v.sizes() == k.sizes() && slot_mapping.size(0) == t, "shapes");
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sm[i] >= 0 && sm[i] < slots, "slot out of range");
  const int64_t es = kv_cache.element_size(), row = d * es;
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks0 = k.stride(0) * es, ks1 = k.stride(1) * es, vs0 = v.stride(0) * es, vs1 = v.stride(1) * es;
  const int64_t half = hkv * slots * row;  // bytes of the K (or V) half of the cache
  at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t h = 0; h < hkv; ++h) {
        char* dst = base + (h * slots + sm[i]) * row;
        std::memcpy(dst, kp + i * ks0 + h * ks1, row);
        std::memcpy(dst + half, vp + i * vs0 + h * vs1, row);
      }
  });
}

#include "kv_int8.h"

// The int8 cache's write: each (token, head) row quantized with its own scale (kv_int8.h).
// kv_cache int8 [2, Hkv, num_blocks, block_size, D + 2]; k, v float32 or bfloat16 [T, Hkv, D].
void write_kv_int8(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kChar,
              "kv_cache must be a contiguous int8 [2, Hkv, nb, bs, D + 2]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "k/v must be [T, Hkv, D]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  const int64_t t = k.size(0), hkv = kv_cache.size(1), slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t w = kv_cache.size(4), d = w - kvi8::kScaleBytes;
  TORCH_CHECK(k.size(1) == hkv && k.size(2) == d && v.sizes() == k.sizes() && slot_mapping.size(0) == t, "shapes");
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sm[i] >= 0 && sm[i] < slots, "slot out of range");
  int8_t* base = kv_cache.data_ptr<int8_t>();
  const int64_t half = hkv * slots * w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_int8", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        for (int64_t h = 0; h < hkv; ++h) {
          int8_t* dst = base + (h * slots + sm[i]) * w;
          kvi8::quantize_row(kp + i * k.stride(0) + h * k.stride(1), d, dst);
          kvi8::quantize_row(vp + i * v.stride(0) + h * v.stride(1), d, dst + half);
        }
    });
  });
}
