// int8 activations for the few-row int4 op (int4_linear.cpp; the `int8_activations` engine
// setting): each input row is rounded per weight group to int8 with one float32 scale
// (x ~ d * q, d = max|x| / 127, as llama.cpp's Q8 blocks), and a group's sum of q_w * q_x is an
// exact int32 from AVX-512 VNNI's u8 x s8 dot products (64 multiply-adds per instruction, against
// 32 for vdpbf16ps, and no widening of the nibbles to bf16). The group then adds
// scale * d * sum + min * d * sum(q_x): the exact weight times the rounded activations, summed in
// float32 per group.
// Per 4 inputs and 64 rows: two 64-byte loads, two byte permutes that put each row's 4 bytes in a
// 32-bit lane (rows 0..15 and 16..31, their high nibbles rows 32..63), four masks; a 5-bit weight
// adds its high bits with a byte permute, a bit shuffle and a masked add per 16 rows.
// Compiled into every AVX-512 build with a function target; runs where the CPU has VNNI, VBMI and
// BITALG (AMD Zen 4, Intel Ice Lake and later).
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "simd16.h"

#if defined(ORBITAL_SIMD16_AVX512)
#define ORBITAL_INT8_DOT 1
#define ORBITAL_INT8_TARGET __attribute__((target("avx512vnni,avx512vbmi,avx512bitalg")))

static inline bool int8_dot_runs() {
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
                         __builtin_cpu_supports("avx512bitalg");
  return ok;
}

// Input rows rounded to int8 per group of gs: x ~ d * q, q in [-127, 127].
struct Int8Rows {
  std::vector<int8_t> q;      // [m, kw]
  std::vector<float> d;       // [m, groups]
  std::vector<float> d_qsum;  // [m, groups]: d * sum(q) over the group (the weights' mins multiply it)
};

// The rounding tests/engine/test_int4_int8_dot.py repeats: d = amax / 127, q = round-half-even(x * (127 / amax)).
static inline void quantize_rows(const float* xf, int64_t m, int64_t kw, int64_t gs, Int8Rows& out) {
  const int64_t groups = kw / gs;
  out.q.resize(m * kw), out.d.resize(m * groups), out.d_qsum.resize(m * groups);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      const float* x = xf + i * kw + g * gs;
      int8_t* q = out.q.data() + i * kw + g * gs;
      float amax = 0.f;
      for (int64_t j = 0; j < gs; ++j) amax = std::max(amax, std::fabs(x[j]));
      // id as one division: -ffast-math would turn 1 / (amax / 127) into it anyway.
      const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < gs; ++j) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[j] * id)));
        q[j] = static_cast<int8_t>(v), sum += q[j];
      }
      out.d[i * groups + g] = d, out.d_qsum[i * groups + g] = d * static_cast<float>(sum);
    }
}

// Byte permutes over inputs k..k+3 (a: k, k + 1; b: k + 2, k + 3; 32 bytes each, byte j holding
// rows j and j + 32): 32-bit lane l gets byte j = l (lo) or 16 + l (hi) of each input. For the
// high bits (32 bytes, 8 per input): qword q of the vector for rows 16 v.. gets input t's byte
// holding rows 16 v + 2 q and 16 v + 2 q + 1 as its byte t, and each weight byte 4 l + t picks
// bit 8 t + l % 8 of its qword.
struct Int8DotTables {
  alignas(64) uint8_t lo[64], hi[64], hb[4][64], bit[64];
};
static Int8DotTables make_int8_dot_tables() {
  Int8DotTables t{};
  for (int l = 0; l < 16; ++l)
    for (int k = 0; k < 4; ++k) {
      t.lo[4 * l + k] = static_cast<uint8_t>(32 * k + l);
      t.hi[4 * l + k] = static_cast<uint8_t>(32 * k + 16 + l);
      t.bit[4 * l + k] = static_cast<uint8_t>(8 * k + l % 8);
    }
  for (int v = 0; v < 4; ++v)
    for (int q = 0; q < 8; ++q)
      for (int k = 0; k < 8; ++k) t.hb[v][8 * q + k] = static_cast<uint8_t>(k < 4 ? 8 * k + 2 * v + q / 4 : 0);
  return t;
}
static const Int8DotTables kInt8Dot = make_int8_dot_tables();

