// Int4 weights widened for a prompt-sized step: PyTorch's CPU int4 kernel computes every row
// against the packed nibbles, and at hundreds of rows it runs at a fraction of a GEMM's speed
// (engine/layers/quant/int4.py), so int4_linear widens the weight once per call here and hands it
// to oneDNN's GEMM. Reads PyTorch's int4pack layout (per block of B output rows and per input k,
// B / 2 bytes; byte j holds row j low, row j + B / 2 high) with either PyTorch's bf16 (scale, zero)
// pairs, w = (q - 8) * scale + zero in float32 (as that kernel forms it), or the exact scale and
// min planes, w = q * scale + min (what the few-row op's exact mode computes with, on CPUs without
// AVX-512 BF16); writes w transposed, out[k, n] ([in_features, N]): a block's rows at one k are
// contiguous there. bf16 `out` rounds w once (oneDNN's bf16 GEMM, AVX-512 BF16); float32 `out`
// keeps it unrounded (a float32 GEMM: 8-bit weights with float32 activations, and every prompt
// chunk in exact mode). A two-nibble weight (8-bit values as two nibbles, kw = 2 * in_features)
// sums its halves first; a 5-bit one adds 16 to each nibble whose high bit is set (its bit plane,
// int4_linear.cpp).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cstring>
#include "int4_scales.h"
#include "simd16.h"

#if defined(ORBITAL_SIMD16)
namespace {

using simd::F16;

// S: c10::BFloat16 for PyTorch's (scale, zero) pairs [groups, np, 2]; float or at::Half for the
// exact scales and mins blocked by 64 rows (int4_scales.h).
template <typename S>
constexpr bool kPairs = std::is_same_v<S, c10::BFloat16>;

// The scales and zeros (pairs) or scales and mins (planes) of rows [n0, n0 + B) in group g.
template <int B, typename S>
static inline void group_scales(const S* sz, int64_t groups, int64_t g, int64_t np, int64_t n0, F16* sc, F16* z) {
  for (int v = 0; v < B / 16; ++v) {
    const int64_t n = n0 + 16 * v;
    if constexpr (kPairs<S>) {
      simd::from_bf16_pairs(sz + (g * np + n) * 2, sc[v], z[v]);
    } else {
      const S* p = planes_at(sz, groups, g, n);
      if constexpr (std::is_same_v<S, float>) {
        sc[v] = simd::loadu(p), z[v] = simd::loadu(p + kScaleRows);
      } else {
        sc[v] = simd::from_f16(p), z[v] = simd::from_f16(p + kScaleRows);
      }
    }
  }
}

// Adds to row[] the B weights of packed input kk (rows in order: the low nibbles, then the high
// ones): (q - 8) * scale + zero as PyTorch's kernel forms them (pairs), or q * scale + min. hb: the
// input's B high bits (a 5-bit weight), else null.
template <int B, typename S>
static inline void add_input(const uint8_t* p, const uint8_t* hb, const F16* sc, const F16* z, F16* row) {
  const F16 eight = simd::set1(8.f);
  for (int s = 0; s < B / 32; ++s) {
    F16 q[2];
    simd::from_nibbles(p + 16 * s, q[0], q[1]);
    for (int h = 0; h < 2; ++h) {
      const int u = s + h * (B / 32);  // rows 16 u .. 16 u + 15
      if (hb != nullptr) {
        uint16_t bits;
        std::memcpy(&bits, hb + 2 * u, 2);
        q[h] = simd::add_where(q[h], bits, 16.f);
      }
      const F16 v = kPairs<S> ? simd::sub(q[h], eight) : q[h];
      row[u] = simd::add(row[u], simd::fmadd(v, sc[u], z[u]));
    }
  }
}

// O: uint16_t (bf16 bits) or float.
template <int B, typename S, typename O>
void widen(const uint8_t* w, const uint8_t* hb, const S* sz, int64_t kw, int64_t k, int64_t gs, int64_t np,
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
        group_scales<B, S>(sz, kw / gs, g, np, n0, sc[0], z[0]);
        if (two) group_scales<B, S>(sz, kw / gs, g + k / gs, np, n0, sc[1], z[1]);
        for (int64_t kk = g * gs; kk < (g + 1) * gs; ++kk) {
          F16 row[B / 16];
          for (int v = 0; v < B / 16; ++v) row[v] = simd::zero();
          add_input<B, S>(wb + kk * (B / 2), hb != nullptr ? hb + (blk * kw + kk) * (B / 8) : nullptr, sc[0], z[0], row);
          if (two) add_input<B, S>(wb + (kk + k) * (B / 2), nullptr, sc[1], z[1], row);
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
// scales: PyTorch's bf16 (scale, zero) pairs [kw / group_size, np, 2], or the exact scales and
// mins [np / 64, kw / group_size, 2, 64] in float32 or float16; out bf16 or float32 [k, n] (n <= np;
// kw = k, or 2k for a two-nibble weight); hi_bits: a 5-bit weight's high bits [np / block_rows, k,
// block_rows / 8], or None. False (nothing written) where it does not apply.
bool int4_dequantize(torch::Tensor packed, torch::Tensor scales, int64_t group_size, int64_t block_rows,
                     torch::Tensor out, std::optional<torch::Tensor> hi_bits) {
#if defined(ORBITAL_SIMD16)
  if (packed.dim() != 2 || out.dim() != 2 || !packed.device().is_cpu()) return false;
  const int64_t np = packed.size(0), kw = packed.size(1) * 2, k = out.size(0), n = out.size(1);
  if (packed.scalar_type() != at::kByte || !packed.is_contiguous() || (block_rows != 64 && block_rows != 32) ||
      np % block_rows || n > np || (kw != k && kw != 2 * k) || group_size < 1 || kw % group_size || k % group_size)
    return false;
  const auto st = scales.scalar_type();
  const bool pairs = st == at::kBFloat16;
  const auto want = pairs ? std::vector<int64_t>{kw / group_size, np, 2}
                          : std::vector<int64_t>{np / kScaleRows, kw / group_size, 2, kScaleRows};
  if ((!pairs && (np % kScaleRows || (st != at::kFloat && st != at::kHalf))) || !scales.is_contiguous() ||
      scales.sizes() != at::IntArrayRef(want))
    return false;
  if ((out.scalar_type() != at::kBFloat16 && out.scalar_type() != at::kFloat) || !out.is_contiguous()) return false;
  if (hi_bits && !valid_hi_bits(*hi_bits, np, kw, k, block_rows)) return false;
  const auto* w = packed.data_ptr<uint8_t>();
  const uint8_t* hb = hi_bits ? hi_bits->data_ptr<uint8_t>() : nullptr;
  const auto with_scales = [&](const auto* sz) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sz)>>;
    const auto run = [&](auto* o) {
      using O = std::remove_pointer_t<decltype(o)>;
      if (block_rows == 64) {
        widen<64, S, O>(w, hb, sz, kw, k, group_size, np, n, o);
      } else {
        widen<32, S, O>(w, hb, sz, kw, k, group_size, np, n, o);
      }
    };
    if (out.scalar_type() == at::kFloat) {
      run(out.data_ptr<float>());
    } else {
      run(reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
    }
  };
  if (pairs) {
    with_scales(static_cast<const c10::BFloat16*>(scales.data_ptr<c10::BFloat16>()));
  } else if (st == at::kHalf) {
    with_scales(static_cast<const at::Half*>(scales.data_ptr<at::Half>()));
  } else {
    with_scales(static_cast<const float*>(scales.data_ptr<float>()));
  }
  return true;
#else
  return false;
#endif
}
