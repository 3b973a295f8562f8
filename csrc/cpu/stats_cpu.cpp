// CPU implementation of hookstats::stats and hookstats::stats_into.
//
// The input is cut into chunks of kChunk elements (a strided input is gathered chunk by
// chunk into a stack buffer, Note [layouts]). Each chunk is reduced in SIMD on the fast
// path (Note [stats partials]): scaled by a power of two when its magnitudes call for it
// (Note [stats scaling]), only counted once its task has seen NaN/Inf (Note [stats nonfinite]). Chunks are grouped into at most kMaxTasks tasks whose number
// depends only on numel, so the merge order, and hence every bit of the result, does not
// depend on the number of threads. A histogram is binned after each chunk's statistics, which
// settle it at once for a constant or all-NaN chunk (Note [cpu constant chunks]); other chunks
// are binned and counted in two passes (Note [cpu histogram counters]).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <string>
#include <vector>
#include <type_traits>

#include "../core/bindings.h"
#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/hist_ops.h"
#include "../core/layout.h"
#include "../core/loc_ops.h"
#include "../core/stats_ops.h"
#include "cpu_common.h"
#include "simd.h"

namespace hookstats {
namespace {

constexpr int64_t kChunk = 4096;
constexpr int64_t kMaxTasks = 64;
constexpr int64_t kMinTaskElems = 32768;

// The fast path over one contiguous chunk (Note [cpu dispatch]): the SIMD version of
// fast_add() in core/stats_ops.h, in two interleaved sets of lanes (to hide the add and
// fma latencies). The lanes restart every kBlock elements and their sums are added into f,
// so no float lane adds more than kBlock / (2 W) values: a constant tensor's l1 stays
// within ~1e-6 of the truth (a single lane over the whole chunk drifted to ~5e-6).
constexpr int64_t kBlock = 512;

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

// Note [cpu histogram counters]
// A chunk is binned in two passes: its counter indices go into a 16 KB buffer (SIMD, or table loads),
// then a counting pass (count_keys) increments, for value j of each run of 64, copy j % copies of
// the `copies` uint32 copies of the histogram that the thread holds. So runs of values in one bin do
// not serialize on one counter's store-to-load latency, and data that alternates at random between a
// few bins (ReLU outputs, values around an edge) does not defeat the CPU's memory-dependence
// prediction: a bare `c[idx[i]] += 1` loop (torch.bincount) is 2-2.5x slower on such data than on
// spread data, this pass is not. A run of 64 equal indices is one addition. The copies are added
// into the thread's int64 totals before any counter can wrap (every 2^31 increments) and at the end;
// threads' totals are summed last. Counts are integers: the result does not depend on threads or
// order.
struct HistCounters {
  uint32_t* c;     // copies x len
  int64_t* total;  // len
  int64_t len;
  int copies;      // power of two
  int64_t pending;
};

inline void flush_counters(HistCounters& h) {
  const int64_t len = h.len;
  int64_t* __restrict__ total = h.total;
  for (int r = 0; r < h.copies; ++r) {
    uint32_t* __restrict__ c = h.c + r * len;
    for (int64_t i = 0; i < len; ++i) total[i] += c[i];
    std::memset(c, 0, static_cast<size_t>(len) * sizeof(uint32_t));
  }
  h.pending = 0;
}

// Adds (accumulate) or writes the counts c[0, len) to their slots of out (by ordinal: Note [exact bin
// thresholds], slot_of_ordinal as three runs), then zeroes c.
inline void write_counts(int64_t* __restrict__ c, int64_t len, bool ordinal, int32_t bins, bool accumulate,
                         int64_t* __restrict__ out) {
  auto run = [&](int64_t to, int64_t from, int64_t n) {
    if (accumulate) {
      for (int64_t i = 0; i < n; ++i) out[to + i] += c[from + i];
    } else {
      for (int64_t i = 0; i < n; ++i) out[to + i] = c[from + i];
    }
  };
  if (ordinal) {  // ordinal 0 (underflow) -> slot bins, 1 + b -> b, bins + 1 and bins + 2 stay
    run(0, 1, bins);
    run(bins, 0, 1);
    run(bins + 1, bins + 1, len - bins - 1);
  } else {
    run(0, 0, len);
  }
  std::memset(c, 0, static_cast<size_t>(len) * sizeof(int64_t));
}

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

inline RangeConsts range_consts(const HistSpec& hs) {
  RangeConsts r;
  r.scale = hs.scale_f;
  r.shift = hs.shift_f;
  r.lo_clamp = -1.5f;
  r.hi_clamp = static_cast<float>(hs.bins) + 1.5f;
  r.fbins = static_cast<float>(hs.bins);
  r.band = static_cast<float>(threshold_band<float>(hs));  // fixed_slot's band for every t in [lo_clamp, hi_clamp]
  r.bins = hs.bins;
  // HistSpec::float_ok: a zero or subnormal float scale (huge ranges like (-1e300, 1e300)) or
  // an overflowing one (tiny ranges) would break the band's accuracy assumption.
  r.exact_only = !hs.float_ok || !std::isfinite(r.band);
  r.T = nullptr;
  r.T64 = nullptr;
  r.band64 = threshold_band<double>(hs);
  return r;
}

template <typename scalar_t>
BinPlan bin_plan(const HistSpec& hs, int64_t numel) {
  BinPlan bp;
  bp.spec = hs;
  bp.rc = hs.mode == kHistRange ? range_consts(hs) : RangeConsts{};
  bp.rc.T = nullptr;
  bp.rc.T64 = nullptr;
  bp.lut = nullptr;
  if (hs.mode == kHistRange && std::is_same<scalar_t, double>::value) bp.rc.T64 = cached_thresholds<double>(hs);
  if (hs.mode == kHistRange && std::is_same<acc_of<scalar_t>, float>::value && !bp.rc.exact_only) {
    bp.rc.T = cached_thresholds<float>(hs);  // Note [exact bin thresholds]
    if (bp.rc.T != nullptr && numel >= kLutMinNumel) {
      if (std::is_same<scalar_t, c10::Half>::value) bp.lut = cached_ordinal_lut<5>(hs);
      if (std::is_same<scalar_t, c10::BFloat16>::value) bp.lut = cached_ordinal_lut<8>(hs);
    }
  }
  if (hs.mode == kHistExp && numel >= kLutMinNumel) {
    if (std::is_same<scalar_t, c10::Half>::value) bp.lut = exp_slot_lut<5, 10>();
    if (std::is_same<scalar_t, c10::BFloat16>::value) bp.lut = exp_slot_lut<8, 7>();
  }
  return bp;
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
  const M near = ~(M)(simd::abs_bits<V, M>(d) > band) & ~is_nan;
  const R o_far = plus((M)(d >= F(0)));
  R o = near ? plus((M)(v >= ec.T)) : o_far;
  if (simd::any_lane_of<B>(near & (M)(rf != ec.r))) {  // a near lane at another edge than the cached one
    V g;
    for (int j = 0; j < W; ++j) g[j] = T[static_cast<int32_t>(rf[j])];
    o = near ? plus((M)(v >= g)) : o_far;
    int j0 = 0;
    while (!near[j0] || rf[j0] == ec.r[j0]) ++j0;
    ec.r = V{} + rf[j0];
    ec.T = V{} + g[j0];
  }
  using RS = std::decay_t<decltype(R{}[0])>;
  return is_nan ? R{} + static_cast<RS>(bins + 2) : o;
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
  const I neg = (I)((bits >> (E + MB)) != 0u);
  const I mant = (I)((bits & ((one << MB) - 1u)) != 0u);
  const I e0 = (I)(e == 0u), emax = (I)(e == emask);
  const I normal = (I)(e - 1u) + (~neg & nE);
  const I sub_or_zero = mant ? neg + (2 * nE + 1) : I{} + (2 * nE + 2);
  const I inf_or_nan = mant ? I{} + (2 * nE + 5) : neg + (2 * nE + 4);
  return e0 ? sub_or_zero : (emax ? inf_or_nan : normal);
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
      bits = __builtin_convertvector(r16, U);
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

// The histogram of one chunk: counter indices into a buffer (SIMD, or one table load per value for
// Note [16-bit ordinal tables]), then the counting pass.
template <int B, typename scalar_t, int HM>
HS_INLINE void bin_chunk(const scalar_t* p, int64_t n, HistCounters& h, const BinPlan& bp) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  constexpr int W = L::W;
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
      EdgeCache<typename simd::VT<B>::f32> ec{typename simd::VT<B>::f32{} - 1.0f, typename simd::VT<B>::f32{}};
      const BinPlan plan = bp;  // a local copy: its constants stay in registers across the idx stores
      for (; i + W <= n; i += W) {
        const typename simd::VT<B>::i32 at = slot_lanes<B, HM, scalar_t>(p + i, L::load(p + i), plan, ec);
        std::memcpy(idx + i, &at, sizeof at);
      }
    }
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    if (HM == kHistExp || bp.rc.T64 != nullptr) {
      EdgeCache<typename simd::VT<B>::f64> ec{typename simd::VT<B>::f64{} - 1.0, typename simd::VT<B>::f64{}};
      const BinPlan plan = bp;
      for (; i + W <= n; i += W) {
        const typename simd::VT<B / 2>::i32 at = slot_lanes_f64<B, HM>(L::load(p + i), plan, ec);
        std::memcpy(idx + i, &at, sizeof at);
      }
    }
  }
  for (; i < n; ++i) idx[i] = slot_scalar<HM>(p[i], bp);
  count_indices(idx, n, h);
}

