// AVX-512 helpers shared by the CPU ops (attention, argmax, fused elementwise): a vectorized
// exp for softmax, and 16-lane loads, stores and bf16 rounding of float32 or bfloat16 values.
#pragma once
#include <immintrin.h>
#include <type_traits>
#include <torch/extension.h>

namespace simd512 {

// exp for x <= 0 (scores minus their running max): Cephes-style range reduction, p * 2^n.
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 16 values of a cached row as float32.
template <typename T>
static inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {  // bf16 = high half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round 16 float32 lanes to bfloat16, nearest-even like c10::BFloat16 (NaN stays NaN).
static inline __m256i to_bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// Store 16 float32 lanes as T (rounded like a PyTorch cast).
template <typename T>
static inline void store16(T* p, __m512 v);
template <>
inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}

// v rounded to T's precision, kept as float32: where PyTorch would store an intermediate in T.
template <typename T>
static inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
  }
}

}  // namespace simd512
