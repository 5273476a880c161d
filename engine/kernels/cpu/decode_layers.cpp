// A Llama model's decoder layers for a decode step of a few rows, in one call: the same ops the
// Python layers call (rms_norm, the few-row linears, rotary, the cache write, paged decode,
// silu_and_mul), in the same order on the same values, so the result is bit-identical. At one row
// a step is ~300 small ops, and the Python modules, the dispatcher and the per-op checks around
// each cost about as much as the kernels (engine/model/fused_decode.py says when this runs).
#include <torch/extension.h>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

// One linear layer: PyTorch's CPU int4 pack or a plain float weight. The int4 scales are PyTorch's
// bf16 (scale, zero) pairs (float32 x rounded to bf16 first) or, in exact mode, the exact scale
// and min planes (x widened to float32, the sums rounded to x's dtype); the bias is added after
// rounding, as engine/layers/quant/int4.py does. A 5-bit weight has its high-bit plane too; int8_x:
// the op rounds x to int8 per group (int4_int8_dot.h, the int8_activations setting).
struct Linear {
  torch::Tensor w;
  std::optional<torch::Tensor> scales;  // set: int4
  std::optional<torch::Tensor> bias;
  std::optional<torch::Tensor> hi_bits;
  int64_t group_size = 0, block_rows = 0, out = 0;
  bool int8_x = false;

  torch::Tensor operator()(const torch::Tensor& x) const {
    auto y = torch::empty({x.size(0), out}, x.options());
    bool ok;
    if (scales && scales->scalar_type() != at::kBFloat16) {
      auto y32 = x.scalar_type() == at::kFloat ? y : torch::empty({x.size(0), out}, x.options().dtype(at::kFloat));
      ok = int4_small_linear(x.to(at::kFloat), w, *scales, group_size, block_rows, std::nullopt, y32, hi_bits, int8_x);
      if (ok && !y32.is_same(y)) y.copy_(y32);
      if (ok && bias) y.add_(*bias);
    } else if (scales) {
      // float32 activations: the int4 path feeds the op bf16-rounded values (int4_linear).
      const auto xin = x.scalar_type() == at::kFloat ? x.to(at::kBFloat16).to(at::kFloat) : x;
      ok = int4_small_linear(xin, w, *scales, group_size, block_rows, std::nullopt, y, hi_bits, int8_x);
      if (ok && bias) y.add_(*bias);
    } else {
      ok = small_linear(x, w, bias, y);
    }
    TORCH_CHECK(ok, "decode_layers: a few-row linear refused its input");
    return y;
  }
};

struct Layer {
  torch::Tensor in_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

class DecodeLayers {
 public:
  // Per layer, in order: norms [in, post]; linears [qkv, o, gate_up, down], each as
  // (weight, int4 scales or None, bias or None, group_size, out_features, high bits or None, int8 x).
  DecodeLayers(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> weights,
               std::vector<std::optional<torch::Tensor>> scales, std::vector<std::optional<torch::Tensor>> biases,
               std::vector<int64_t> group_sizes, std::vector<int64_t> out_features,
               std::vector<std::optional<torch::Tensor>> hi_bits, std::vector<bool> int8_x, int64_t block_rows,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, torch::Tensor cos,
               torch::Tensor sin)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), cos_(cos), sin_(sin) {
    const size_t n = norms.size() / 2;
    TORCH_CHECK(norms.size() == 2 * n && weights.size() == 4 * n && scales.size() == 4 * n &&
                    biases.size() == 4 * n && group_sizes.size() == 4 * n && out_features.size() == 4 * n &&
                    hi_bits.size() == 4 * n && int8_x.size() == 4 * n,
                "decode_layers: 2 norms and 4 linears per layer");
    for (size_t l = 0; l < n; ++l) {
      Linear lin[4];
      for (int j = 0; j < 4; ++j) {
        const size_t i = 4 * l + j;
        lin[j] = Linear{weights[i], scales[i], biases[i], hi_bits[i], group_sizes[i], block_rows, out_features[i], int8_x[i]};
      }
      layers_.push_back(Layer{norms[2 * l], norms[2 * l + 1], lin[0], lin[1], lin[2], lin[3]});
    }
  }

  // x [m, hidden] (the embeddings) -> (hidden, residual) after the last layer, before the final
  // norm. kv_caches: one [2, Hkv, blocks, block_size, row] per layer (the model's dtype, or int8).
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor x, torch::Tensor positions,
                                               std::vector<torch::Tensor> kv_caches, torch::Tensor block_table,
                                               torch::Tensor seq_lens, torch::Tensor slot_mapping) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "decode_layers: one KV cache per layer");
    const int64_t m = x.size(0), qw = heads_ * head_dim_, kw = kv_heads_ * head_dim_;
    torch::Tensor residual = x;
    x = x.clone();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      TORCH_CHECK(rms_norm(x, l == 0 ? std::nullopt : std::optional<torch::Tensor>(residual), L.in_norm, eps_),
                  "decode_layers: rms_norm refused");
      const torch::Tensor qkv = L.qkv(x);
      TORCH_CHECK(rotary(qkv, positions, cos_, sin_, heads_ + kv_heads_, head_dim_), "decode_layers: rotary refused");
      const auto q = qkv.narrow(1, 0, qw).view({m, heads_, head_dim_});
      const auto k = qkv.narrow(1, qw, kw).view({m, kv_heads_, head_dim_});
      const auto v = qkv.narrow(1, qw + kw, kw).view({m, kv_heads_, head_dim_});
      const torch::Tensor& cache = kv_caches[l];
      if (cache.scalar_type() == at::kChar) {
        write_kv_int8(cache, k, v, slot_mapping);
      } else {
        write_kv(cache, k, v, slot_mapping);
      }
      const auto attn = paged_decode(q, cache[0], cache[1], block_table, seq_lens, scale_);
      torch::Tensor h = L.o(attn.view({m, qw}));
      TORCH_CHECK(rms_norm(h, residual, L.post_norm, eps_), "decode_layers: rms_norm refused");
      const torch::Tensor gu = L.gate_up(h);
      auto act = torch::empty({m, gu.size(1) / 2}, gu.options());
      TORCH_CHECK(silu_and_mul(gu, act), "decode_layers: silu_and_mul refused");
      x = L.down(act);
    }
    return {x, residual};
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor cos_, sin_;
};

}  // namespace

void bind_decode_layers(pybind11::module& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, std::vector<std::optional<torch::Tensor>>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<std::optional<torch::Tensor>>,
                          std::vector<bool>, int64_t,
                          int64_t, int64_t, int64_t, double,
                          double, torch::Tensor, torch::Tensor>())
      // Without the GIL for the whole step (see bindings.cpp).
      .def("run", &DecodeLayers::run, "the decoder layers for a decode-only step of a few rows",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