template <typename scalar_t>
using CpuAcc = FastAcc<acc_of<scalar_t>, double>;

template <int B, typename scalar_t, bool SCALED>
HS_INLINE CpuAcc<scalar_t> fast_chunk_simd(const scalar_t* p, int64_t n, acc_of<scalar_t> k, int32_t e) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  using acc_t = typename L::acc_t;
  using V = typename L::V;
  using M = typename L::M;
  constexpr int W = L::W;
  struct Lanes {
    V sd, ssd, l1, mn, mx;
    M z;
  };
  // Each block's lane sums are added to double lanes (DV), reduced once at the end of the chunk.
  using DV = typename simd::F64Lanes<W>::type;
  CpuAcc<scalar_t> f;
  fast_init<acc_t>(f, k, e);
  DV dsd{}, dssd{}, dl1{};
  const V vk = V{} + k;
  const V vs = V{} + f.s;
  auto init = [](Lanes& a) {
    a.sd = V{}; a.ssd = V{}; a.l1 = V{}; a.z = M{};
    a.mn = V{} + static_cast<acc_t>(INFINITY);
    a.mx = V{} - static_cast<acc_t>(INFINITY);
  };
  auto step = [&](Lanes& a, const V& v) {
    if constexpr (SCALED) {
      const V y = v * vs;  // exact: a power of two (Note [stats scaling])
      const V d = y - vk;
      a.sd += d;
      a.ssd += d * d;
      a.l1 += simd::abs_bits<V, M>(y);
    } else {
      const V d = v - vk;
      a.sd += d;
      a.ssd += d * d;
      a.l1 += simd::abs_bits<V, M>(v);
    }
    a.mn = v < a.mn ? v : a.mn;
    a.mx = v > a.mx ? v : a.mx;
    a.z -= (v == 0);
  };
  int64_t i = 0;
  const int64_t n_vec = n - n % W;
  while (i < n_vec) {
    Lanes a, b;
    init(a);
    init(b);
    const int64_t end = std::min(n_vec, i + kBlock);
    for (; i + 2 * W <= end; i += 2 * W) {
      const V v0 = L::load(p + i);
      const V v1 = L::load(p + i + W);
      step(a, v0);
      step(b, v1);
    }
    if (i + W <= end) {
      const V v0 = L::load(p + i);
      step(a, v0);
      i += W;
    }
    dsd += __builtin_convertvector(a.sd + b.sd, DV);
    dssd += __builtin_convertvector(a.ssd + b.ssd, DV);
    dl1 += __builtin_convertvector(a.l1 + b.l1, DV);
    for (int j = 0; j < W; ++j) {
      const acc_t mn = a.mn[j] < b.mn[j] ? a.mn[j] : b.mn[j];
      const acc_t mx = a.mx[j] > b.mx[j] ? a.mx[j] : b.mx[j];
      f.mn = mn < f.mn ? mn : f.mn;
      f.mx = mx > f.mx ? mx : f.mx;
      f.zero += a.z[j] + b.z[j];
    }
  }
  for (int j = 0; j < W; ++j) {
    f.sd += dsd[j];
    f.ssd += dssd[j];
    f.l1 += dl1[j];
  }
  f.n = i;
  for (; i < n; ++i) {
    fast_add<acc_t>(f, static_cast<acc_t>(p[i]));
  }
  return f;
}

