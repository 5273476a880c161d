// Int4 linear for a few rows (decode at low concurrency): y[m, n] = x[m, :] . w[n, :] + bias, with
// w group-wise int4 (w = q * scale + min per group of inputs, engine/layers/quant/int4_format.py), read in
// place from PyTorch's CPU int4pack layout: per block of B output rows (64, or 32 where PyTorch
// runs its AVX2 code) and per input k, B / 2 bytes; byte j holds row j (low nibble) and row
// j + B / 2 (high). At one row PyTorch's kernel stays below the memory bandwidth (a SmolLM2 step's
// 121 linears: 4.7 ms, this op 3.7; bench/bench_quant_kernels.py). Each thread takes whole blocks;
// per block, group and k, x[k] is broadcast and the decoded nibbles (16 bytes -> 32 rows as two
// float vectors) are FMA'd into per-group accumulators, folded at the group's end as
// acc * scale + min * sum(x over the group) (sums made once per call). Up to 4 input rows share
// the decoded nibbles; up to 64 go in chunks of 4 over each block while its bytes are in cache
// (decode at moderate and high concurrency: on AVX-512 BF16 a 32-row SmolLM2 step takes 63 ms
// with this op against 90 with PyTorch's kernel).
// A 5-bit weight (GGUF's Q5_0 / Q5_1 / Q5_K values, 0..31) is its low nibbles in that layout plus
// a plane of high bits beside it, [np / B, kw, B / 8] (per block and input k, bit r of the B / 8
// bytes is row r's): 5.5-6 bits a weight where two nibbles took 8.5.
// Returns false where it does not apply.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>
#include "int4_int8_dot.h"
#include "int4_scales.h"
#include "simd16.h"
#include "work_queue.h"

