// The histogram half of a CPU statistics chunk (cpu/stats_chunk.h): a chunk's counter indices, in SIMD
// over the B-byte vectors of Note [cpu dispatch], and the counting pass over them. Included by the
// per-ISA units cpu/stats_chunk_{default,avx2,avx512}.cpp (through stats_chunk.h) and by the driver,
// cpu/stats_cpu.cpp, which plans the binning (bin_plan) and owns the counters.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../core/hist_ops.h"
#include "cpu_common.h"
#include "exp_onehot.h"
#include "onehot_count.h"
#include "simd.h"

namespace hookstats {
namespace cpu {

// Raw bits of a value, for the exponent histogram (Note [histogram layouts]).
template <typename scalar_t> HS_INLINE int32_t exp_slot_of(const scalar_t& v);
template <> HS_INLINE int32_t exp_slot_of<float>(const float& v) {
  uint32_t b; std::memcpy(&b, &v, 4); return exp_slot<8, 23>(b);
}
template <> HS_INLINE int32_t exp_slot_of<double>(const double& v) {
  uint64_t b; std::memcpy(&b, &v, 8); return exp_slot<11, 52>(b);
}
template <> HS_INLINE int32_t exp_slot_of<c10::Half>(const c10::Half& v) { return exp_slot<5, 10>(v.x); }
template <> HS_INLINE int32_t exp_slot_of<c10::BFloat16>(const c10::BFloat16& v) { return exp_slot<8, 7>(v.x); }

// Constants of the SIMD range binning, see slot_lanes. Built once per call (bin_plan).
struct RangeConsts {
  float scale, shift, lo_clamp, hi_clamp, band;
  float fbins;
  int32_t bins;
  bool exact_only;  // the float32 transform overflows (tiny ranges): every value takes the exact path
  // Note [exact bin thresholds]: when T (float-accumulated inputs) or T64 (float64 inputs) is set,
  // counters are indexed by ordinal (0 underflow, 1 + bin, bins + 1 overflow, bins + 2 NaN) and every
  // value is placed by r + (x >= T[r]).
  const float* T;
  const double* T64;
  double band64;  // fixed_slot's band of the double transform (spec.scale, spec.shift)
};

// What bin_chunk needs: the spec, and for float inputs the constants of the SIMD range path.
struct BinPlan {
  HistSpec spec;
  RangeConsts rc;
  // Note [16-bit ordinal tables]: fp16/bf16 range or exponent histograms of tensors of kLutMinNumel values or more.
  const uint16_t* lut;
};

// Below this many values a 16-bit input keeps the threshold path rather than build a table (a build
// costs about what 2^16 values cost to bin, and is cached afterwards).
constexpr int64_t kLutMinNumel = 8192;

// The counter index of one value (Note [cpu histogram counters]; by ordinal when the thresholds are set).
template <int HM, typename scalar_t>
HS_INLINE int32_t slot_scalar(const scalar_t& raw, const BinPlan& bp) {
  if (HM == kHistRange) {
    if constexpr (std::is_same_v<acc_of<scalar_t>, float>) {
      if (bp.rc.T != nullptr) return threshold_ordinal(static_cast<float>(raw), bp.spec, bp.rc.T);
    }
    if constexpr (std::is_same_v<scalar_t, double>) {
      if (bp.rc.T64 != nullptr) return threshold_ordinal(raw, bp.spec, bp.rc.T64);
    }
    return fixed_slot<acc_of<scalar_t>>(static_cast<acc_of<scalar_t>>(raw), bp.spec);
  }
  return exp_slot_of<scalar_t>(raw);
}


template <typename scalar_t> struct ExpBits;
template <> struct ExpBits<float> { static constexpr int E = 8, M = 23; };
template <> struct ExpBits<c10::BFloat16> { static constexpr int E = 8, M = 7; };
template <> struct ExpBits<c10::Half> { static constexpr int E = 5, M = 10; };

// The threshold a vector's near lanes share (Note [exact bin thresholds]): data that sits on or next
// to one edge (ReLU zeros, gradient-sized values around 0, a constant on an edge) puts every near lane
// at the same edge r, vector after vector, so the lanes compare with one broadcast threshold; a
// vector whose near lanes sit at another edge reads T per lane and moves the cache there.
template <typename V>
struct EdgeCache {
  V r;  // the edge, in every lane (-1: none yet)
  V T;  // its threshold, in every lane
};

// The ordinals (Note [exact bin thresholds]) of float or double lanes v, with M the lanes' mask type:
// t = v * scale + shift; r = the nearest edge; a lane farther than the band from r is above it exactly
// when t is (fixed_slot's rule), a near lane exactly when v >= T[r] (the cached edge's broadcast
// threshold, or T per lane); NaN lanes get bins + 2. Float lanes return int32 ordinals (M); double
// lanes return them as exact doubles (V), which convert to int32 lanes in one instruction where int64
// ones take five.
template <int B, typename V, typename M, typename F>
HS_INLINE std::conditional_t<sizeof(F) == 4, M, V> range_ordinals(const V& v, F scale, F shift, F band, int32_t bins,
                                                                  const F* T, EdgeCache<V>& ec) {
  constexpr int W = sizeof(V) / sizeof(F);
  using R = std::conditional_t<sizeof(F) == 4, M, V>;
  const V t = v * scale + shift;
  const V tc = simd::min_of<B>(simd::max_of<B>(t, V{}), V{} + static_cast<F>(bins));  // NaN -> 0
  const V rf = simd::round_nonneg_of<B, V, M>(tc);
  R r;
  if constexpr (sizeof(F) == 4) r = __builtin_convertvector(rf, M); else r = rf;
  const M one = (M)(V{} + F(1));
  auto plus = [&](const M& above) -> R {  // r + 1 where above is set
    if constexpr (sizeof(F) == 4) return r - above; else return r + (V)(above & one);
  };
  const V d = t - rf;
  const M is_nan = (M)(v != v);
  // (No `~` on a mask: GCC 12 scalarizes the complement of a 64-byte compare's result, lane by lane.)
  const M near = (M)(simd::abs_bits<V, M>(d) <= band) & (M)(v == v);
  const R o_far = plus((M)(d >= F(0)));
  R o = simd::select(near, plus((M)(v >= ec.T)), o_far);
  if (simd::any_lane_of<B>(near & (M)(rf != ec.r))) {  // a near lane at another edge than the cached one
    V g;
    for (int j = 0; j < W; ++j) g[j] = T[static_cast<int32_t>(rf[j])];
    o = simd::select(near, plus((M)(v >= g)), o_far);
    int j0 = 0;
    while (!near[j0] || rf[j0] == ec.r[j0]) ++j0;
    ec.r = V{} + rf[j0];
    ec.T = V{} + g[j0];
  }
  using RS = std::decay_t<decltype(R{}[0])>;
  return simd::select(is_nan, R{} + static_cast<RS>(bins + 2), o);
}

// Exponent-histogram slots (Note [histogram layouts]) of the E-exponent, MB-mantissa-bit patterns in the
// unsigned lanes bits, as signed lanes I: normals by exponent and sign; then neg/pos subnormal, zero,
// -inf, +inf, NaN. (The sign enters as a mask, neg = -1: AVX2 has no 64-bit lane multiply.)
template <int E, int MB, typename U, typename I>
HS_INLINE I exp_slots(const U& bits) {
  using S = std::decay_t<decltype(I{}[0])>;
  using UE = std::decay_t<decltype(U{}[0])>;
  constexpr UE one = 1;
  constexpr S nE = (S(1) << E) - 2;
  constexpr UE emask = (one << E) - 1u;
  const U e = (bits >> MB) & emask;
#if HS_X86_BUILTINS
  if constexpr (sizeof(U) == 64 && sizeof(UE) == 4) {  // 16 lanes: the same slots on mask registers (simd::k16)
    namespace k = simd::k16;
    const I ei = (I)e, bi = (I)bits;
    const k::mask neg = k::test(bi, I{} + static_cast<int32_t>(one << (E + MB)));
    const k::mask mant = k::test(bi, I{} + static_cast<int32_t>((one << MB) - 1u));
    const k::mask e0 = k::cmpu<0 /*EQ*/>(ei, I{}), emax = k::cmpu<0>(ei, I{} + static_cast<int32_t>(emask));
    I out = k::add_where(static_cast<k::mask>(~neg), ei - 1, I{} + nE);  // normals
    const I sub_or_zero = k::blend(mant, I{} + (2 * nE + 2), k::blend(neg, I{} + (2 * nE + 1), I{} + (2 * nE)));
    const I inf_or_nan = k::blend(mant, k::blend(neg, I{} + (2 * nE + 4), I{} + (2 * nE + 3)), I{} + (2 * nE + 5));
    out = k::blend(e0, out, sub_or_zero);
    return k::blend(emax, out, inf_or_nan);
  }
#endif
  const I neg = (I)((bits >> (E + MB)) != 0u);
  const I pos = (I)((bits >> (E + MB)) == 0u);  // not ~neg: see range_ordinals
  const I mant = (I)((bits & ((one << MB) - 1u)) != 0u);
  const I e0 = (I)(e == 0u), emax = (I)(e == emask);
  const I normal = (I)(e - 1u) + (pos & nE);
  const I sub_or_zero = simd::select(mant, neg + (2 * nE + 1), I{} + (2 * nE + 2));
  const I inf_or_nan = simd::select(mant, I{} + (2 * nE + 5), neg + (2 * nE + 4));
  return simd::select(e0, sub_or_zero, simd::select(emax, inf_or_nan, normal));
}

// Counter indices (Note [cpu histogram counters], copy 0) of W float lanes v (raw: the same W input
// values), in SIMD, with no per-value branch: exponents by exp_slots on the bits; range slots by
// range_ordinals when the thresholds exist. Without them (ranges too narrow for float32 t) a vector
// holding a value near an edge, or NaN, has those lanes placed by the exact scalar functions of
// core/hist_ops.h.
template <int B, int HM, typename scalar_t>
HS_INLINE typename simd::VT<B>::i32 slot_lanes(const scalar_t* raw, const typename simd::VT<B>::f32& v,
                                               const BinPlan& bp, EdgeCache<typename simd::VT<B>::f32>& ec) {
  using V = typename simd::VT<B>::f32;
  using I = typename simd::VT<B>::i32;
  using U = typename simd::VT<B>::u32;
  constexpr int W = B / 4;
  const RangeConsts& rc = bp.rc;
  if (HM == kHistRange && rc.T != nullptr) {
    return range_ordinals<B, V, I>(v, rc.scale, rc.shift, rc.band, rc.bins, rc.T, ec);
  }
  if (HM == kHistExp) {
    U bits;
    if (sizeof(scalar_t) == 4) {
      std::memcpy(&bits, &v, sizeof bits);
    } else {
      typename simd::VT<B>::u16 r16;
      std::memcpy(&r16, raw, sizeof r16);
      bits = simd::widen_u16<B>(r16);
    }
    return exp_slots<ExpBits<scalar_t>::E, ExpBits<scalar_t>::M, U, I>(bits);
  }
  const V t = v * rc.scale + rc.shift;
  V tc = t > rc.lo_clamp ? t : V{} + rc.lo_clamp;
  tc = tc < rc.hi_clamp ? tc : V{} + rc.hi_clamp;
  I i = __builtin_convertvector(tc, I);  // truncation; tc is within int range
  const V fi = __builtin_convertvector(i, V);
  const I up = (I)(fi > tc);  // -1 where truncation rounded a negative value up
  i += up;
  const V frac = tc - (fi + __builtin_convertvector(up, V));
  const I special = (I)(frac < rc.band) | (I)((1.0f - frac) < rc.band) | (I)(v != v);
  I slot = i < 0 ? I{} + rc.bins : (i >= rc.bins ? I{} + (rc.bins + 1) : i);
  if (simd::any_lane(special)) {
    for (int j = 0; j < W; ++j) {
      if (!special[j]) continue;
      slot[j] = fixed_slot_exact(static_cast<double>(static_cast<float>(raw[j])), bp.spec);
    }
  }
  return slot;
}

// slot_lanes for float64 inputs: W = B / 8 double lanes, W int32 counter indices (range ordinals with a
// table of double thresholds and the transform in double; exponent slots of the 64-bit patterns).
template <int B, int HM>
HS_INLINE typename simd::VT<B / 2>::i32 slot_lanes_f64(const typename simd::VT<B>::f64& v, const BinPlan& bp,
                                                       EdgeCache<typename simd::VT<B>::f64>& ec) {
  using V = typename simd::VT<B>::f64;
  using I = typename simd::VT<B>::i64;
  using J = typename simd::VT<B / 2>::i32;
  if constexpr (HM == kHistRange) {
    return __builtin_convertvector(
        range_ordinals<B, V, I>(v, bp.spec.scale, bp.spec.shift, bp.rc.band64, bp.spec.bins, bp.rc.T64, ec), J);
  } else {
    typename simd::VT<B>::u64 bits;
    std::memcpy(&bits, &v, sizeof bits);
    return __builtin_convertvector((exp_slots<11, 52, typename simd::VT<B>::u64, I>(bits)), J);
  }
}

// The counting pass (Note [cpu histogram counters]) over n counter indices: value j of a run of
// kCountRun goes to copy j % copies, except that a run whose kCountRun indices are all equal (one bin:
// zeros, a saturated or dead unit, a NaN-filled tensor) adds kCountRun to one counter at once. A run is
// as long as it is so that mixed data almost never passes the test (a 90%-zero input has 0.1% of its
// runs all zero): the branch stays predictable for every distribution. The keys are the indices
// themselves (count_indices) or the 16-bit patterns a table maps to indices (count_lut).
constexpr int64_t kCountRun = 64;

template <typename K, typename Index>
HS_INLINE void count_keys(const K* k, int64_t n, HistCounters& h, const Index& index) {
  uint32_t* c[8];
  for (int r = 0; r < 8; ++r) c[r] = h.c + (r & (h.copies - 1)) * h.len;
  int64_t i = 0;
  for (; i + kCountRun <= n; i += kCountRun) {
    const K first = k[i];
    K diff = 0;
    for (int64_t j = 0; j < kCountRun; ++j) diff |= static_cast<K>(k[i + j] ^ first);
    if (diff == 0) {
      c[0][index(first)] += static_cast<uint32_t>(kCountRun);
      continue;
    }
    for (int64_t j = 0; j < kCountRun; j += 8) {
      for (int r = 0; r < 8; ++r) c[r][index(k[i + j + r])] += 1;
    }
  }
  for (; i < n; ++i) c[i & 7][index(k[i])] += 1;
}

HS_INLINE void count_indices(const int32_t* idx, int64_t n, HistCounters& h) {
  count_keys(idx, n, h, [](int32_t v) { return v; });
}

// count_indices for Note [16-bit ordinal tables]: the key of a value is its bits, its index lut[bits],
// read as it is counted.
template <typename bits16>
HS_INLINE void count_lut(const bits16* b, int64_t n, const uint16_t* lut, HistCounters& h) {
  count_keys(b, n, h, [lut](bits16 v) { return lut[v]; });
}

#if HS_X86_BUILTINS
// range_ordinals' rule for 16 float lanes at a time on mask registers (simd::k16), the loop's constants and the
// edge cache held in registers: the AVX-512 entry points' range binning of float-accumulated inputs with
// thresholds (GCC 12 would otherwise scalarize the generic body's selects and re-broadcast its constants
// per vector). Writes the ordinals of values [0, n - n % 16) of p into idx and returns that count.
template <typename L, typename scalar_t>
HS_INLINE int64_t range_ordinals_avx512(const scalar_t* p, int64_t n, const RangeConsts& rc, int32_t* idx) {
  namespace k = simd::k16;
  using V = k::F;
  using M = k::I;
  const V scale = V{} + rc.scale, shift = V{} + rc.shift, band = V{} + rc.band, top = V{} + rc.fbins;
  const M one = M{} + 1, nan_slot = M{} + (rc.bins + 2);
  V er = V{} - 1.0f, eT = V{};  // the edge cache (EdgeCache): no edge yet
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V v = L::load(p + i);
    const V t = v * scale + shift;
    const V rf = simd::round_nonneg_of<64, V, M>(simd::min_of<64>(simd::max_of<64>(t, V{}), top));  // NaN -> 0
    const V d = t - rf;
    const k::mask near = k::cmp<2 /*LE_OS*/>(simd::abs_bits<V, M>(d), band) & k::cmp<7 /*ORD_Q*/>(v, v);
    const k::mask far_above = static_cast<k::mask>(~near) & k::cmp<13 /*GE_OS*/>(d, V{});
    k::mask above = (near & k::cmp<13>(v, eT)) | far_above;
    const k::mask moved = near & k::cmp<4 /*NEQ_UQ*/>(rf, er);
    if (moved != 0) {  // a near lane at another edge than the cached one: thresholds per lane, cache moves
      const M r = __builtin_convertvector(rf, M);
      const V g = __builtin_ia32_gathersiv16sf(V{}, rc.T, r, near, 4);
      above = (near & k::cmp<13>(v, g)) | far_above;
      const M lane = M{} + __builtin_ctz(moved);
      er = __builtin_ia32_permvarsf512_mask(rf, lane, rf, (k::mask)0xFFFF);
      eT = __builtin_ia32_permvarsf512_mask(g, lane, g, (k::mask)0xFFFF);
    }
    const M o = k::add_where(above, __builtin_convertvector(rf, M), one);
    const M out = k::blend(k::cmp<3 /*UNORD_Q*/>(v, v), o, nan_slot);
    std::memcpy(idx + i, &out, sizeof out);
  }
  return i;
}

// The same rule for 8 double lanes (the thresholds T64, the transform in double), their ordinals as 8 int32 lanes:
// GCC 12 scalarized range_ordinals' double body at this width, lane by lane (2^20 randn, 64 bins: 2.2 ms, 2.4x the
// AVX2 level's 0.9 ms).
template <int P>
HS_INLINE unsigned char cmp_f64x8(const simd::VT<64>::f64& a, const simd::VT<64>::f64& b) {
  return __builtin_ia32_cmppd512_mask(a, b, P, (unsigned char)0xFF, 4);  // _CMP_* predicates of _mm512_cmp_pd_mask
}

HS_INLINE int64_t range_ordinals_avx512_f64(const double* p, int64_t n, const BinPlan& bp, int32_t* idx) {
  using V = simd::VT<64>::f64;
  using Q = simd::VT<64>::i64;
  using M = simd::VT<32>::i32;
  typedef unsigned char mask;
  const V scale = V{} + bp.spec.scale, shift = V{} + bp.spec.shift, band = V{} + bp.rc.band64;
  const V top = V{} + static_cast<double>(bp.spec.bins);
  const M one = M{} + 1, nan_slot = M{} + (bp.spec.bins + 2);
  V er = V{} - 1.0, eT = V{};  // the edge cache (EdgeCache): no edge yet
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    V v;
    std::memcpy(&v, p + i, sizeof v);
    const V t = v * scale + shift;
    const V rf = simd::round_nonneg_of<64, V, Q>(simd::min_of<64>(simd::max_of<64>(t, V{}), top));  // NaN -> 0
    const V d = t - rf;
    const mask near = cmp_f64x8<2 /*LE_OS*/>(simd::abs_bits<V, Q>(d), band) & cmp_f64x8<7 /*ORD_Q*/>(v, v);
    const mask far_above = static_cast<mask>(~near) & cmp_f64x8<13 /*GE_OS*/>(d, V{});
    mask above = (near & cmp_f64x8<13>(v, eT)) | far_above;
    const mask moved = near & cmp_f64x8<4 /*NEQ_UQ*/>(rf, er);
    const M r = __builtin_convertvector(rf, M);
    if (moved != 0) {  // a near lane at another edge than the cached one: thresholds per lane, cache moves
      const V g = __builtin_ia32_gathersiv8df(V{}, bp.rc.T64, r, near, 8);
      above = (near & cmp_f64x8<13>(v, g)) | far_above;
      const int j = __builtin_ctz(moved);
      er = V{} + rf[j];
      eT = V{} + g[j];
    }
    const M o = __builtin_ia32_paddd256_mask(r, one, r, above);
    const M out = __builtin_ia32_blendmd_256_mask(o, nan_slot, cmp_f64x8<3 /*UNORD_Q*/>(v, v));
    std::memcpy(idx + i, &out, sizeof out);
  }
  return i;
}
#endif