template <int B, typename scalar_t>
HS_INLINE CpuAcc<scalar_t> fast_chunk(const scalar_t* p, int64_t n, acc_of<scalar_t> k, int32_t e) {
  return e == 0 ? fast_chunk_simd<B, scalar_t, false>(p, n, k, 0) : fast_chunk_simd<B, scalar_t, true>(p, n, k, e);
}

// The counting pass of a piece with NaN/Inf (Note [stats nonfinite]), in SIMD: NaN, Inf and zero
// counts by vector compares, NaN-free min and max.
template <int B, typename scalar_t>
HS_INLINE NonfiniteAcc<acc_of<scalar_t>> nonfinite_chunk_simd(const scalar_t* p, int64_t n) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  using acc_t = typename L::acc_t;
  using V = typename L::V;
  using M = typename L::M;
  constexpr int W = L::W;
  const V inf = V{} + static_cast<acc_t>(INFINITY);
  M cn0{}, ci0{}, cz0{}, cn1{}, ci1{}, cz1{};
  V mn0 = inf, mx0 = -inf, mn1 = inf, mx1 = -inf;
  auto step = [&](M& cn, M& ci, M& cz, V& mn, V& mx, const V& v) {
    cn -= (v != v);
    ci -= (simd::abs_bits<V, M>(v) == inf);
    cz -= (v == 0);
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  };
  NonfiniteAcc<acc_t> c;
  nonfinite_init<acc_t>(c);
  int64_t i = 0;
  // Lane counters hold at most n / W <= kChunk / W: no int32 lane can wrap.
  for (; i + 2 * W <= n; i += 2 * W) {
    step(cn0, ci0, cz0, mn0, mx0, L::load(p + i));
    step(cn1, ci1, cz1, mn1, mx1, L::load(p + i + W));
  }
  for (; i + W <= n; i += W) step(cn0, ci0, cz0, mn0, mx0, L::load(p + i));
  for (int j = 0; j < W; ++j) {
    c.nan += cn0[j] + cn1[j];
    c.inf += ci0[j] + ci1[j];
    c.zero += cz0[j] + cz1[j];
    const acc_t mn = mn0[j] < mn1[j] ? mn0[j] : mn1[j];
    const acc_t mx = mx0[j] > mx1[j] ? mx0[j] : mx1[j];
    c.mn = mn < c.mn ? mn : c.mn;
    c.mx = mx > c.mx ? mx : c.mx;
  }
  c.n = i;
  for (; i < n; ++i) nonfinite_add<acc_t>(c, static_cast<acc_t>(p[i]));
  return c;
}

