// The clipping kernels' chunk bodies: a chunk's norm partial (Note [norm piece]), its scaling by a coefficient and
// its clamping with a count of the changed values, written once over B-byte vectors and compiled per ISA into the
// entry points of cpu/clip_chunk_{default,avx2,avx512}.cpp (Note [cpu dispatch]); cpu/clip_cpu.cpp walks the
// pieces of a tensor list (Note [cpu tensor lists]) and picks the table at run time.
// Across levels: the inf-norm, max |x|, the NaN / Inf flags, the clamped values and the counts are the same bits, and
// so are the scaled values for the same coefficient; the 1- and 2-norms' sums differ in rounding only (the lanes
// they are summed in, and the fused multiply-adds of the wide levels, depend on the vector width).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../core/norm_ops.h"
#include "cpu_common.h"
#include "simd.h"

namespace hookstats {
namespace clip_cpu {

constexpr int64_t kChunk = 4096;  // values a norm chunk reads (<= kMaxFastPiece)
constexpr int64_t kNormBlock = 512;
static_assert(kChunk <= kMaxFastPiece, "a fast norm piece must stay within NormLimits");

// ---------------------------------------------------------------------------------------
// Norms. The fast path of core/norm_ops.h in SIMD lanes, two interleaved sets, the values scaled
// by 2^-e first when SCALED (Note [norm scaling]); max |x| is of the unscaled values.
template <int B, int KIND, typename scalar_t, bool SCALED>
HS_INLINE FastNorm<acc_of<scalar_t>> fast_norm_simd(const scalar_t* p, int64_t n, acc_of<scalar_t> sc) {
  HS_LANE_TYPES(scalar_t, B);
  const V vsc = V{} + sc;
  V m0{}, m1{};
  auto step = [&](V& s, V& m, const V& v) {
    const V a = simd::abs_bits<V, M>(v);
    if (KIND == kNorm1) s += SCALED ? a * vsc : a;
    if (KIND == kNorm2) {
      if constexpr (SCALED) {
        const V y = v * vsc;
        s += y * y;
      } else {
        s += v * v;
      }
    }
    // max |x| of the non-NaN values (one vmaxps): for p = inf a NaN shows in s, which then refuses the fast result
    // (fast_norm_trusted), so the NaN-sticky select of fast_norm_add is not needed in the lanes (at 64 bytes GCC 12
    // builds that select lane by lane).
    m = simd::max_of<B>(a, m);
    if (KIND == kNormInf) s += v - v;
  };
  FastNorm<acc_t> f;
  fast_norm_init(f);
  // The sum lanes restart every kNormBlock values (as in cpu/stats_chunk.h): a constant tensor's l1 then stays
  // within ~1e-7 instead of drifting to ~3e-6 over a chunk. Each block's lane sums are added to double lanes, reduced
  // once at the end of the chunk (a scalar reduction per block, a chain of W dependent adds, cost AVX-512 its lead).
  using DV = typename simd::F64Lanes<W>::type;
  DV ds{};
  int64_t i = 0;
  const int64_t n_vec = n - n % W;
  while (i < n_vec) {
    V s0{}, s1{};
    const int64_t end = std::min(n_vec, i + kNormBlock);
    for (; i + 2 * W <= end; i += 2 * W) {
      step(s0, m0, L::load(p + i));
      step(s1, m1, L::load(p + i + W));
    }
    if (i + W <= end) {
      step(s0, m0, L::load(p + i));
      i += W;
    }
    ds += __builtin_convertvector(s0 + s1, DV);
  }
  f.s = static_cast<acc_t>(simd::sum_lanes(ds));
  f.amax = simd::max_lanes(simd::max_of<B>(m0, m1));  // no NaN in the lanes; f.amax was 0
  for (; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(p[i]);
    if (SCALED && KIND != kNormInf) fast_norm_add_scaled<KIND, acc_t>(f, v, sc);
    else fast_norm_add<KIND, acc_t>(f, v);
  }
  return f;
}

// NaN / Inf flags of a piece by vector compares.
template <int B, typename scalar_t>
HS_INLINE int32_t nonfinite_flags_simd(const scalar_t* p, int64_t n) {
  HS_LANE_TYPES(scalar_t, B);
  const V inf = V{} + static_cast<acc_t>(INFINITY);
  M nan{}, isinf{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const V v = L::load(p + i);
    nan |= (v != v);
    isinf |= (simd::abs_bits<V, M>(v) == inf);
  }
  int32_t flags = (simd::any_lane(nan) ? kNormHasNan : 0) | (simd::any_lane(isinf) ? kNormHasInf : 0);
  for (; i < n; ++i) flags |= nonfinite_norm_flag<acc_t>(static_cast<acc_t>(p[i]));
  return flags;
}

template <typename scalar_t>
NormPartial careful_norm_chunk(const scalar_t* p, int64_t n, const NormSpec& ns) {
  CarefulNorm c = careful_norm_init();
  for (int64_t j = 0; j < n; ++j) careful_norm_scan(c, static_cast<double>(p[j]));
  const int32_t e = careful_norm_exponent(c, ns);
  double s = 0.0;
  if (ns.kind != kNormInf && !(c.flags & kNormHasNan)) {
    for (int64_t j = 0; j < n; ++j) s += careful_norm_term(static_cast<double>(p[j]), e, ns);
  }
  return careful_norm_partial(c, s, e, ns);
}

template <int B, int KIND, typename scalar_t>
HS_INLINE FastNorm<acc_of<scalar_t>> fast_norm_scaled(const scalar_t* p, int64_t n, int32_t e) {
  using acc_t = acc_of<scalar_t>;
  if (e == 0) return fast_norm_simd<B, KIND, scalar_t, false>(p, n, acc_t(1));
  return fast_norm_simd<B, KIND, scalar_t, true>(p, n, static_cast<acc_t>(ldexp(1.0, -e)));
}

// A chunk as Note [norm piece] reads it: SIMD passes over p[0, n).
template <int B, int KIND, typename scalar_t>
struct SimdNormReader {
  const scalar_t* p;
  int64_t n;
  HS_INLINE FastNorm<acc_of<scalar_t>> fast(int32_t e) const {
    if (KIND == kNormInf) return fast_norm_simd<B, kNormInf, scalar_t, false>(p, n, acc_of<scalar_t>(1));
    return fast_norm_scaled<B, KIND, scalar_t>(p, n, e);
  }
  HS_INLINE int32_t flags() const { return nonfinite_flags_simd<B, scalar_t>(p, n); }
};

// One chunk; `e` and `flags_seen` are the state of the piece so far (Note [norm scaling]).
template <int B, typename scalar_t>
HS_INLINE NormPartial norm_chunk_body(const scalar_t* p, int64_t n, const NormSpec& ns, int32_t& e,
                                      int32_t flags_seen) {
  using acc_t = acc_of<scalar_t>;
  if (ns.kind == kNormP) return careful_norm_chunk(p, n, ns);
  if (flags_seen & kNormHasInf) {  // the norm is inf unless a NaN follows
    NormPartial r = empty_norm();
    r.flags = nonfinite_flags_simd<B, scalar_t>(p, n);
    return r;
  }
  switch (ns.kind) {
    case kNorm2: return fast_norm_piece<acc_t>(SimdNormReader<B, kNorm2, scalar_t>{p, n}, kNorm2, e);
    case kNorm1: return fast_norm_piece<acc_t>(SimdNormReader<B, kNorm1, scalar_t>{p, n}, kNorm1, e);
    default: return fast_norm_piece<acc_t>(SimdNormReader<B, kNormInf, scalar_t>{p, n}, kNormInf, e);
  }
}

// ---------------------------------------------------------------------------------------
// Scaling in place by a coefficient (or to zero).
template <int B, typename scalar_t>
HS_INLINE void scale_chunk_body(scalar_t* p, int64_t n, acc_of<scalar_t> coef, bool zero) {
  HS_LANE_TYPES(scalar_t, B);
  int64_t i = 0;
  if (zero) {
    std::fill(p, p + n, static_cast<scalar_t>(0));
    return;
  }
  const V c = V{} + coef;
  for (; i + W <= n; i += W) L::store(p + i, L::load(p + i) * c);
  for (; i < n; ++i) p[i] = static_cast<scalar_t>(static_cast<acc_t>(p[i]) * coef);
}

// ---------------------------------------------------------------------------------------
// Clamping in place with a count of the changed elements. Only the clipped lanes are stored to, with lo's or hi's bits:
// AVX-512 by masked stores; the narrower levels write a vector with a clipped lane back whole, its other lanes' bits
// unchanged (bit operations on the stored form: 16-bit values are not converted back, NaN payloads kept). Lane by lane,
// a vector with a clipped lane (~10-18% of them at 1.2% clipped) cost W lane extractions (AVX2: 9.4 -> 6.9 ms at
// 2^24 fp32).
// W lanes holding x's bits (V{} + x would make -0.0 a +0.0: a bound of -0.0 is stored as -0.0, as clamp_ does).
template <typename M, typename scalar_t>
HS_INLINE M splat_bits(scalar_t x) {
  std::remove_reference_t<decltype(M{}[0])> b;
  static_assert(sizeof(b) == sizeof(x), "integer lanes of the value's width");
  std::memcpy(&b, &x, sizeof b);
  return M{} + b;
}

template <int B, typename scalar_t>
HS_INLINE void store_clamped(scalar_t* p, const typename LanesOf<scalar_t, B>::M& below,
                             const typename LanesOf<scalar_t, B>::M& above, scalar_t lo_t, scalar_t hi_t) {
  using M = typename LanesOf<scalar_t, B>::M;
  if constexpr (sizeof(scalar_t) == 2) {
    using H = typename simd::VT<B>::u16;  // the stored bits of the W lanes
    const H b = __builtin_convertvector(below, H), a = __builtin_convertvector(above, H);
    uint16_t lo_bits, hi_bits;
    std::memcpy(&lo_bits, &lo_t, 2);
    std::memcpy(&hi_bits, &hi_t, 2);
    H h;
    std::memcpy(&h, p, sizeof h);
    const H want = ((H{} + lo_bits) & b) | ((H{} + hi_bits) & a);
    h ^= (h ^ want) & (b | a);
    std::memcpy(p, &h, sizeof h);
  } else {
    M h;
    std::memcpy(&h, p, sizeof h);
    const M want = (splat_bits<M>(lo_t) & below) | (splat_bits<M>(hi_t) & above);
    h ^= (h ^ want) & (below | above);
    std::memcpy(p, &h, sizeof h);
  }
}

template <int B, typename scalar_t>
HS_INLINE int64_t clamp_chunk_body(scalar_t* p, int64_t n, scalar_t lo_t, scalar_t hi_t) {
  HS_LANE_TYPES(scalar_t, B);
  const acc_t lo = static_cast<acc_t>(lo_t), hi = static_cast<acc_t>(hi_t);
  const V vlo = V{} + lo, vhi = V{} + hi;
  int64_t count = 0;
  int64_t i = 0;
#if HS_X86_BUILTINS
  // AVX-512: the compares into mask registers and masked stores of lo and hi (GCC 12 builds a 64-byte compare whose
  // -1 / 0 lanes are kept in a variable lane by lane, which made this level 4-6x slower than AVX2's).
  if constexpr (B == 64) {
    for (; i + W <= n; i += W) {
      const V v = L::load(p + i);
      if constexpr (sizeof(acc_t) == 4) {
        const uint16_t kb = __builtin_ia32_cmpps512_mask(v, vlo, 0x11, 0xFFFF, 4);  // _CMP_LT_OQ
        const uint16_t ka = __builtin_ia32_cmpps512_mask(v, vhi, 0x1e, 0xFFFF, 4);  // _CMP_GT_OQ
        if ((kb | ka) == 0) continue;
        count += __builtin_popcount(kb | ka);
        if constexpr (sizeof(scalar_t) == 2) {
          typedef short v16hi __attribute__((vector_size(32)));
          uint16_t lo_bits, hi_bits;
          std::memcpy(&lo_bits, &lo_t, 2);
          std::memcpy(&hi_bits, &hi_t, 2);
          __builtin_ia32_storedquhi256_mask(reinterpret_cast<short*>(p + i), v16hi{} + (short)lo_bits, kb);
          __builtin_ia32_storedquhi256_mask(reinterpret_cast<short*>(p + i), v16hi{} + (short)hi_bits, ka);
        } else {
          __builtin_ia32_storeups512_mask(reinterpret_cast<float*>(p + i), (V)splat_bits<M>(lo_t), kb);
          __builtin_ia32_storeups512_mask(reinterpret_cast<float*>(p + i), (V)splat_bits<M>(hi_t), ka);
        }
      } else {
        const uint8_t kb = __builtin_ia32_cmppd512_mask(v, vlo, 0x11, 0xFF, 4);
        const uint8_t ka = __builtin_ia32_cmppd512_mask(v, vhi, 0x1e, 0xFF, 4);
        if ((kb | ka) == 0) continue;
        count += __builtin_popcount(kb | ka);
        __builtin_ia32_storeupd512_mask(reinterpret_cast<double*>(p + i), (V)splat_bits<M>(lo_t), kb);
        __builtin_ia32_storeupd512_mask(reinterpret_cast<double*>(p + i), (V)splat_bits<M>(hi_t), ka);
      }
    }
  } else
#endif
  {
    M cnt{};
    for (; i + W <= n; i += W) {
      const V v = L::load(p + i);
      const M below = (M)(v < vlo), above = (M)(v > vhi);
      const M m = below | above;
      if (simd::any_lane_of<B>(m)) {
        cnt -= m;
        store_clamped<B, scalar_t>(p + i, below, above, lo_t, hi_t);
      }
    }
    for (int j = 0; j < W; ++j) count += cnt[j];
  }
  for (; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(p[i]);
    if (is_clipped(v, lo, hi)) {
      p[i] = v < lo ? lo_t : hi_t;
      ++count;
    }
  }
  return count;
}

// The chunk entry points of one ISA (Note [cpu dispatch]). norm: the partial of p[0, n) given the piece's scale
// exponent so far (in and out) and its flags so far; scale: p[0, n) *= coef (or = 0); clamp: p[0, n) clamped to
// [lo, hi], returning how many values changed.
template <typename scalar_t>
struct ClipFns {
  NormPartial (*norm)(const scalar_t*, int64_t, const NormSpec&, int32_t&, int32_t);
  void (*scale)(scalar_t*, int64_t, acc_of<scalar_t>, bool);
  int64_t (*clamp)(scalar_t*, int64_t, scalar_t, scalar_t);
};
struct ClipTable {
  ClipFns<float> f32;
  ClipFns<double> f64;
  ClipFns<c10::Half> f16;
  ClipFns<c10::BFloat16> bf16;
};

template <typename scalar_t>
HS_INLINE const ClipFns<scalar_t>& table_entry(const ClipTable& t) {
  if constexpr (std::is_same_v<scalar_t, double>) return t.f64;
  else if constexpr (std::is_same_v<scalar_t, c10::Half>) return t.f16;
  else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return t.bf16;
  else return t.f32;
}

// Each defined in its own unit, compiled for its ISA (the wider ones alias the baseline off x86).
extern const ClipTable kClipDefault;
extern const ClipTable kClipAvx2;
extern const ClipTable kClipAvx512;

// HS_CLIP_TABLE(name, B, TARGET): the table of one ISA, its entry points the chunk bodies at B bytes, marked TARGET.
#define HS_CLIP_TABLE(NAME, B, TARGET)                                                                          \
  namespace {                                                                                                 \
  template <typename scalar_t>                                                                                \
  TARGET NormPartial norm_entry(const scalar_t* p, int64_t n, const NormSpec& ns, int32_t& e, int32_t flags) { \
    return norm_chunk_body<B, scalar_t>(p, n, ns, e, flags);                                                  \
  }                                                                                                           \
  template <typename scalar_t>                                                                                \
  TARGET void scale_entry(scalar_t* p, int64_t n, acc_of<scalar_t> coef, bool zero) {                          \
    scale_chunk_body<B, scalar_t>(p, n, coef, zero);                                                          \
  }                                                                                                           \
  template <typename scalar_t>                                                                                \
  TARGET int64_t clamp_entry(scalar_t* p, int64_t n, scalar_t lo, scalar_t hi) {                               \
    return clamp_chunk_body<B, scalar_t>(p, n, lo, hi);                                                       \
  }                                                                                                           \
  }                                                                                                           \
  const ClipTable NAME = {{&norm_entry<float>, &scale_entry<float>, &clamp_entry<float>},                     \
                          {&norm_entry<double>, &scale_entry<double>, &clamp_entry<double>},                  \
                          {&norm_entry<c10::Half>, &scale_entry<c10::Half>, &clamp_entry<c10::Half>},         \
                          {&norm_entry<c10::BFloat16>, &scale_entry<c10::BFloat16>, &clamp_entry<c10::BFloat16>}};

}  // namespace clip_cpu
}  // namespace hookstats
