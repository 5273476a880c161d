// Causal prefill attention over the paged cache, for every prompt chunk of a step in one call.
// PyTorch's CPU flash kernel ran a step's prompt chunks (~300 tokens each, head_dim 64, GQA 3)
// at ~55 GFLOP/s, a third of a bf16 prefill step. Here each chunk's K and V are first packed
// from their cache blocks into 32-bit units (bf16: pairs, for VDPBF16PS; float32: single values
// for FMA), then each work item (chunk, KV head, 16 query positions x G heads) computes its full
// score rows, an exact softmax, and P.V, with every inner loop 16 lanes wide.
// Keys come from the cache (written before this runs), so chunks with cached context and plain
// prompts take the same path. Without AVX512-BF16, bf16 K/V are widened to float32 as they are
// packed and the products run in float32. Returns false where it does not apply (no AVX-512 or
// AVX2, head_dim not a multiple of 32, other dtypes): the caller then uses PyTorch's.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "kv_int8.h"
#include "simd16.h"
#include "work_queue.h"

#if defined(ORBITAL_SIMD16)
namespace prefill {

using simd::F16;

constexpr int kTile = 16;  // keys per score vector, query positions per work item

template <typename T>
static inline uint16_t raw(T x) { uint16_t u; std::memcpy(&u, &x, 2); return u; }

// How a dtype maps to 32-bit units: bf16 packs 2 values per unit where VDPBF16PS exists, float
// one (FMA); bf16 without it is widened to one float per unit.
template <typename T>
struct Unit;
template <>
struct Unit<float> {
  static constexpr int kPer = 1;
  static inline F16 madd(F16 acc, F16 a, F16 b) { return simd::fmadd(a, b, acc); }
  static inline uint32_t bits(const float* p) { uint32_t u; std::memcpy(&u, p, 4); return u; }
};
#if defined(__AVX512BF16__)
template <>
struct Unit<c10::BFloat16> {
  static constexpr int kPer = 2;
  static inline F16 madd(F16 acc, F16 a, F16 b) { return {_mm512_dpbf16_ps(acc.v, (__m512bh)a.v, (__m512bh)b.v)}; }
  static inline uint32_t bits(const c10::BFloat16* p) { uint32_t u; std::memcpy(&u, p, 4); return u; }
};
#else
template <>
struct Unit<c10::BFloat16> {
  static constexpr int kPer = 1;
  static inline F16 madd(F16 acc, F16 a, F16 b) { return simd::fmadd(a, b, acc); }
  static inline uint32_t bits(const c10::BFloat16* p) { return static_cast<uint32_t>(raw(*p)) << 16; }
};
#endif

// P values (float) -> the units P.V multiplies: bf16 pairs (round to nearest even) or floats.
template <typename T>
static inline void to_units(const float* p, uint32_t* dst, int64_t keys);
template <>
inline void to_units<float>(const float* p, uint32_t* dst, int64_t keys) { std::memcpy(dst, p, keys * 4); }
template <>
inline void to_units<c10::BFloat16>(const float* p, uint32_t* dst, int64_t keys) {
  if constexpr (Unit<c10::BFloat16>::kPer == 1) {  // widened: P stays float32
    std::memcpy(dst, p, keys * 4);
    return;
  }
  int64_t j = 0;
#if defined(__AVX512BF16__)
  for (; j + 32 <= keys; j += 32)
    _mm512_storeu_si512(dst + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + j + 16), _mm512_loadu_ps(p + j)));
#endif
  for (; j < keys; j += 2) {
    const uint32_t lo = raw(c10::BFloat16(p[j])), hi = j + 1 < keys ? raw(c10::BFloat16(p[j + 1])) : 0u;
    dst[j / 2] = lo | (hi << 16);
  }
}


struct Chunk {
  int64_t start, num_new, num_context;  // rows in q/out; query tokens; cached tokens before them
  const int32_t* blocks;
  int64_t keys() const { return num_context + num_new; }
  int64_t padded() const { return (keys() + kTile - 1) / kTile * kTile; }
};

// An int8 cache row (kv_int8.h) as D values of T, as dequantize_rows gives them.
template <int D, typename T>
static inline void dequant_row(const int8_t* r, T* dst) {
  const float s = kvi8::row_scale(r, D);
  for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(static_cast<float>(r[d]) * s);
}