// A shift representable in the input dtype: then x - k is exact for x near k, and sums of
// such differences of fp16/bf16 inputs do not pile up k's rounding error.
template <typename scalar_t>
HS_INLINE acc_of<scalar_t> input_shift(double mean) {
  const auto k = static_cast<acc_of<scalar_t>>(static_cast<scalar_t>(mean));
  return k - k == 0 ? k : 0;
}

// What a task carries from chunk to chunk: the previous chunk's mean (the next shift), its scale
// exponent (Note [stats scaling]), and whether a NaN/Inf was seen (Note [stats nonfinite]).
struct TaskState {
  double mean;
  int32_t e;
  bool nonfinite;
};

// The statistics of a whole chunk, always in SIMD: counted only, once its task has seen NaN/Inf;
// otherwise the fast path with the previous chunk's scale and shift, again with a fitting scale when
// the magnitudes call for one (Note [stats scaling]) or a better shift when k was poor. The re-reads
// (from L1) only redo statistics.
template <int B, typename scalar_t>
HS_INLINE StatsPartial chunk_stats(const scalar_t* p, int64_t n, TaskState& st) {
  using acc_t = acc_of<scalar_t>;
  if (st.nonfinite) return nonfinite_to_partial<acc_t>(nonfinite_chunk_simd<B, scalar_t>(p, n));
  int32_t e = st.e;
  CpuAcc<scalar_t> f = fast_chunk<B, scalar_t>(p, n, input_shift<scalar_t>(ldexp(st.mean, -e)), e);
  if (fast_nonfinite<acc_t>(f)) {
    const NonfiniteAcc<acc_t> c = nonfinite_chunk_simd<B, scalar_t>(p, n);
    if (c.nan > 0 || c.inf > 0) {
      st.nonfinite = true;
      return nonfinite_to_partial<acc_t>(c);
    }
    // No NaN/Inf: l1 overflowed (|x| near the dtype's max, or a scale carried over from smaller
    // values): the fitting scale below repairs it.
  }
  const double amax = fast_amax<acc_t>(f);
  if (fast_nonfinite<acc_t>(f) || !scale_fits<acc_t>(amax, e)) {
    // The previous chunk's mean belongs to other magnitudes, and this one's is unreliable (the first
    // pass overflowed or underflowed): no shift; shift_is_poor asks for one more pass if one helps.
    // (A shift near a mean dominated by one large value would add the same -k to every lane sum,
    // each addition rounded the same way at that value's magnitude.)
    e = scale_exponent<acc_t>(amax);
    f = fast_chunk<B, scalar_t>(p, n, acc_t(0), e);
  }
  if (shift_is_poor<acc_t>(f)) f = fast_chunk<B, scalar_t>(p, n, input_shift<scalar_t>(fast_mean<acc_t>(f)), e);
  st.e = e;
  st.mean = ldexp(static_cast<double>(fast_mean<acc_t>(f)), e);
  return fast_to_partial<acc_t>(f);
}

