// The CPU ops module: paged decode and prefill attention (paged_decode.cpp, prefill_attention.cpp),
// the few-row linears of low-concurrency decode (small_linear.cpp, int4_linear.cpp), int4 weights
// widened to bf16 or float32 for prompt-sized steps (int4_dequantize.cpp),
// the LoRA deltas of decode rows (lora_bgmv.cpp),
// the paged cache write (kv_write.cpp), the greedy row argmax (argmax.cpp) and the fused
// RMSNorm / SiLU-and-mul / rotary steps (fused_elementwise.cpp), a few-row decode step's decoder
// layers in one call (decode_layers.cpp), built once per source version
// by engine/kernels/cpu_ops.py.
#include <torch/extension.h>
#include "simd16.h"

#include "ops.h"

void bind_decode_layers(pybind11::module& m);  // decode_layers.cpp

// Which vector path this build has (benchmarks and tests report it).
static std::string isa() {
#if defined(ORBITAL_SIMD16_AVX512) && defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(ORBITAL_SIMD16_AVX512)
  return "avx512";
#elif defined(ORBITAL_SIMD16)
  return "avx2";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The ops that run for a while drop the GIL (as PyTorch's own ops do): in a serving replica the
  // asyncio loop that hands a step's tokens to the output channel and takes new requests runs
  // beside the step instead of waiting for it to end. The short elementwise ops keep it, so the
  // step thread does not queue for the GIL after each of them.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "paged decode attention", nogil);
  m.def("write_kv", &write_kv, "write K/V rows into the paged cache at their slots");
  m.def("write_kv_int8", &write_kv_int8, "quantize K/V rows (per-row float16 scale) into the int8 paged cache");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax (first index of the max, NaN first) for float32/bfloat16");
  m.def("prefill_attention", &prefill_attention, "causal attention of a step's prompt chunks over the paged cache; false if not applicable", nogil);
  m.def("rms_norm", &rms_norm, "in place: residual += x, x = weight * rmsnorm(residual); false if not applicable");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up over [gate | up] rows; false if not applicable");
  m.def("rotary", &rotary, "in place neox rotary embedding of the first heads of each row; false if not applicable");
  m.def("small_linear", &small_linear, "out = x . w^T + bias for a few rows (float32/bf16 weights); false if not applicable", nogil);
  // hi_bits (optional): a 5-bit weight's high-bit plane beside its nibbles; int8_x: x rounded to
  // int8 per group for integer dot products (int4_int8_dot.h).
  namespace py = pybind11;
  m.def("int4_small_linear", &int4_small_linear,
        "out = x . w^T + bias for a few rows, w in PyTorch's CPU int4 pack; false if not applicable", nogil,
        py::arg("x"), py::arg("packed"), py::arg("scale_min"), py::arg("group_size"), py::arg("block_rows"),
        py::arg("bias"), py::arg("out"), py::arg("hi_bits") = py::none(), py::arg("int8_x") = false);
  m.def("int8_dot_products", &int8_dot_products, "whether int4_small_linear's int8_x runs here (AVX-512 VNNI, VBMI, BITALG)");
  m.def("int4_dequantize", &int4_dequantize,
        "out[k, n] = bf16 or float32 weight of PyTorch's CPU int4 pack (transposed) for a prompt-sized GEMM; false if not applicable",
        nogil, py::arg("packed"), py::arg("scales"), py::arg("group_size"), py::arg("block_rows"), py::arg("out"),
        py::arg("hi_bits") = py::none());
  m.def("lora_bgmv", &lora_bgmv,
        "y[rows] += each row's LoRA delta from its slot's A and per-piece B^T (decode rows); false if not applicable",
        nogil);
  m.def("isa", &isa, "vector path compiled in");
  bind_decode_layers(m);
}