// Pack keys [0, keys) of one (chunk, head): K as [key tile][D/kPer units][16 keys], V as
// [key unit][D] where a unit holds kPer consecutive keys' values of one dimension. C: the
// cache's element type, T or int8_t (rows dequantized to T as they are packed).
template <int D, typename T, typename C>
static void pack(const Chunk& c, const C* kh, const C* vh, int64_t bs, uint32_t* kp, uint32_t* vp) {
  constexpr int P = Unit<T>::kPer, U = D / P;
  constexpr bool kI8 = std::is_same_v<C, int8_t>;
  constexpr int64_t RS = kI8 ? D + kvi8::kScaleBytes : D;
  const int64_t n = c.keys(), np = c.padded();
  std::memset(kp, 0, np * U * 4);
  std::memset(vp, 0, np / P * D * 4);
  T kbuf[D], vbuf[D];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = (static_cast<int64_t>(c.blocks[j / bs]) * bs + j % bs) * RS;
    const T* kr;
    const T* vr;
    if constexpr (kI8) {
      dequant_row<D, T>(kh + row, kbuf);
      dequant_row<D, T>(vh + row, vbuf);
      kr = kbuf;
      vr = vbuf;
    } else {
      kr = kh + row;
      vr = vh + row;
    }
    uint32_t* kt = kp + (j / kTile) * U * kTile + j % kTile;
    for (int u = 0; u < U; ++u) kt[u * kTile] = Unit<T>::bits(kr + u * P);
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(vp + j * D, vr, D * 4);
    } else if constexpr (P == 1) {
      for (int d = 0; d < D; ++d) vp[j * D + d] = Unit<T>::bits(vr + d);
    } else {
      uint16_t* vu = reinterpret_cast<uint16_t*>(vp + (j / 2) * D) + (j % 2);
      for (int d = 0; d < D; ++d) vu[2 * d] = raw(vr[d]);
    }
  }
}