// Note [cpu constant chunks]
// The statistics come first, and they settle the histogram of a chunk whose non-NaN values are all
// equal (min == max; -0.0 and +0.0 compare equal and share every slot) or that is all NaN: its counts
// go to at most two counters at once, with no per-value work. Zeros, dead units, saturated
// activations, a constant on an edge and the all-NaN tensors that follow a first NaN cost the
// statistics alone. Other chunks are binned value by value (bin_chunk).
template <int B, typename scalar_t, int HM>
HS_INLINE StatsPartial fast_chunk_body(const scalar_t* p, int64_t n, TaskState& st, HistCounters* hist,
                                       const BinPlan* hs) {
  const StatsPartial part = chunk_stats<B, scalar_t>(p, n, st);
  if constexpr (HM != kHistNone) {
    if (part.nan == n || (part.mn == part.mx && part.mn == part.mn)) {
      const int64_t others = n - part.nan;
      if (others > 0) hist->c[slot_scalar<HM>(static_cast<scalar_t>(part.mn), *hs)] += static_cast<uint32_t>(others);
      if (part.nan > 0) {
        hist->c[slot_scalar<HM>(static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN()), *hs)] +=
            static_cast<uint32_t>(part.nan);
      }
    } else {
      bin_chunk<B, scalar_t, HM>(p, n, *hist, *hs);
    }
    hist->pending += n;
    if (hist->pending >= (int64_t(1) << 31)) flush_counters(*hist);
  }
  return part;
}

template <typename scalar_t, int HM>
StatsPartial chunk_default(const scalar_t* p, int64_t n, TaskState& k, HistCounters* hist,
                           const BinPlan* hs) {
  return fast_chunk_body<16, scalar_t, HM>(p, n, k, hist, hs);
}

template <typename scalar_t, int HM>
HS_TARGET_AVX2 StatsPartial chunk_avx2(const scalar_t* p, int64_t n, TaskState& k, HistCounters* hist,
                                       const BinPlan* hs) {
  return fast_chunk_body<32, scalar_t, HM>(p, n, k, hist, hs);
}

template <typename scalar_t>
using chunk_fn = StatsPartial (*)(const scalar_t*, int64_t, TaskState&, HistCounters*, const BinPlan*);

template <typename scalar_t>
chunk_fn<scalar_t> pick_chunk_fn(int mode) {
  const bool avx2 = simd::use_avx2();
  switch (mode) {
    case kHistRange: return avx2 ? &chunk_avx2<scalar_t, kHistRange> : &chunk_default<scalar_t, kHistRange>;
    case kHistExp: return avx2 ? &chunk_avx2<scalar_t, kHistExp> : &chunk_default<scalar_t, kHistExp>;
    default: return avx2 ? &chunk_avx2<scalar_t, kHistNone> : &chunk_default<scalar_t, kHistNone>;
  }
}

// The first state of a task, from its first few values: their mean (finite ones; 0 if none) and
// scale exponent, and whether one of them is NaN/Inf.
template <typename scalar_t>
TaskState initial_state(const scalar_t* p, int64_t n) {
  using acc_t = acc_of<scalar_t>;
  double s = 0.0, ss = 0.0, amax = 0.0;
  int64_t m = 0;
  bool nonfinite = false;
  for (int64_t i = 0; i < n && i < 8; ++i) {
    const double v = static_cast<double>(p[i]);
    if (!(v - v == 0.0)) { nonfinite = true; continue; }
    amax = fabs(v) > amax ? fabs(v) : amax;
  }
  int ex = 0;
  frexp(amax, &ex);
  for (int64_t i = 0; i < n && i < 8; ++i) {
    const double y = ldexp(static_cast<double>(p[i]), -ex);  // |y| < 1: no overflow or underflow in y * y
    if (!(y - y == 0.0)) continue;
    s += y;
    ss += y * y;
    ++m;
  }
  // A shift only where the sample says |mean| > its spread: elsewhere 0 is as good, and a mean that
  // one large value dominates is a poor shift for the rest.
  const double mean = m ? s / m : 0.0;
  const double shift = m && mean * mean > ss / m - mean * mean ? ldexp(mean, ex) : 0.0;
  return TaskState{shift, scale_exponent<acc_t>(amax), nonfinite};
}