#if defined(ORBITAL_SIMD16)
namespace {

using simd::F16;

constexpr int64_t kMaxRows = 64;
constexpr int64_t kChunk = 4;  // rows per pass over a block (their accumulators stay in registers)
// 16-byte sub-blocks decoded per k and input rows per pass: the group accumulators
// (2 * kSub * rows) and the decoded nibbles (2 * kSub) must stay in registers.
constexpr int kSub = simd::kRegs >= 32 ? 2 : 1;
constexpr int kPassRows = simd::kRegs >= 32 ? 4 : 2;
constexpr int64_t kAhead = 1024;  // bytes of the weight stream prefetched ahead (measured: 1-2 KiB)

// S: float or at::Half, scales and mins blocked by 64 rows (int4_scales.h); c10::BFloat16: PyTorch's kernel's (scale, zero) pairs [groups, np, 2] with
// w = (q - 8) * scale + zero, i.e. min = zero - 8 scale.
template <typename S>
constexpr bool kPairs = std::is_same_v<S, c10::BFloat16>;

template <typename S>
struct Args {
  const float* xf;    // [m, kw] activations as float32 (x twice over for a two-nibble weight)
  const float* xsum;  // [m, groups]: sums of xf over each group
  const uint8_t* w;   // packed [np / B, kw, B / 2]
  const S* scale;     // blocked planes (pairs: [groups, np, 2] or blocked, int4_scales.h pairs_at)
  int64_t kw, groups, gs, np;
  const uint8_t* hb;  // a 5-bit weight's high bits [np / B, kw, B / 8], else null
  bool blocked;       // pairs blocked by 64 rows (int4_scales.h pairs_at)
  // int8 activations (int4_int8_dot.h), else null: x rounded per group [m, kw], d and d * sum(q) [m, groups]
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xd_qsum = nullptr;
};

// Scale and min of rows [n, n + 16) in group g.
template <typename S>
static inline void load_scales(const Args<S>& a, int64_t g, int64_t n, F16& sc, F16& mn) {
  if constexpr (kPairs<S>) {
    F16 z;
    simd::from_bf16_pairs(pairs_at(a.scale, a.groups, a.np, a.blocked, g, n), sc, z);
    mn = simd::fnmadd(simd::set1(8.f), sc, z);
  } else if constexpr (std::is_same_v<S, float>) {
    const S* p = planes_at(a.scale, a.groups, g, n);
    sc = simd::loadu(p), mn = simd::loadu(p + kScaleRows);
  } else {
    const S* p = planes_at(a.scale, a.groups, g, n);
    sc = simd::from_f16(p), mn = simd::from_f16(p + kScaleRows);
  }
}

// PyTorch's pairs of 64 rows from n0 in group g: in its layout strided by N, not streamed in
// order, so asked ahead (the blocked planes and pairs lie in order).
template <typename S>
static inline void prefetch_scales(const Args<S>& a, int64_t g, int64_t n0) {
  if constexpr (kPairs<S>) {
    if (g >= a.groups || a.blocked) return;
    const char* p = reinterpret_cast<const char*>(a.scale + (g * a.np + n0) * 2);
    for (int l = 0; l < 256; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
  }
}

// Group g of sub-blocks [sub0, sub0 + SUB) of a block (rows 16 * sub + [0, 16) and the same + B / 2)
// for input rows [i0, i0 + MR): accumulate, then fold into racc ([rows][B], float32). FIVE: hbb is
// the block's high bits, 16 added to each nibble whose bit is set.
template <int B, int SUB, int MR, bool FIVE, typename S>
static inline void pass(const Args<S>& a, const uint8_t* wb, const uint8_t* hbb, int64_t n0, int64_t g, int sub0,
                        int i0, float* racc) {
  F16 acc[MR][2 * SUB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * SUB; ++j) acc[i][j] = simd::zero();
  const int64_t k0 = g * a.gs;
  const uint8_t* p = wb + k0 * (B / 2) + 16 * sub0;
  const uint8_t* hp = FIVE ? hbb + k0 * (B / 8) + 2 * sub0 : nullptr;
  const float* x = a.xf + i0 * a.kw + k0;
  const bool first = sub0 == 0 && i0 == 0;
  for (int64_t k = 0; k < a.gs; ++k, p += B / 2) {
    if (first) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead), _MM_HINT_T0);
    F16 lo[SUB], hi[SUB];
    for (int s = 0; s < SUB; ++s) simd::from_nibbles(p + 16 * s, lo[s], hi[s]);
    if constexpr (FIVE) {
      for (int s = 0; s < SUB; ++s) {  // rows 16 s.. at bit 16 s, rows B / 2 + 16 s.. at B / 2 + 16 s
        uint16_t l, h;
        std::memcpy(&l, hp + 2 * s, 2);
        std::memcpy(&h, hp + B / 16 + 2 * s, 2);
        lo[s] = simd::add_where(lo[s], l, 16.f), hi[s] = simd::add_where(hi[s], h, 16.f);
      }
      hp += B / 8;
    }
    for (int i = 0; i < MR; ++i) {
      const F16 xv = simd::set1(x[i * a.kw + k]);
      for (int s = 0; s < SUB; ++s) {
        acc[i][2 * s] = simd::fmadd(xv, lo[s], acc[i][2 * s]);
        acc[i][2 * s + 1] = simd::fmadd(xv, hi[s], acc[i][2 * s + 1]);
      }
    }
  }
  for (int s = 0; s < SUB; ++s)
    for (int h = 0; h < 2; ++h) {
      const int64_t r = 16 * (sub0 + s) + h * (B / 2);
      F16 sc, mn;
      load_scales(a, g, n0 + r, sc, mn);
      for (int i = 0; i < MR; ++i) {
        float* ra = racc + (i0 + i) * B + r;
        const F16 xs = simd::set1(a.xsum[(i0 + i) * a.groups + g]);
        simd::storeu(ra, simd::fmadd(mn, xs, simd::fmadd(acc[i][2 * s + h], sc, simd::loadu(ra))));
      }
    }
}