// One work item: query positions [p0, p0 + 16) of chunk c, the G heads of KV head h.
template <int D, typename T>
static void item(const Chunk& c, int64_t h, int64_t p0, int64_t g, int64_t hq, const T* q, T* out,
                 const uint32_t* kp, const uint32_t* vp, float scale, std::vector<float>& sbuf,
                 std::vector<uint32_t>& pbuf, std::vector<float>& inv) {
  constexpr int P = Unit<T>::kPer, U = D / P, NV = D / 16;
  const int64_t npos = std::min<int64_t>(kTile, c.num_new - p0);
  const int64_t rows = npos * g;
  // Keys this item can see: up to the last query position (causal), padded to a tile.
  const int64_t kmax = c.num_context + p0 + npos;
  const int64_t kpad = (kmax + kTile - 1) / kTile * kTile;
  sbuf.resize(rows * kpad);
  pbuf.resize(rows * (kpad / P));
  inv.resize(rows);
  // Query units of each row, r = i * g + gi, with position c.num_context + p0 + i.
  alignas(64) uint32_t qu[kTile * 16][U];
  for (int64_t i = 0; i < npos; ++i)
    for (int64_t gi = 0; gi < g; ++gi) {
      const T* qr = q + ((c.start + p0 + i) * hq + h * g + gi) * D;
      for (int u = 0; u < U; ++u) qu[i * g + gi][u] = Unit<T>::bits(qr + u * P);
    }
  // 1. Scores, 4 rows at a time (independent accumulator chains), one key tile per vector.
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int64_t nr = std::min<int64_t>(4, rows - r0);
    for (int64_t t = 0; t < kpad / kTile; ++t) {
      const uint32_t* kt = kp + t * U * kTile;
      F16 a0 = simd::zero(), a1 = a0, a2 = a0, a3 = a0;
      for (int u = 0; u < U; ++u) {
        const F16 kv = simd::load(kt + u * kTile);
        a0 = Unit<T>::madd(a0, simd::set1_bits(qu[r0][u]), kv);
        if (nr > 1) a1 = Unit<T>::madd(a1, simd::set1_bits(qu[r0 + 1][u]), kv);
        if (nr > 2) a2 = Unit<T>::madd(a2, simd::set1_bits(qu[r0 + 2][u]), kv);
        if (nr > 3) a3 = Unit<T>::madd(a3, simd::set1_bits(qu[r0 + 3][u]), kv);
      }
      const F16 sc = simd::set1(scale);
      simd::storeu(&sbuf[(r0 + 0) * kpad + t * kTile], simd::mul(a0, sc));
      if (nr > 1) simd::storeu(&sbuf[(r0 + 1) * kpad + t * kTile], simd::mul(a1, sc));
      if (nr > 2) simd::storeu(&sbuf[(r0 + 2) * kpad + t * kTile], simd::mul(a2, sc));
      if (nr > 3) simd::storeu(&sbuf[(r0 + 3) * kpad + t * kTile], simd::mul(a3, sc));
    }
  }
  // 2. Exact softmax per row over keys [0, limit]; masked keys get P = 0 (no infinities:
  // the ops are built with -ffast-math).
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t limit = c.num_context + p0 + r / g;  // last key this row attends to
    const int64_t nt = limit / kTile + 1;
    auto live = [&](int64_t t) { return simd::lanes_upto(t * kTile, limit); };  // keys at or before the limit
    float* s = &sbuf[r * kpad];
    F16 mx = simd::set1(-3.0e38f);
    for (int64_t t = 0; t < nt; ++t) mx = simd::select(live(t), simd::max(mx, simd::loadu(s + t * kTile)), mx);
    const F16 m = simd::set1(simd::reduce_max(mx));
    F16 sum = simd::zero();
    for (int64_t t = 0; t < kpad / kTile; ++t) {
      const F16 p = simd::maskz(t < nt ? live(t) : simd::none(), simd::exp(simd::sub(simd::loadu(s + t * kTile), m)));
      sum = simd::add(sum, p);
      simd::storeu(s + t * kTile, p);
    }
    inv[r] = 1.f / simd::reduce_add(sum);
    to_units<T>(s, &pbuf[r * (kpad / P)], kpad);
  }
  // 3. O = P.V, rows in groups so the accumulators stay in registers.
  constexpr int RG = std::clamp((simd::kRegs - NV - 1) / NV, 1, 4);
  for (int64_t r0 = 0; r0 < rows; r0 += RG) {
    const int64_t nr = std::min<int64_t>(RG, rows - r0);
    const int64_t limit = c.num_context + p0 + (r0 + nr - 1) / g;
    const int64_t units = (limit + 1 + P - 1) / P;
    F16 acc[RG][NV];
    for (int i = 0; i < RG; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = simd::zero();
    for (int64_t u = 0; u < units; ++u) {
      const uint32_t* vr = vp + u * D;
      F16 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = simd::loadu(vr + 16 * j);
      for (int i = 0; i < RG; ++i) {
        if (i >= nr) break;
        const F16 pb = simd::set1_bits(pbuf[(r0 + i) * (kpad / P) + u]);
        for (int j = 0; j < NV; ++j) acc[i][j] = Unit<T>::madd(acc[i][j], pb, vv[j]);
      }
    }
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t r = r0 + i, pos = r / g, gi = r % g;
      T* o = out + ((c.start + p0 + pos) * hq + h * g + gi) * D;
      alignas(64) float tmp[D];
      for (int j = 0; j < NV; ++j) simd::store(tmp + 16 * j, simd::mul(acc[i][j], simd::set1(inv[r])));
      for (int d = 0; d < D; ++d) o[d] = static_cast<T>(tmp[d]);
    }
  }
}