// Where the histogram goes: hist_len int64 counters, written (accumulate false) or added to.
struct HistOut {
  HistSpec spec;
  int64_t* counts;
  int64_t len;
  bool accumulate;
};

// Note [cpu locations]
// A task's chunks come in increasing logical order, and each chunk's partial has its exact NaN-free
// min and max and its NaN/Inf counts (whichever pass made it). So the task's first largest |x| is in
// the first chunk whose max(-min, max) is the task's largest, and its first NaN/Inf in the first chunk
// that counts one: the task notes those two chunks as it goes (a compare per chunk) and, at its end,
// searches only them again, on the raw bits (|x| == that max: the bits without the sign are equal;
// NaN/Inf: the exponent bits all set), in blocks of 64 that the compiler vectorizes; the first block
// that holds a match is handed to loc_add (core/loc_ops.h, the CUDA kernel's per-element step). So a
// task reads at most two of its chunks a second time (from L2/L3; a strided chunk is gathered again),
// whatever the data. Tasks merge in order (loc_merge): the result does not depend on the thread count.
template <typename scalar_t> struct RawBits;
template <> struct RawBits<float> {
  using U = uint32_t;
  static constexpr U abs = 0x7fffffffu, exp = 0x7f800000u;
};
template <> struct RawBits<double> {
  using U = uint64_t;
  static constexpr U abs = 0x7fffffffffffffffull, exp = 0x7ff0000000000000ull;
};
template <> struct RawBits<c10::Half> {
  using U = uint16_t;
  static constexpr U abs = 0x7fff, exp = 0x7c00;
};
template <> struct RawBits<c10::BFloat16> {
  using U = uint16_t;
  static constexpr U abs = 0x7fff, exp = 0x7f80;
};

constexpr int64_t kLocBlock = 64;

template <typename U, bool NAN_INF>
HS_INLINE bool block_hit(const U* buf, int64_t m, U t) {
  constexpr U mask = static_cast<U>(~(U(1) << (8 * sizeof(U) - 1)));
  U hit = 0;
  for (int64_t j = 0; j < m; ++j) hit |= NAN_INF ? U((buf[j] & mask) >= t) : U((buf[j] & mask) == t);
  return hit != 0;
}

// The first block of kLocBlock elements (from 0) that holds an element whose bits without the sign equal t
// (NAN_INF false) or are >= t (NAN_INF true: t is the exponent mask); -1 when none.
template <typename scalar_t, bool NAN_INF>
HS_INLINE int64_t first_block(const scalar_t* p, int64_t n, typename RawBits<scalar_t>::U t) {
  using U = typename RawBits<scalar_t>::U;
  U buf[kLocBlock];
  int64_t b = 0;
  for (; b + kLocBlock <= n; b += kLocBlock) {
    std::memcpy(buf, p + b, sizeof buf);
    if (block_hit<U, NAN_INF>(buf, kLocBlock, t)) return b;
  }
  if (b < n) {
    std::memcpy(buf, p + b, static_cast<size_t>(n - b) * sizeof(U));
    if (block_hit<U, NAN_INF>(buf, n - b, t)) return b;
  }
  return -1;
}

// Searches one chunk (elements start .. start + n of the tensor, at p) for the first element of |x| == amax
// (when amax >= 0) and for the first NaN/Inf (when nf), into l (Note [cpu locations]).
template <typename scalar_t>
HS_INLINE void search_chunk(const scalar_t* p, int64_t n, int64_t start, double amax, bool nf,
                            LocAcc<acc_of<scalar_t>>& l) {
  using acc_t = acc_of<scalar_t>;
  using U = typename RawBits<scalar_t>::U;
  auto add_block = [&](int64_t b) {
    const int64_t e = std::min(n, b + kLocBlock);
    for (int64_t i = b; i < e; ++i) loc_add<acc_t>(l, static_cast<acc_t>(p[i]), start + i);
  };
  if (amax >= 0.0) {
    const scalar_t t = static_cast<scalar_t>(static_cast<acc_t>(amax));  // exact: a value of the chunk
    U tb;
    std::memcpy(&tb, &t, sizeof tb);
    const int64_t b = first_block<scalar_t, false>(p, n, tb & RawBits<scalar_t>::abs);
    if (b >= 0) add_block(b);
  }
  if (nf) {
    const int64_t b = first_block<scalar_t, true>(p, n, RawBits<scalar_t>::exp);
    if (b >= 0) add_block(b);
  }
}