// All input rows, kPassRows at a time.
template <int B, int SUB, int M, int I0, bool FIVE, typename S>
static inline void passes(const Args<S>& a, const uint8_t* wb, const uint8_t* hbb, int64_t n0, int64_t g, int sub0,
                          float* racc) {
  if constexpr (I0 < M) {
    constexpr int mr = std::min(kPassRows, M - I0);
    pass<B, SUB, mr, FIVE, S>(a, wb, hbb, n0, g, sub0, I0, racc);
    passes<B, SUB, M, I0 + mr, FIVE, S>(a, wb, hbb, n0, g, sub0, racc);
  }
}

// A block's results ([M][B] float32) plus bias to y (rows past n dropped).
template <int B, int M, typename X>
static inline void store_rows(const float* racc, int64_t blk, int64_t n, const X* bias, X* y, int64_t ys) {
  const int64_t n0 = blk * B, rows = std::min<int64_t>(B, n - n0);
  for (int i = 0; i < M; ++i)
    for (int64_t r = 0; r < rows; ++r) {
      const float b = bias != nullptr ? static_cast<float>(bias[n0 + r]) : 0.f;
      y[i * ys + n0 + r] = static_cast<X>(racc[i * B + r] + b);
    }
}

template <int B, int M, bool FIVE, typename S, typename X>
void block(const Args<S>& a, int64_t blk, int64_t n, const X* bias, X* y, int64_t ys) {
  constexpr int sub = std::min(kSub, B / 32);
  alignas(64) float racc[M][B] = {};
  const uint8_t* wb = a.w + blk * a.kw * (B / 2);
  const uint8_t* hbb = FIVE ? a.hb + blk * a.kw * (B / 8) : nullptr;
  const int64_t n0 = blk * B;
  // Group-major: a group's bytes (group_size * B / 2) stay in L1 across the passes.
  for (int64_t g = 0; g < a.groups; ++g) {
    prefetch_scales(a, g + 2, n0);
    for (int s0 = 0; s0 < B / 32; s0 += sub) passes<B, sub, M, 0, FIVE, S>(a, wb, hbb, n0, g, s0, &racc[0][0]);
  }
  store_rows<B, M, X>(&racc[0][0], blk, n, bias, y, ys);
}

#if defined(ORBITAL_SIMD16_AVX512) && defined(__AVX512BF16__)
// bf16 activations on AVX-512 BF16: vdpbf16ps does 32 multiply-adds per instruction (products of
// two bf16 are exact in float32, sums in float32), so the nibbles are made bf16 instead of float32:
// q as 1 + q / 16 (exponent 0x3F80, q in mantissa bits 3..6; exact), two inputs k, k + 1 per
// 32-bit lane. Per two inputs and 64 rows: 13 vector ops besides the 4 dot products per input row,
// where the float32 path takes 22 besides 8 FMAs. Then acc = X + Q / 16 (X = sum of x, Q = sum of
// q * x over the group): the group adds 16 s * acc + (min - 16 s) * X.
// Lanes hold rows in unpack order: vector v (0..3) lane l is row kDpRow[v] + l + (l >= 8 ? 8 : 0).
// A 5-bit weight puts q in mantissa bits 2..6 (1 + q / 32, exact): the nibble at 2..5 and the
// high bit at 6, set from the bit plane by a byte shuffle and a bit test per vector; the group
// adds 32 s * acc + (min - 32 s) * X.
constexpr int kDpRow[4] = {0, 8, 32, 40};

// Per vector v: the byte shuffle that puts, in each 16-bit element (lane l, input k + t), the
// bit-plane byte holding that row's bit (the 16 bytes of inputs k and k + 1, 8 each), and the
// bit to test in it.
struct DpBits {
  alignas(64) uint8_t shuffle[4][64];
  alignas(64) uint16_t bit[4][32];
};
static DpBits make_dp_bits() {
  DpBits d{};
  for (int v = 0; v < 4; ++v)
    for (int e = 0; e < 32; ++e) {
      const int l = e / 2, t = e % 2, row = kDpRow[v] + l + (l >= 8 ? 8 : 0);
      d.shuffle[v][2 * e] = static_cast<uint8_t>(8 * t + row / 8);
      d.shuffle[v][2 * e + 1] = 0x80;  // zero
      d.bit[v][e] = static_cast<uint16_t>(1u << (row % 8));
    }
  return d;
}
static const DpBits kDpBits = make_dp_bits();