// acc += u8 w . s8 x per 32-bit lane, in place. As an intrinsic GCC copied each accumulator out
// and back around every instruction and kept some on the stack: ~75 instructions per 16 dot
// products, against 16 + ~20 this way.
ORBITAL_INT8_TARGET static inline void dpbusd(__m512i& acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
}

// Rows [0, M) of 64-row block blk into racc ([M][64] float32), from the int8 rows xq (row i at
// xq + i * kw), their scales d and d * sum(q) ([M][groups]); load_scales(g, n, sc, mn): the scale
// and min of rows [n, n + 16) in group g.
template <int M, bool FIVE, typename LoadScales>
ORBITAL_INT8_TARGET void block_int8(const uint8_t* w, const uint8_t* hb, int64_t kw, int64_t groups, int64_t gs,
                                    const int8_t* xq, const float* d, const float* d_qsum, int64_t blk, float* racc,
                                    LoadScales load_scales) {
  const uint8_t* wb = w + blk * kw * 32;
  const uint8_t* hbb = FIVE ? hb + blk * kw * 8 : nullptr;
  const int64_t n0 = blk * 64;
  const __m512i lo = _mm512_load_si512(kInt8Dot.lo), hi = _mm512_load_si512(kInt8Dot.hi);
  const __m512i nib = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  __m512i hperm[4], hbit;
  if constexpr (FIVE) {
    for (int v = 0; v < 4; ++v) hperm[v] = _mm512_load_si512(kInt8Dot.hb[v]);
    hbit = _mm512_load_si512(kInt8Dot.bit);
  }
  // Results in racc (L1), folded per group: the registers hold the group's int32 sums, the
  // decoded weights and the tables (results kept in registers too spilled them every input).
  for (int j = 0; j < M * 64; ++j) racc[j] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[M][4];
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_si512();
    const int64_t k0 = g * gs;
    const uint8_t* p = wb + k0 * 32;
    for (int64_t k = 0; k < gs; k += 4, p += 128) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + 1024 + 64), _MM_HINT_T0);
      const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
      const __m512i v0 = _mm512_permutex2var_epi8(a, lo, b), v1 = _mm512_permutex2var_epi8(a, hi, b);
      __m512i wv[4] = {_mm512_and_si512(v0, nib), _mm512_and_si512(v1, nib),
                       _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib), _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib)};
      if constexpr (FIVE) {
        const __m512i h = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hbb + (k0 + k) * 8)));
        for (int v = 0; v < 4; ++v) {
          const __mmask64 set = _mm512_bitshuffle_epi64_mask(_mm512_permutexvar_epi8(hperm[v], h), hbit);
          wv[v] = _mm512_mask_add_epi8(wv[v], set, wv[v], sixteen);
        }
      }
      for (int i = 0; i < M; ++i) {
        int32_t four;
        std::memcpy(&four, xq + i * kw + k0 + k, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int v = 0; v < 4; ++v) dpbusd(acc[i][v], wv[v], xv);
      }
    }
    // The sums leave the registers here: kept live across the fold (the scales, the results) they
    // all went to the stack, each dot product a load and a store around it (2x slower at 4 rows).
    alignas(64) int32_t sums[M][4][16];
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 4; ++v) _mm512_store_si512(sums[i][v], acc[i][v]);
    for (int v = 0; v < 4; ++v) {
      __m512 sc, mn;
      load_scales(g, n0 + 16 * v, sc, mn);
      for (int i = 0; i < M; ++i) {
        float* ra = racc + i * 64 + 16 * v;
        const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i][v])), _mm512_set1_ps(d[i * groups + g]));
        const __m512 r = _mm512_fmadd_ps(s, sc, _mm512_loadu_ps(ra));
        _mm512_storeu_ps(ra, _mm512_fmadd_ps(mn, _mm512_set1_ps(d_qsum[i * groups + g]), r));
      }
    }
  }
}
#endif
