// A 16-lane float32 vector for the CPU ops, one source for two instruction sets: one __m512 on
// AVX-512, two __m256 on AVX2 + FMA. The kernels are written once against it, with the same
// 16-token tiles and packed layouts on both; only the primitives below differ. ORBITAL_SIMD16
// is defined where either exists (else the ops decline and PyTorch's path runs).
// Also: a vectorized exp for softmax, loads/stores of float32 or bfloat16 rows, bf16 rounding,
// float16 and bfloat16-pair loads and the nibbles of packed int4 weights as float32.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <torch/types.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ORBITAL_SIMD16 1
#define ORBITAL_SIMD16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ORBITAL_SIMD16 1
#endif

#if defined(ORBITAL_SIMD16)
#include <immintrin.h>
namespace simd {

#if defined(ORBITAL_SIMD16_AVX512)
struct F16 { __m512 v; };
struct M16 { __mmask16 k; };  // bit i = lane i
constexpr int kRegs = 32;      // F16 values that fit in registers (zmm0-31)

static inline F16 zero() { return {_mm512_setzero_ps()}; }
static inline F16 set1(float x) { return {_mm512_set1_ps(x)}; }
static inline F16 set1_bits(uint32_t u) { return {_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(u)))}; }
static inline F16 loadu(const void* p) { return {_mm512_loadu_ps(p)}; }
static inline F16 load(const void* p) { return {_mm512_load_ps(p)}; }  // 64-byte aligned
static inline void storeu(void* p, F16 a) { _mm512_storeu_ps(p, a.v); }
static inline void store(void* p, F16 a) { _mm512_store_ps(p, a.v); }
static inline F16 add(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline F16 sub(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline F16 mul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline F16 div(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline F16 abs(F16 a) { return {_mm512_abs_ps(a.v)}; }
static inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a*b + c
static inline F16 fnmadd(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a*b
static inline float reduce_add(F16 a) { return _mm512_reduce_add_ps(a.v); }
static inline float reduce_max(F16 a) { return _mm512_reduce_max_ps(a.v); }
static inline F16 round_nearest(F16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static inline F16 scale_pow2(F16 p, F16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n, n integral
// Masks.
static inline M16 lt(F16 a, F16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)}; }
static inline M16 gt(F16 a, F16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
static inline M16 is_nan(F16 a) { return {_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}; }
static inline M16 lanes_upto(int64_t base, int64_t last) {  // lanes i with base + i <= last
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return {_mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(last - base)))};
}
static inline M16 none() { return {0}; }
static inline M16 mor(M16 a, M16 b) { return {static_cast<__mmask16>(a.k | b.k)}; }
static inline bool any(M16 m) { return m.k != 0; }
static inline F16 select(M16 m, F16 a, F16 b) { return {_mm512_mask_mov_ps(b.v, m.k, a.v)}; }  // m ? a : b
// bf16 <-> float32: bf16 is the high half of a float32.
static inline F16 from_bf16(const void* p) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// 16 int8 values (an int8 KV row) as float32.
static inline F16 from_i8(const void* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))))};
}
// 16 float16 values as float32.
static inline F16 from_f16(const void* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)))};
}
// 16 pairs of bfloat16 as float32: a = the first of each pair, b = the second.
static inline void from_bf16_pairs(const void* p, F16& a, F16& b) {
  const __m512i v = _mm512_loadu_si512(p);
  a = {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
  b = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
// 16 bytes of packed nibbles (int4 weights) as float32: lo = the low nibbles, hi = the high ones.
static inline void from_nibbles(const void* p, F16& lo, F16& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
  hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
}
// a + c in the lanes whose bit is set in `bits` (bit i = lane i), a elsewhere: a 5-bit weight's
// high bit (c = 16) on its decoded nibbles.
static inline F16 add_where(F16 a, uint32_t bits, float c) {
  return {_mm512_mask_add_ps(a.v, static_cast<__mmask16>(bits), a.v, _mm512_set1_ps(c))};
}
// Weights streamed once (few-row linear): AVX2 splits them into even and odd elements, see
// there; one zmm needs no split, so the order is the natural one.
constexpr bool kBf16Split = false;
static inline F16 from_bf16_split(const void* p) { return from_bf16(p); }
// Round to bfloat16, nearest-even like c10::BFloat16 (NaN stays NaN); 16 values to p.
static inline void to_bf16(void* p, F16 a) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(static_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a.v)));
#else
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}
// v rounded to bfloat16 precision, kept as float32.
static inline F16 round_bf16(F16 a) {
#if defined(__AVX512BF16__)
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a.v));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16))};
#else
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_andnot_si512(_mm512_set1_epi32(0xffff), _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return {_mm512_castsi512_ps(r)};
#endif
}
// r[i] = sum of the lanes of v[i], for 16 vectors at once (pairwise within 128-bit lanes, then
// across lanes: 45 shuffles/adds instead of 16 separate reductions).
static inline F16 sum16x16(const F16* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD))};
}

#else  // AVX2 + FMA: two 8-lane halves
struct F16 { __m256 lo, hi; };
struct M16 { __m256 lo, hi; };  // all-ones lanes
constexpr int kRegs = 8;        // F16 values that fit in registers (ymm0-15, two each)

static inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline F16 set1_bits(uint32_t u) {
  const __m256 b = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(u)));
  return {b, b};
}
static inline F16 loadu(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
static inline F16 load(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_load_ps(f), _mm256_load_ps(f + 8)};
}
static inline void storeu(void* p, F16 a) {
  float* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, a.lo);
  _mm256_storeu_ps(f + 8, a.hi);
}
static inline void store(void* p, F16 a) {
  float* f = static_cast<float*>(p);
  _mm256_store_ps(f, a.lo);
  _mm256_store_ps(f + 8, a.hi);
}
#define ORBITAL_SIMD16_BINARY(name, op) \
  static inline F16 name(F16 a, F16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
ORBITAL_SIMD16_BINARY(add, _mm256_add_ps)
ORBITAL_SIMD16_BINARY(sub, _mm256_sub_ps)
ORBITAL_SIMD16_BINARY(mul, _mm256_mul_ps)
ORBITAL_SIMD16_BINARY(div, _mm256_div_ps)
ORBITAL_SIMD16_BINARY(max, _mm256_max_ps)
#undef ORBITAL_SIMD16_BINARY
static inline F16 abs(F16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
static inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline F16 fnmadd(F16 a, F16 b, F16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
static inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float reduce_add(F16 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
static inline float reduce_max(F16 a) {
  const __m256 x = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline F16 round_nearest(F16 a) {
  constexpr int m = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, m), _mm256_round_ps(a.hi, m)};
}
static inline __m256 pow2_8(__m256 p, __m256 n) {  // p * 2^n for integral n in [-127, 127]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline F16 scale_pow2(F16 p, F16 n) { return {pow2_8(p.lo, n.lo), pow2_8(p.hi, n.hi)}; }
static inline M16 lt(F16 a, F16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)}; }
static inline M16 gt(F16 a, F16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
static inline M16 is_nan(F16 a) { return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)}; }
static inline M16 lanes_upto(int64_t base, int64_t last) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lim = _mm256_set1_epi32(static_cast<int>(last - base) + 1);  // lane < last - base + 1
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, lane)),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_add_epi32(lane, _mm256_set1_epi32(8))))};
}
static inline M16 none() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline M16 mor(M16 a, M16 b) { return {_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)}; }
static inline bool any(M16 m) { return _mm256_movemask_ps(_mm256_or_ps(m.lo, m.hi)) != 0; }
static inline F16 select(M16 m, F16 a, F16 b) { return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)}; }
static inline F16 from_bf16(const void* p) {
  const __m128i* q = static_cast<const __m128i*>(p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16))};
}
static inline F16 from_i8(const void* p) {
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
static inline F16 from_f16(const void* p) {
  const __m128i* q = static_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
static inline void from_bf16_pairs(const void* p, F16& a, F16& b) {
  const __m256i* q = static_cast<const __m256i*>(p);
  const __m256i v0 = _mm256_loadu_si256(q), v1 = _mm256_loadu_si256(q + 1);
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  a = {_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16))};
  b = {_mm256_castsi256_ps(_mm256_and_si256(v0, hi)), _mm256_castsi256_ps(_mm256_and_si256(v1, hi))};
}
static inline void from_nibbles(const void* p, F16& lo, F16& hi) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
  const __m256i m = _mm256_set1_epi32(15);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, m)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, m))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
}
// Lanes whose bit is set in the low 8 bits of `bits` as all-ones.
static inline __m256 lanes_of_bits8(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel));
}
static inline F16 add_where(F16 a, uint32_t bits, float c) {
  const __m256 cv = _mm256_set1_ps(c);
  return {_mm256_add_ps(a.lo, _mm256_and_ps(lanes_of_bits8(bits & 255), cv)),
          _mm256_add_ps(a.hi, _mm256_and_ps(lanes_of_bits8(bits >> 8), cv))};
}
// 16 bf16 weights as float32 with the even-indexed ones in .lo and the odd-indexed in .hi: one
// 32-byte load, a shift and a mask, no widening shuffles (the few-row linear streams weights and
// is short of instructions per byte on AVX2). The other operand must be in the same order
// (kBf16Split: the caller stores it so once).
constexpr bool kBf16Split = true;
static inline F16 from_bf16_split(const void* p) {
  const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
static inline __m256i bf16_bits8(__m256 v) {  // nearest-even, NaN kept; as 8 int32 in [0, 65535]
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline void to_bf16(void* p, F16 a) {
  // packus interleaves 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7]; the permute restores the order.
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(a.lo), bf16_bits8(a.hi));
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
static inline F16 round_bf16(F16 a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.hi), 16))};
}
static inline __m256 hsum8x8(const __m256* s) {  // r[i] = sum of the lanes of s[i], i < 8
  const __m256 h01 = _mm256_hadd_ps(s[0], s[1]), h23 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 h45 = _mm256_hadd_ps(s[4], s[5]), h67 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
static inline F16 sum16x16(const F16* v) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {hsum8x8(s), hsum8x8(s + 8)};
}
#endif

// exp for x <= 0 (scores minus their running max): Cephes-style range reduction, p * 2^n.
static inline F16 exp(F16 x) {
  x = max(x, set1(-87.0f));
  const F16 n = round_nearest(mul(x, set1(1.44269504088896341f)));
  F16 r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  F16 p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return scale_pow2(p, n);
}

static inline M16 first(int64_t n) { return lanes_upto(0, n - 1); }  // lanes i < n
static inline F16 maskz(M16 m, F16 a) { return select(m, a, zero()); }

// 16 values of a float32, bfloat16 or int8 (unscaled) row as float32.
template <typename T>
static inline F16 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return loadu(p);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return from_i8(p);
  } else {
    return from_bf16(p);
  }
}
// Store 16 float32 lanes as T (rounded like a PyTorch cast).
template <typename T>
static inline void store16(T* p, F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    storeu(p, v);
  } else {
    to_bf16(p, v);
  }
}
// v rounded to T's precision, kept as float32: where PyTorch would store an intermediate in T.
template <typename T>
static inline F16 round16(F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return round_bf16(v);
  }
}

}  // namespace simd
#endif