// Scale and min of rows [n, n + 8) and [n + 16, n + 24) in group g (the dot-product lane order).
template <typename S>
static inline void load_scales_dp(const Args<S>& a, int64_t g, int64_t n, __m512& sc, __m512& mn) {
  if constexpr (kPairs<S>) {
    const S* p = pairs_at(a.scale, a.groups, a.np, a.blocked, g, n);  // rows n + 16.. 32 values on, both ways
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1);
    sc = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    mn = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sc, z);
  } else {
    const auto rows = [](const S* p) {
      if constexpr (std::is_same_v<S, float>) {
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + 16), 1);
      } else {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
      }
    };
    const S* p = planes_at(a.scale, a.groups, g, n);
    sc = rows(p), mn = rows(p + kScaleRows);
  }
}

template <int M, bool FIVE, typename S>
void block_dp(const Args<S>& a, const uint16_t* xb, int64_t blk, float* racc) {
  const uint8_t* wb = a.w + blk * a.kw * 32;
  const uint8_t* hbb = FIVE ? a.hb + blk * a.kw * 8 : nullptr;
  const int64_t n0 = blk * 64;
  // The low nibble shifted up to mantissa bit 3 (4-bit: 1 + q / 16) or 2 (5-bit: 1 + q / 32).
  constexpr int up = FIVE ? 2 : 3;
  constexpr float unit = FIVE ? 32.f : 16.f;
  const __m512i keep = _mm512_set1_epi16(FIVE ? 0x003C : 0x0078), one = _mm512_set1_epi16(0x3F80);
  __m512i shuffle[4], bit[4];
  if constexpr (FIVE)
    for (int v = 0; v < 4; ++v) shuffle[v] = _mm512_load_si512(kDpBits.shuffle[v]), bit[v] = _mm512_load_si512(kDpBits.bit[v]);
  __m512 r[M][4];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < 4; ++v) r[i][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    prefetch_scales(a, g + 2, n0);
    __m512 acc[M][4];
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
    const int64_t k0 = g * a.gs;
    const uint8_t* p = wb + k0 * 32;
    for (int64_t k = 0; k < a.gs; k += 2, p += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kAhead), _MM_HINT_T0);
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      const __m512i zu = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(b0, b1));
      const __m512i zv = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(b0, b1));
      __m512bh w[4];
      __m512i wi[4];
      wi[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(zu, up), keep, one, 0xEA);  // (a & b) | c
      wi[1] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(zv, up), keep, one, 0xEA);
      wi[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(zu, 4 - up), keep, one, 0xEA);
      wi[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(zv, 4 - up), keep, one, 0xEA);
      if constexpr (FIVE) {
        const __m512i hb = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hbb + (k0 + k) * 8)));
        for (int v = 0; v < 4; ++v) {
          const __mmask32 set = _mm512_test_epi16_mask(_mm512_shuffle_epi8(hb, shuffle[v]), bit[v]);
          wi[v] = _mm512_mask_add_epi16(wi[v], set, wi[v], _mm512_set1_epi16(0x0040));
        }
      }
      for (int v = 0; v < 4; ++v) w[v] = (__m512bh)wi[v];
      for (int i = 0; i < M; ++i) {
        int32_t pair;
        std::memcpy(&pair, xb + i * a.kw + k0 + k, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], w[v], xv);
      }
    }
    for (int v = 0; v < 4; ++v) {
      __m512 sc, mn;
      load_scales_dp(a, g, n0 + kDpRow[v], sc, mn);
      const __m512 s16 = _mm512_mul_ps(sc, _mm512_set1_ps(unit));
      mn = _mm512_sub_ps(mn, s16);
      for (int i = 0; i < M; ++i)
        r[i][v] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[i * a.groups + g]), _mm512_fmadd_ps(acc[i][v], s16, r[i][v]));
    }
  }
  alignas(64) float lanes[16];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < 4; ++v) {
      _mm512_store_ps(lanes, r[i][v]);
      for (int l = 0; l < 16; ++l) racc[i * 64 + kDpRow[v] + l + (l >= 8 ? 8 : 0)] = lanes[l];
    }
}
#endif

