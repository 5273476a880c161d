// The CPU ops module: paged decode and prefill attention (paged_decode.cpp, prefill_attention.cpp),
// the paged cache write (kv_write.cpp) and the greedy row argmax (argmax.cpp), built once per source version by engine/kernels/cpu_ops.py.
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
void write_kv(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping);
torch::Tensor argmax_rows(torch::Tensor x);
bool prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                       torch::Tensor info, double scale, torch::Tensor out);

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
  m.def("write_kv", &write_kv, "write K/V rows into the paged cache at their slots");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax (first index of the max, NaN first) for float32/bfloat16");
  m.def("prefill_attention", &prefill_attention, "causal attention of a step's prompt chunks over the paged cache; false if not applicable");
  m.def("isa", &isa, "vector path compiled in");
}
