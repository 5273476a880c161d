// Int4 weights widened to bfloat16 for a prompt-sized step: PyTorch's CPU int4 kernel computes
// every row against the packed nibbles, and at hundreds of rows it runs at a fraction of a bf16
// GEMM's speed (engine/layers/quant/int4.py), so int4_linear widens the weight once per call here
// and hands it to oneDNN's bf16 GEMM. Reads PyTorch's int4pack layout (per block of B output rows
// and per input k, B / 2 bytes; byte j holds row j low, row j + B / 2 high) and its bf16 (scale,
// zero) pairs, w = (q - 8) * scale + zero in float32 (as that kernel forms it), rounded to bf16; writes w transposed,
// out[k, n] ([in_features, N]): a block's rows at one k are contiguous there. A two-nibble weight
// (8-bit values as two nibbles, kw = 2 * in_features) sums its halves before rounding. A float32
// `out` keeps the sums unrounded (8-bit weights with float32 activations: their prompt chunks stay
// a float32 GEMM, as int8.py's were).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "simd16.h"

#if defined(ORBITAL_SIMD16)
namespace {

using simd::F16;

// The scales and zeros of rows [n0, n0 + B) in group g.
template <int B>
static inline void group_scales(const c10::BFloat16* sz, int64_t g, int64_t np, int64_t n0, F16* sc, F16* z) {
  for (int v = 0; v < B / 16; ++v) simd::from_bf16_pairs(sz + (g * np + n0 + 16 * v) * 2, sc[v], z[v]);
}

// Adds to row[] the B weights of packed input kk, (q - 8) * scale + zero as PyTorch's kernel forms
// them (rows in order: the low nibbles, then the high ones).
template <int B>
static inline void add_input(const uint8_t* p, const F16* sc, const F16* z, F16* row) {
  const F16 eight = simd::set1(8.f);
  for (int s = 0; s < B / 32; ++s) {
    F16 lo, hi;
    simd::from_nibbles(p + 16 * s, lo, hi);
    row[s] = simd::add(row[s], simd::fmadd(simd::sub(lo, eight), sc[s], z[s]));
    const int u = s + B / 32;
    row[u] = simd::add(row[u], simd::fmadd(simd::sub(hi, eight), sc[u], z[u]));
  }
}

// O: uint16_t (bf16 bits) or float.
template <int B, typename O>
void widen(const uint8_t* w, const c10::BFloat16* sz, int64_t kw, int64_t k, int64_t gs, int64_t np,
           int64_t n, O* out) {
  const int64_t blocks = (n + B - 1) / B;  // padding rows past n are never written
  const bool two = kw != k;
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    alignas(64) O tail[B];
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n0 = blk * B, rows = std::min<int64_t>(B, n - n0);
      const uint8_t* wb = w + blk * kw * (B / 2);
      for (int64_t g = 0; g < k / gs; ++g) {
        // A two-nibble weight's second half (inputs k..2k) lands on the same inputs as the first.
        F16 sc[2][B / 16], z[2][B / 16];
        group_scales<B>(sz, g, np, n0, sc[0], z[0]);
        if (two) group_scales<B>(sz, g + k / gs, np, n0, sc[1], z[1]);
        for (int64_t kk = g * gs; kk < (g + 1) * gs; ++kk) {
          F16 row[B / 16];
          for (int v = 0; v < B / 16; ++v) row[v] = simd::zero();
          add_input<B>(wb + kk * (B / 2), sc[0], z[0], row);
          if (two) add_input<B>(wb + (kk + k) * (B / 2), sc[1], z[1], row);
          O* o = out + kk * n + n0;
          O* dst = rows == B ? o : tail;
          for (int v = 0; v < B / 16; ++v) {
            if constexpr (std::is_same_v<O, float>) {
              simd::storeu(dst + 16 * v, row[v]);
            } else {
              simd::to_bf16(dst + 16 * v, row[v]);
            }
          }
          if (rows != B) std::memcpy(o, tail, rows * sizeof(O));
        }
      }
    }
  });
}

}  // namespace
#endif

// packed uint8 [np, kw / 2] in the int4pack layout with `block_rows` (64 or 32) rows per block;
// scales_zeros bf16 [kw / group_size, np, 2]; out bf16 or float32 [k, n] (n <= np; kw = k, or 2k
// for a two-nibble weight). False (nothing written) where it does not apply.
bool int4_dequantize(torch::Tensor packed, torch::Tensor scales_zeros, int64_t group_size, int64_t block_rows,
                     torch::Tensor out) {
#if defined(ORBITAL_SIMD16)
  if (packed.dim() != 2 || scales_zeros.dim() != 3 || out.dim() != 2 || !packed.device().is_cpu()) return false;
  const int64_t np = packed.size(0), kw = packed.size(1) * 2, k = out.size(0), n = out.size(1);
  if (packed.scalar_type() != at::kByte || !packed.is_contiguous() || (block_rows != 64 && block_rows != 32) ||
      np % block_rows || n > np || (kw != k && kw != 2 * k) || group_size < 1 || kw % group_size || k % group_size)
    return false;
  if (scales_zeros.scalar_type() != at::kBFloat16 || !scales_zeros.is_contiguous() ||
      scales_zeros.sizes() != at::IntArrayRef({kw / group_size, np, 2}))
    return false;
  if ((out.scalar_type() != at::kBFloat16 && out.scalar_type() != at::kFloat) || !out.is_contiguous()) return false;
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* sz = scales_zeros.data_ptr<c10::BFloat16>();
  const auto run = [&](auto* o) {
    using O = std::remove_pointer_t<decltype(o)>;
    if (block_rows == 64) {
      widen<64, O>(w, sz, kw, k, group_size, np, n, o);
    } else {
      widen<32, O>(w, sz, kw, k, group_size, np, n, o);
    }
  };
  if (out.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
  }
  return true;
#else
  return false;
#endif
}