// Rows [0, M) of block blk: the bf16 dot-product path where it applies, else the float32 one.
template <int B, int M, bool FIVE, typename S, typename X>
static inline void rows_of_block(const Args<S>& a, const uint16_t* xb, int64_t blk, int64_t n, const X* bias, X* y,
                                 int64_t ys) {
#if defined(ORBITAL_INT8_DOT)
  if constexpr (B == 64) {
    if (a.xq != nullptr) {
      alignas(64) float racc[M * 64];
      const auto scales = [&a](int64_t g, int64_t row, __m512& sc, __m512& mn) {
        F16 s, m;
        load_scales(a, g, row, s, m);
        sc = s.v, mn = m.v;
      };
      block_int8<M, FIVE>(a.w, a.hb, a.kw, a.groups, a.gs, a.xq, a.xd, a.xd_qsum, blk, racc, scales);
      store_rows<B, M, X>(racc, blk, n, bias, y, ys);
      return;
    }
  }
#endif
#if defined(ORBITAL_SIMD16_AVX512) && defined(__AVX512BF16__)
  if constexpr (B == 64 && std::is_same_v<X, c10::BFloat16>) {
    if (xb != nullptr) {
      alignas(64) float racc[M * 64];
      block_dp<M, FIVE, S>(a, xb, blk, racc);
      store_rows<B, M, X>(racc, blk, n, bias, y, ys);
      return;
    }
  }
#endif
  block<B, M, FIVE, S, X>(a, blk, n, bias, y, ys);
}

// Input rows in chunks of kChunk (the registers hold that many rows' accumulators), per block: a
// block's bytes come from memory for the first chunk and from cache for the others. A row's
// result does not depend on its chunk or on how many rows share the call.
// Each thread streams its own run of blocks in order (the weight prefetch runs on into its next
// block), and one that finishes early takes blocks from the end of another's run (work_queue.h):
// when serving, the processes that stream tokens out preempt one OpenMP thread now and then, and
// with fixed shares the other then waited at the op's end for the preempted one's rest. Blocks
// handed out one at a time in turn (before) cost a one-row step ~10%: each thread's next block
// started cold.
struct NoState {};

template <int B, bool FIVE, typename S, typename X>
void run(const Args<S>& a, const uint16_t* xb, int64_t m, int64_t n, const X* bias, X* y, int64_t ys) {
  const int64_t blocks = (n + B - 1) / B;  // padding blocks past n are skipped
  parallel_runs<NoState>(blocks, [&](int64_t blk, NoState&) {
    for (int64_t i0 = 0; i0 < m; i0 += kChunk) {
      Args<S> c = a;
      c.xf += i0 * a.kw, c.xsum += i0 * a.groups;
      if (a.xq != nullptr) c.xq += i0 * a.kw, c.xd += i0 * a.groups, c.xd_qsum += i0 * a.groups;
      const uint16_t* cx = xb != nullptr ? xb + i0 * a.kw : nullptr;
      X* cy = y + i0 * ys;
      switch (std::min<int64_t>(kChunk, m - i0)) {
        case 1: rows_of_block<B, 1, FIVE, S, X>(c, cx, blk, n, bias, cy, ys); break;
        case 2: rows_of_block<B, 2, FIVE, S, X>(c, cx, blk, n, bias, cy, ys); break;
        case 3: rows_of_block<B, 3, FIVE, S, X>(c, cx, blk, n, bias, cy, ys); break;
        default: rows_of_block<B, 4, FIVE, S, X>(c, cx, blk, n, bias, cy, ys); break;
      }
    }
  });
}

