// The CPU ops module: paged decode attention (paged_decode.cpp) and fused elementwise ops
// (fused.cpp), built once per source version by engine/kernels/cpu_ops.py.
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_inplace(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t head_dim);
torch::Tensor silu_and_mul(torch::Tensor x);

// Which vector path this build has (benchmarks and tests report it).
static std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  m.def("rotary_inplace", &rotary_inplace, "rotary embedding (rotate-half layout) on q and k rows, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:]");
  m.def("isa", &isa, "vector path compiled in");
}