template <typename scalar_t, bool LOC = false>
StatsPartial stats_partial_cpu(const scalar_t* base, int64_t numel, const StridedLayout& layout, const HistOut& ho,
                               LocPartial* loc_out = nullptr) {
  const int mode = ho.counts != nullptr ? ho.spec.mode : kHistNone;
  const chunk_fn<scalar_t> chunk = pick_chunk_fn<scalar_t>(mode);
  const BinPlan plan = mode != kHistNone ? bin_plan<scalar_t>(ho.spec, numel) : BinPlan{ho.spec, RangeConsts{}, nullptr};
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  const int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>({kMaxTasks, nchunks, numel / kMinTaskElems}));
  const int64_t chunks_per_task = (nchunks + ntasks - 1) / ntasks;
  // Per-thread histogram counters (Note [cpu histogram counters]), cached per calling thread:
  // no allocation once warm.
  const int64_t nthreads = ntasks == 1 ? 1 : at::get_num_threads();
  const int64_t len = ho.len;
  // Counter copies (Note [cpu histogram counters]): 8 (2 for long histograms), fewer for a tensor with fewer values
  // per thread than counters, where zeroing and merging the copies would cost more than the counting itself.
  int copies = len <= 1024 ? 8 : 2;
  while (copies > 1 && numel / nthreads < static_cast<int64_t>(copies) * len) copies /= 2;
  // The caches are all zero between calls (each call zeroes what it used as it reads it out), so a call
  // zeroes nothing up front: a small tensor's histogram costs its counters once, not three times.
  static thread_local std::vector<uint32_t> counter_cache;
  static thread_local std::vector<int64_t> total_cache;
  static thread_local std::vector<HistCounters> counter_refs;
  static thread_local bool caches_zero = true;  // false only after a call that did not finish
  HistCounters* counters = nullptr;
  if (mode != kHistNone) {
    if (!caches_zero) {
      std::fill(counter_cache.begin(), counter_cache.end(), 0u);
      std::fill(total_cache.begin(), total_cache.end(), 0);
    }
    caches_zero = false;
    if (counter_cache.size() < static_cast<size_t>(nthreads * copies * len)) {
      counter_cache.resize(static_cast<size_t>(nthreads * copies * len), 0u);
    }
    if (total_cache.size() < static_cast<size_t>(nthreads * len)) total_cache.resize(static_cast<size_t>(nthreads * len), 0);
    counter_refs.resize(static_cast<size_t>(nthreads));
    counters = counter_refs.data();
    for (int64_t t = 0; t < nthreads; ++t) {
      counters[t] = HistCounters{counter_cache.data() + t * copies * len, total_cache.data() + t * len, len, copies, 0};
    }
  }
  // The lambda below runs on worker threads: it reaches the caches only through `counters`,
  // never through the thread_locals' names (those would be each worker's own, empty, vectors).
  StatsPartial task_partials[kMaxTasks];
  LocPartial task_locs[LOC ? kMaxTasks : 1];
  auto run_task = [&](int64_t t, int64_t thread) {
    StatsPartial acc = empty_partial();
    double best = -1.0;                   // the task's largest |x| so far (Note [cpu locations])
    int64_t best_c = -1, nf_c = -1;       // the first chunk holding it, the first chunk holding a NaN/Inf
    // Float inputs only: their partials hold no double that could be subnormal (products of
    // float magnitudes stay above 2^-298); fp64 keeps gradual underflow.
    const simd::FlushToZero ftz(std::is_same<acc_of<scalar_t>, float>::value);
    alignas(64) scalar_t buf[kChunk];
    TaskState k{0.0, 0, false};
    HistCounters* hist = mode != kHistNone ? &counters[thread] : nullptr;
    // The values of chunk c (gathered into buf when x is not flat) and their count.
    auto chunk_at = [&](int64_t c, int64_t& clen) -> const scalar_t* {
      const int64_t start = c * kChunk;
      clen = std::min(kChunk, numel - start);
      if (layout.ndim == 0) return base + start;
      gather(base, layout, start, clen, buf);
      return buf;
    };
    const int64_t c_end = std::min(nchunks, (t + 1) * chunks_per_task);
    for (int64_t c = t * chunks_per_task; c < c_end; ++c) {
      int64_t clen;
      const scalar_t* p = chunk_at(c, clen);
      if (c == t * chunks_per_task) k = initial_state(p, clen);
      if constexpr (LOC) {
        const StatsPartial cp = chunk(p, clen, k, hist, &plan);
        const double camax = hs_fmax(-cp.mn, cp.mx);  // -inf for an all-NaN chunk
        if (camax > best) {
          best = camax;
          best_c = c;
        }
        if (nf_c < 0 && (cp.nan > 0 || cp.inf > 0)) nf_c = c;
        merge(acc, cp);
      } else {
        merge(acc, chunk(p, clen, k, hist, &plan));
      }
    }
    task_partials[t] = acc;
    if constexpr (LOC) {
      LocAcc<acc_of<scalar_t>> loc;
      loc_init(loc);
      auto search = [&](int64_t c, bool amax, bool nf) {
        int64_t clen;
        const scalar_t* p = chunk_at(c, clen);
        search_chunk(p, clen, c * kChunk, amax ? best : -1.0, nf, loc);
      };
      if (best_c >= 0) search(best_c, true, best_c == nf_c);
      if (nf_c >= 0 && nf_c != best_c) search(nf_c, false, true);
      task_locs[t] = loc_to_partial(loc);
    }
  };
  if (ntasks == 1) {
    run_task(0, 0);
  } else {
    at::parallel_for(0, ntasks, 1, [&](int64_t b, int64_t e) {
      const int64_t thread = std::min<int64_t>(at::get_thread_num(), nthreads - 1);
      for (int64_t t = b; t < e; ++t) run_task(t, thread);
    });
  }
  StatsPartial total = empty_partial();
  for (int64_t t = 0; t < ntasks; ++t) merge(total, task_partials[t]);
  if constexpr (LOC) {
    LocPartial l = empty_loc();
    for (int64_t t = 0; t < ntasks; ++t) loc_merge(l, task_locs[t]);
    *loc_out = l;
  }
  if (mode != kHistNone) {
    for (int64_t t = 0; t < nthreads; ++t) flush_counters(counters[t]);
    int64_t* __restrict__ sum = counters[0].total;
    for (int64_t t = 1; t < nthreads; ++t) {
      int64_t* __restrict__ tt = counters[t].total;
      for (int64_t i = 0; i < len; ++i) sum[i] += tt[i];
      std::memset(tt, 0, static_cast<size_t>(len) * sizeof(int64_t));
    }
    // Note [exact bin thresholds]
    const bool ordinal = mode == kHistRange && (plan.rc.T != nullptr || plan.rc.T64 != nullptr);
    write_counts(sum, len, ordinal, ho.spec.bins, ho.accumulate, ho.counts);
    caches_zero = true;
  }
  return total;
}