// Sum of n floats in 8 lanes (vectorized), then the lanes pairwise.
static inline float group_sum(const float* v, int64_t n) {
  float s[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) s[l] += v[j + l];
  float t = 0.f;
  for (; j < n; ++j) t += v[j];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])) + t;
}

// Whether int8 activations (int4_int8_dot.h) run for this weight here: 64-row blocks, groups of 4k.
bool int8_dot_applies(int64_t block_rows, int64_t gs) {
#if defined(ORBITAL_INT8_DOT)
  return int8_dot_runs() && block_rows == 64 && gs % 4 == 0;
#else
  return false;
#endif
}

template <typename S, typename X>
bool dispatch(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, int64_t gs,
              int64_t block_rows, const std::optional<torch::Tensor>& bias, torch::Tensor& out, const uint8_t* hb,
              bool int8_x) {
  const int64_t m = x.size(0), k = x.size(1), kw = packed.size(1) * 2, groups = kw / gs, np = packed.size(0);
  if (int8_x && !int8_dot_applies(block_rows, gs)) return false;
  // x widened once (and repeated for a two-nibble weight), with its group sums. Plain loops the
  // compiler vectorizes: at 32 rows this ran per element with a modulo and took ~15% of the op.
  std::vector<float> xf(m * kw), xsum(m * groups);
  const X* xp = x.data_ptr<X>();
  for (int64_t i = 0; i < m; ++i) {
    const X* row = xp + i * x.stride(0);
    float* f = xf.data() + i * kw;
    for (int64_t j = 0; j < k; ++j) f[j] = static_cast<float>(row[j]);
    if (kw != k) std::memcpy(f + k, f, k * sizeof(float));
    if (!int8_x)  // the int8 path sums its rounded rows instead (quantize_rows)
      for (int64_t g = 0; g < groups; ++g) xsum[i * groups + g] = group_sum(f + g * gs, gs);
  }
  // bf16 x for the dot-product path (block_dp): the same values, paired along k.
  std::vector<uint16_t> xb;
#if defined(ORBITAL_SIMD16_AVX512) && defined(__AVX512BF16__)
  if (std::is_same_v<X, c10::BFloat16> && block_rows == 64 && gs % 2 == 0 && !int8_x) {
    xb.resize(m * kw);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < kw; c += k) std::memcpy(&xb[i * kw + c], xp + i * x.stride(0), k * sizeof(X));
  }
#endif
  const uint16_t* xbp = xb.empty() ? nullptr : xb.data();
  const S* sm = scale_min.data_ptr<S>();
  Args<S> a{xf.data(), xsum.data(), packed.data_ptr<uint8_t>(), sm, kw, groups, gs, np, hb, scale_min.dim() == 4};
#if defined(ORBITAL_INT8_DOT)
  Int8Rows xi;
  if (int8_x) {
    quantize_rows(xf.data(), m, kw, gs, xi);
    a.xq = xi.q.data(), a.xd = xi.d.data(), a.xd_qsum = xi.d_qsum.data();
  }
#endif
  const X* bp = bias ? bias->data_ptr<X>() : nullptr;
  X* y = out.data_ptr<X>();
  const int64_t n = out.size(1), ys = out.stride(0);
  if (block_rows == 64) {
    hb ? run<64, true, S, X>(a, xbp, m, n, bp, y, ys) : run<64, false, S, X>(a, xbp, m, n, bp, y, ys);
  } else {
    hb ? run<32, true, S, X>(a, xbp, m, n, bp, y, ys) : run<32, false, S, X>(a, xbp, m, n, bp, y, ys);
  }
  return true;
}

bool is_f32_or_bf16(const torch::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

}  // namespace
#endif