template <int D, typename T, typename C>
static void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& info, double scale, torch::Tensor& out) {
  const int64_t hq = q.size(1), hkv = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2);
  const int64_t rs = k_cache.size(3);
  const int64_t g = hq / hkv, nc = info.size(0), maxb = block_tables.size(1);
  constexpr int P = Unit<T>::kPer;
  const int32_t* inf = info.data_ptr<int32_t>();
  std::vector<Chunk> chunks(nc);
  std::vector<int64_t> koff(nc + 1, 0), voff(nc + 1, 0);  // packed offsets per chunk (per head)
  for (int64_t i = 0; i < nc; ++i) {
    chunks[i] = Chunk{inf[3 * i], inf[3 * i + 1], inf[3 * i + 2], block_tables.data_ptr<int32_t>() + i * maxb};
    koff[i + 1] = koff[i] + chunks[i].padded() * (D / P);
    voff[i + 1] = voff[i] + chunks[i].padded() / P * D;
  }
  // 64-byte aligned scratch: K tiles are read with aligned loads.
  auto kbuf = torch::empty({hkv * koff[nc] + 16}, torch::dtype(torch::kInt32));
  auto vbuf = torch::empty({hkv * voff[nc] + 16}, torch::dtype(torch::kInt32));
  uint32_t* kp = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(kbuf.data_ptr<int32_t>()) + 63) & ~uintptr_t(63));
  uint32_t* vp = reinterpret_cast<uint32_t*>(vbuf.data_ptr<int32_t>());
  const C* kc = k_cache.data_ptr<C>();
  const C* vc = v_cache.data_ptr<C>();
  at::parallel_for(0, nc * hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const int64_t i = w / hkv, h = w % hkv;
      pack<D, T, C>(chunks[i], kc + h * nb * bs * rs, vc + h * nb * bs * rs, bs, kp + h * koff[nc] + koff[i],
                    vp + h * voff[nc] + voff[i]);
    }
  });
  // Work items, costliest first (later positions see more keys), handed out dynamically.
  struct Item { int64_t chunk, head, p0; };
  std::vector<Item> items;
  for (int64_t i = 0; i < nc; ++i)
    for (int64_t p0 = 0; p0 < chunks[i].num_new; p0 += kTile)
      for (int64_t h = 0; h < hkv; ++h) items.push_back({i, h, p0});
  const std::vector<int64_t> order = costliest_first(
      static_cast<int64_t>(items.size()), [&](int64_t w) { return chunks[items[w].chunk].num_context + items[w].p0; });
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  struct Scratch { std::vector<float> s; std::vector<uint32_t> p; std::vector<float> inv; };
  parallel_dynamic<Scratch>(static_cast<int64_t>(items.size()), [&](int64_t w, Scratch& sc) {
    const Item& it = items[order[w]];
    item<D, T>(chunks[it.chunk], it.head, it.p0, g, hq, qp, op, kp + it.head * koff[nc] + koff[it.chunk],
               vp + it.head * voff[nc] + voff[it.chunk], static_cast<float>(scale), sc.s, sc.p, sc.inv);
  });
}

template <typename T, typename C>
static bool dispatch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& block_tables, const torch::Tensor& info, double scale, torch::Tensor& out) {
  if (q.size(1) / k_cache.size(0) > 16) return false;  // qu[] holds 16 positions x 16 heads
  switch (q.size(2)) {
    case 32: run<32, T, C>(q, k_cache, v_cache, block_tables, info, scale, out); return true;
    case 64: run<64, T, C>(q, k_cache, v_cache, block_tables, info, scale, out); return true;
    case 96: run<96, T, C>(q, k_cache, v_cache, block_tables, info, scale, out); return true;
    case 128: run<128, T, C>(q, k_cache, v_cache, block_tables, info, scale, out); return true;
    default: return false;
  }
}

}  // namespace prefill
#endif

// q/out [T, Hq, D] (rows of the step; each chunk's rows are contiguous); k_cache/v_cache
// [Hkv, num_blocks, block_size, D] holding every chunk's keys (context and new), in q's dtype
// or int8 with rows of D + 2 (kv_int8.h);
// block_tables [C, max_blocks] int32; info [C, 3] int32 = (first row, new tokens, cached tokens).
// Writes the chunks' rows of out; false (nothing written) where this path does not apply.
bool prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                       torch::Tensor info, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && out.sizes() == q.sizes(), "bad shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && info.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(info.dim() == 2 && info.size(1) == 3 && block_tables.size(0) == info.size(0), "info is [C, 3]");
#if defined(ORBITAL_SIMD16)
  if (!q.is_contiguous() || !out.is_contiguous() || !k_cache.is_contiguous() || !v_cache.is_contiguous() ||
      !block_tables.is_contiguous() || !info.is_contiguous() || out.scalar_type() != q.scalar_type())
    return false;
  if (k_cache.scalar_type() == at::kChar) {
    if (k_cache.size(3) != q.size(2) + kvi8::kScaleBytes) return false;
    if (q.scalar_type() == at::kFloat)
      return prefill::dispatch<float, int8_t>(q, k_cache, v_cache, block_tables, info, scale, out);
    if (q.scalar_type() == at::kBFloat16)
      return prefill::dispatch<c10::BFloat16, int8_t>(q, k_cache, v_cache, block_tables, info, scale, out);
    return false;
  }
  if (q.scalar_type() != k_cache.scalar_type()) return false;
  if (q.scalar_type() == at::kFloat)
    return prefill::dispatch<float, float>(q, k_cache, v_cache, block_tables, info, scale, out);
  if (q.scalar_type() == at::kBFloat16)
    return prefill::dispatch<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_tables, info, scale, out);
#endif
  return false;
}