void run_cpu(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
             bool accumulate) {
  const bool want_loc = out.loc != nullptr;
  const StridedLayout layout = layout_of(x, want_loc);  // Note [element locations]
  if (out.ring != nullptr && hist != nullptr) hist += ring_slot(out) * out.ring_hist_elems;  // Note [ring rows]
  const HistOut ho{hs, hs.mode == kHistNone ? nullptr : hist, hist_len, accumulate};
  StatsPartial p = empty_partial();
  LocPartial l = empty_loc();
  if (x.numel() == 0) {
    if (ho.counts != nullptr && !accumulate) std::fill(ho.counts, ho.counts + hist_len, 0);
  } else {
    HOOKSTATS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hookstats_stats_cpu", [&] {
      const auto* base = static_cast<const scalar_t*>(first_element(x));
      if (want_loc) p = stats_partial_cpu<scalar_t, true>(base, x.numel(), layout, ho, &l);
      else p = stats_partial_cpu<scalar_t>(base, x.numel(), layout, ho);
    });
  }
  store(p, out);
  if (want_loc) store_loc(l, ring_loc(out));
}

}  // namespace

// The single-tensor runner, for hookstats::stats_multi_into (cpu/multi_stats_cpu.cpp).
void stats_cpu_runner(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
                      bool accumulate) {
  run_cpu(x, out, hs, hist, hist_len, accumulate);
}

// Declared in hookstats.cpp, which defines the op.
std::string cpu_isa(const std::string& mode) {
  TORCH_CHECK_VALUE(mode.empty() || mode == "avx2" || mode == "default",
                    "hookstats._cpu_isa takes '', 'avx2' or 'default', got '", mode, "'");
  if (!mode.empty()) simd::set_use_avx2(mode == "avx2");
  return simd::use_avx2() ? "avx2" : "default";
}

TORCH_LIBRARY_IMPL(hookstats, CPU, m) {
  m.impl("stats", &stats_op<run_cpu>);
  m.impl("stats_into", &stats_into_op<run_cpu>);
  m.impl("stats_hist", &stats_hist_op<run_cpu>);
  m.impl("stats_loc", &stats_loc_op<run_cpu>);
}

}  // namespace hookstats