// x [m, k] (float32 or bfloat16, rows contiguous); packed uint8 [np, kw / 2] in the int4pack layout
// with `block_rows` (64 or 32) rows per block, kw = k, or 2k for a two-nibble weight (x is read
// twice over); scale_min [np / 64, kw / group_size, 2, 64] (scale, min of 64 rows; float32 or
// float16: w = q * s + min)
// or PyTorch's kernel's bfloat16 [kw / group_size, np, 2] (scale, zero: w = (q - 8) * s + zero), or the
// same pairs blocked by 64 rows [np / 64, kw / group_size, 64, 2] (int4_scales.h pairs_at);
// bias [n] in x's dtype or None; out [m, n] in x's dtype, n <= np; hi_bits: a 5-bit weight's high
// bits, uint8 [np / block_rows, k, block_rows / 8] (kw = k), or None; int8_x: x rounded to int8 per
// group for integer dot products (int4_int8_dot.h; false where they do not run: int8_dot_products).
// False (nothing written) where it does not apply.
bool int4_small_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_min, int64_t group_size,
                       int64_t block_rows, std::optional<torch::Tensor> bias, torch::Tensor out,
                       std::optional<torch::Tensor> hi_bits, bool int8_x) {
#if defined(ORBITAL_SIMD16)
  if (!x.device().is_cpu() || x.dim() != 2 || packed.dim() != 2 || out.dim() != 2) return false;
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0), kw = packed.size(1) * 2, n = out.size(1);
  if (m < 1 || m > kMaxRows || !is_f32_or_bf16(x) || x.stride(1) != 1 || packed.scalar_type() != at::kByte ||
      !packed.is_contiguous() || (block_rows != 64 && block_rows != 32) || np % block_rows || (kw != k && kw != 2 * k) ||
      group_size < 1 || kw % group_size)
    return false;
  const auto st = scale_min.scalar_type();
  const bool pairs = st == at::kBFloat16;
  const std::vector<int64_t> want = !pairs ? std::vector<int64_t>{np / kScaleRows, kw / group_size, 2, kScaleRows}
                                    : scale_min.dim() == 4 ? std::vector<int64_t>{np / kScaleRows, kw / group_size, kScaleRows, 2}
                                                           : std::vector<int64_t>{kw / group_size, np, 2};
  if (np % kScaleRows && (!pairs || scale_min.dim() == 4)) return false;
  if (scale_min.sizes() != at::IntArrayRef(want) || !scale_min.is_contiguous() ||
      (st != at::kFloat && st != at::kHalf && !pairs))
    return false;
  if (out.size(0) != m || n > np || out.stride(1) != 1 || out.scalar_type() != x.scalar_type()) return false;
  if (bias && (!bias->is_contiguous() || bias->numel() != n || bias->scalar_type() != x.scalar_type())) return false;
  if (hi_bits && !valid_hi_bits(*hi_bits, np, kw, k, block_rows)) return false;
  const uint8_t* hb = hi_bits ? hi_bits->data_ptr<uint8_t>() : nullptr;
  const auto with_x = [&](auto xt) {
    using X = decltype(xt);
    if (pairs) return dispatch<c10::BFloat16, X>(x, packed, scale_min, group_size, block_rows, bias, out, hb, int8_x);
    if (st == at::kHalf) return dispatch<at::Half, X>(x, packed, scale_min, group_size, block_rows, bias, out, hb, int8_x);
    return dispatch<float, X>(x, packed, scale_min, group_size, block_rows, bias, out, hb, int8_x);
  };
  return x.scalar_type() == at::kFloat ? with_x(float{}) : with_x(c10::BFloat16{});
#else
  return false;
#endif
}

// Whether int8_x runs on this CPU with this build (64-row blocks, groups of a multiple of 4 inputs).
bool int8_dot_products() {
#if defined(ORBITAL_INT8_DOT)
  return int8_dot_runs();
#else
  return false;
#endif
}