// The histogram of one chunk: counter indices into a buffer (SIMD, or one table load per value for
// Note [16-bit ordinal tables]), then the counting pass: in registers (Note [one-hot chunk counts]) in the wide
// entry points for the exponent histogram and up to kOneHotMaxBins bins, else value by value. mn: the chunk's
// least and greatest non-NaN values, zero and nan its counts of zeros and NaNs (from its statistics).
template <int B, typename scalar_t, int HM>
HS_INLINE void bin_chunk(const scalar_t* p, int64_t n, HistCounters& h, const BinPlan& bp, double mn, double mx,
                         int64_t zero, int64_t nan) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  constexpr int W = L::W;
  constexpr bool kWide = B >= 32;
  if constexpr (kWide && HM == kHistExp && (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>)) {
    if (h.onehot_wait > 0) {  // Note [one-hot misses]: value by value, below
      --h.onehot_wait;
    } else {
#if HS_X86_BUILTINS
      if constexpr (B == 64) {
        if (exp_chunk_narrow(p, n, h, std::fmax(-mn, mx), zero, nan)) return;
      }
#endif
      exp_chunk_onehot<B>(p, n, h, std::fmax(-mn, mx), zero, nan);
      return;
    }
  }
  // (not for Note [16-bit ordinal tables]: a table load and an increment per value beat a table load, a store and
  // the one-hot pass)
  bool onehot = kWide && HM == kHistRange && bp.spec.bins <= kOneHotMaxBins && bp.lut == nullptr;
  if (onehot && h.onehot_wait > 0) {  // Note [one-hot misses]
    --h.onehot_wait;
    onehot = false;
  }
  alignas(64) int32_t idx[kChunk];
  int64_t i = 0;
  if constexpr (std::is_same_v<typename L::acc_t, float>) {
    if (HM == kHistRange && bp.rc.exact_only) {
      for (; i < n; ++i) idx[i] = fixed_slot_exact(static_cast<double>(static_cast<float>(p[i])), bp.spec);
    } else if (sizeof(scalar_t) == 2 && bp.lut != nullptr) {
      typedef uint16_t __attribute__((may_alias)) bits16;  // c10::Half / c10::BFloat16 hold their 16 bits
      count_lut(reinterpret_cast<const bits16*>(p), n, bp.lut, h);
      return;
    } else {
#if HS_X86_BUILTINS
      if constexpr (B == 64 && HM == kHistRange) {
        if (bp.rc.T != nullptr) i = range_ordinals_avx512<L>(p, n, bp.rc, idx);
      }
#endif
      EdgeCache<typename simd::VT<B>::f32> ec{typename simd::VT<B>::f32{} - 1.0f, typename simd::VT<B>::f32{}};
      const BinPlan plan = bp;  // a local copy: its constants stay in registers across the idx stores
      for (; i + W <= n; i += W) {
        const typename simd::VT<B>::i32 at = slot_lanes<B, HM, scalar_t>(p + i, L::load(p + i), plan, ec);
        std::memcpy(idx + i, &at, sizeof at);
      }
    }
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    if (HM == kHistExp || bp.rc.T64 != nullptr) {
#if HS_X86_BUILTINS
      if constexpr (B == 64 && HM == kHistRange) i = range_ordinals_avx512_f64(p, n, bp, idx);
#endif
      EdgeCache<typename simd::VT<B>::f64> ec{typename simd::VT<B>::f64{} - 1.0, typename simd::VT<B>::f64{}};
      const BinPlan plan = bp;
      for (; i + W <= n; i += W) {
        const typename simd::VT<B / 2>::i32 at = slot_lanes_f64<B, HM>(L::load(p + i), plan, ec);
        std::memcpy(idx + i, &at, sizeof at);
      }
    }
  }
  for (; i < n; ++i) idx[i] = slot_scalar<HM>(p[i], bp);
  if constexpr (kWide) {
    if (onehot) {
      // the window: the last chunk's while it holds this chunk's least and greatest index, else the lowest one
      // that holds the greatest (or from the least, when no window holds both)
      const int32_t lo = slot_scalar<HM>(static_cast<scalar_t>(mn), bp), hi = slot_scalar<HM>(static_cast<scalar_t>(mx), bp);
      const int32_t kb = h.base[0] >= 0 && lo >= h.base[0] && hi < h.base[0] + 64 ? h.base[0] : std::min(lo, std::max(hi - 63, 0));
      count_indices_onehot<B>(idx, n, h, kb, bp.spec.bins + 2, nan);
      return;
    }
  }
  count_indices(idx, n, h);
}


}  // namespace cpu
}  // namespace hookstats
