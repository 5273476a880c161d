// The ops of this module, as the bindings (bindings.cpp) and the fused decode layers
// (decode_layers.cpp) call them. Each bool op returns false (nothing written) where it does not apply.
#pragma once
// torch/types.h, not torch/extension.h: the kernels need tensors, not pybind and the whole C++
// API, and that header alone is ~2/3 of each file's compile time. Only the files that bind to
// Python (bindings.cpp, decode_layers.cpp) include torch/extension.h.
#include <torch/types.h>
#include <optional>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
void write_kv(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping);
void write_kv_int8(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping);
torch::Tensor argmax_rows(torch::Tensor x);
bool prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                       torch::Tensor info, double scale, torch::Tensor out);
bool rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
bool silu_and_mul(torch::Tensor x, torch::Tensor out);
bool small_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, torch::Tensor out);
bool small_linear_rows16(torch::Tensor x, torch::Tensor wp, std::optional<torch::Tensor> bias, torch::Tensor out);
bool int4_small_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_min, int64_t group_size,
                       int64_t block_rows, std::optional<torch::Tensor> bias, torch::Tensor out,
                       std::optional<torch::Tensor> hi_bits = std::nullopt, bool int8_x = false);
bool int8_dot_products();
bool int4_dequantize(torch::Tensor packed, torch::Tensor scales, int64_t group_size, int64_t block_rows,
                     torch::Tensor out, std::optional<torch::Tensor> hi_bits = std::nullopt);
bool rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
bool lora_bgmv(torch::Tensor x, torch::Tensor rows, torch::Tensor slots, torch::Tensor A, int64_t last,
               std::vector<torch::Tensor> bts, std::vector<int64_t> firsts, std::vector<int64_t> widths, int64_t R,
               torch::Tensor y);
