// Torch-free histogram binning shared by the CPU and CUDA kernels.
//
// Note [histogram layouts]
// Fixed range (mode kHistRange), bins + 3 int64 counts:
//   [0, bins)  the bins of [lo, hi]: bin = floor((x - lo) * bins / (hi - lo)) evaluated in
//              float64 exactly as torch.histc evaluates it for a float64 input, and x == hi
//              in the last bin (torch.histc's rule);
//   bins       underflow, x < lo (-inf included);
//   bins + 1   overflow, x > hi (+inf included);
//   bins + 2   NaN.
// Nothing is dropped: the counts sum to numel.
// Exponent (mode kHistExp), read from the bits of the input dtype (E exponent bits, bias
// 2^(E-1) - 1, normal exponents emin = 1 - bias .. emax = bias, nE = 2^E - 2 of them):
//   [0, nE)        negative normals, index = floor(log2|x|) - emin
//   [nE, 2 nE)     positive normals, likewise
//   2nE + 0 .. 5   negative subnormal, positive subnormal, zero (+0 and -0), -inf, +inf, NaN.
// float32/bfloat16: 514 counts, float16: 66, float64: 4098. hookstats/_types.py (hist_length) mirrors this.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "stats_ops.h"  // HS_HD

namespace hookstats {

enum HistMode : int { kHistNone = 0, kHistRange = 1, kHistExp = 2 };

constexpr int64_t kMaxHistBins = 8192;

struct HistSpec {
  int32_t mode;
  int32_t bins;
  double lo, hi;
  // t = x * scale + shift approximates (x - lo) * bins / (hi - lo) in the accumulation type;
  // fixed_slot() falls back to the exact float64 formula when t is near an integer.
  double scale, shift;
  float scale_f, shift_f;
  int32_t float_ok;  // scale_f is a normal float and shift_f finite: the float transform is accurate
  // The exact thresholds T[0..bins] of Note [exact bin thresholds], where a kernel has them (the
  // CUDA kernel points T at its shared-memory copy or at a device table, T64 at a device table of
  // float64 thresholds, Note [capture-safe tables]); nullptr otherwise.
  const float* T;
  const double* T64;
};

inline HistSpec make_hist_spec(int mode, int64_t bins, double lo, double hi) {
  HistSpec h;
  h.mode = mode;
  h.bins = static_cast<int32_t>(bins);
  h.lo = lo;
  h.hi = hi;
  h.scale = mode == kHistRange ? static_cast<double>(bins) / (hi - lo) : 0.0;
  h.shift = -lo * h.scale;
  h.scale_f = static_cast<float>(h.scale);
  h.shift_f = static_cast<float>(h.shift);
  h.float_ok = h.scale_f >= 1.1754943508222875e-38f && h.scale_f < 3.0e38f && h.shift_f > -1e30f &&
               h.shift_f < 1e30f;
  h.T = nullptr;
  h.T64 = nullptr;
  return h;
}

// torch.histc's rule on float64 values.
HS_HD int32_t fixed_slot_exact(double x, const HistSpec& h) {
  if (x != x) return h.bins + 2;
  if (x < h.lo) return h.bins;
  if (x > h.hi) return h.bins + 1;
  int64_t pos = static_cast<int64_t>((x - h.lo) * static_cast<double>(h.bins) / (h.hi - h.lo));
  if (pos >= h.bins) pos = h.bins - 1;
  if (pos < 0) pos = 0;
  return static_cast<int32_t>(pos);
}

template <typename acc_t> struct BinTolerance;
template <> struct BinTolerance<float> { static constexpr float rel = 4.76837158203125e-07f; };   // 2^-21
template <> struct BinTolerance<double> { static constexpr double rel = 8.881784197001252e-16; };  // 2^-50

// The fixed-range slot of x: one fused multiply-add in acc_t, exact for every x (the band
// covers the rounding of scale, shift and t; inside it the float64 formula decides).
template <typename acc_t>
HS_HD int32_t fixed_slot(acc_t x, const HistSpec& h) {
  if (x != x) return h.bins + 2;
  if (sizeof(acc_t) == 4 && !h.float_ok) return fixed_slot_exact(static_cast<double>(x), h);
  const acc_t scale = sizeof(acc_t) == 4 ? static_cast<acc_t>(h.scale_f) : static_cast<acc_t>(h.scale);
  const acc_t shift = sizeof(acc_t) == 4 ? static_cast<acc_t>(h.shift_f) : static_cast<acc_t>(h.shift);
  const acc_t xs = x * scale;
  const acc_t t = xs + shift;
  const acc_t fl = floor(t);
  const acc_t ax = xs < acc_t(0) ? -xs : xs;
  const acc_t as = shift < acc_t(0) ? -shift : shift;
  const acc_t at = t < acc_t(0) ? -t : t;
  const acc_t band = (ax + as + at + acc_t(1)) * BinTolerance<acc_t>::rel;
  if (t - fl > band && fl + acc_t(1) - t > band) {  // false for +-inf (NaN differences)
    if (fl < acc_t(0)) return h.bins;
    if (fl >= static_cast<acc_t>(h.bins)) return h.bins + 1;
    return static_cast<int32_t>(fl);
  }
  return fixed_slot_exact(static_cast<double>(x), h);
}

// Note [exact bin thresholds]
// A value's place among the range histogram's slots, in order: its ordinal is 0 for underflow,
// 1 + bin for [lo, hi], bins + 1 for overflow (NaN has none). fixed_slot_exact is monotone in x,
// so for each m in [0, bins] there is a smallest float T[m] with ordinal(x) > m exactly when
// x >= T[m] (T[0] is the first float >= lo, T[bins] the first float > hi). The kernels compute
// the float transform t = x * scale + shift, take the nearest integer r of t clamped to
// [0, bins], and get ordinal = r + (x >= T[r]) (threshold_ordinal): right for every float x, on an
// edge or not, as long as t is within 1/2 of the exact float64 value (band_max < 1/4,
// thresholds_apply), since the true ordinal is then r or r + 1. One gather and one compare per
// value replace the per-value float64 fallback near edges. Counters are indexed by ordinal (NaN:
// bins + 2) and mapped back to Note [histogram layouts] slots when they are written out.
// The table is built on the host by bisection on fixed_slot_exact (the float64 rule itself) and
// cached per range (cached_thresholds). Float64 inputs get a table of doubles, transformed in double.
// The CPU reads them in place. The CUDA kernel gets the float ones by value in its arguments
// (capture-safe: a replayed graph carries them) for up to kMaxArgThresholds - 1 bins, and a
// device copy for float64 inputs and for more bins (Note [capture-safe tables] in
// cuda/device_tables.cuh); each block stages them in shared memory (Note [thresholds in shared
// memory] in cuda/kernels/stats_launch.h); it keeps fixed_slot only where no thresholds apply.
constexpr int32_t kMaxArgThresholds = 513;  // 2 KB of kernel arguments: up to 512 bins

HS_HD int32_t ordinal_of_slot(int32_t slot, int32_t bins) {
  return slot == bins ? 0 : (slot < bins ? slot + 1 : slot);
}
HS_HD int32_t slot_of_ordinal(int32_t o, int32_t bins) { return o == 0 ? bins : (o <= bins ? o - 1 : o); }

// An upper bound of |t - t_exact| for the transform t = x * scale + shift in F (float: scale_f and
// shift_f; double: scale and shift) with t in [-1.5, bins + 1.5] (fixed_slot's band, bounded once for
// the whole range; |x * scale| <= |t| + |shift|). Infinite or NaN when the transform is unusable.
template <typename F>
inline double threshold_band(const HistSpec& h) {
  const double tmax = h.bins + 1.5;
  const double shift = sizeof(F) == 4 ? std::fabs(static_cast<double>(h.shift_f)) : std::fabs(h.shift);
  return (2.0 * tmax + 2.0 * shift + 1.0) * static_cast<double>(BinTolerance<F>::rel);
}

// Whether Note [exact bin thresholds] applies to a range spec for inputs transformed in F (float:
// fp32, fp16, bf16; double: fp64): the transform is accurate to well within 1/2 everywhere.
template <typename F>
inline bool thresholds_apply(const HistSpec& h) {
  if (h.mode != kHistRange || (sizeof(F) == 4 && !h.float_ok)) return false;
  const double band = threshold_band<F>(h);
  return std::isfinite(band) && band < 0.25;
}

// The ordinal of a value v transformed in F (Note [exact bin thresholds]): r = the nearest integer of
// t clamped to [0, bins], then r + (v >= T[r]); NaN gets bins + 2. The CPU kernel computes the same in
// SIMD lanes (slot_lanes, slot_lanes_f64 in cpu/stats_cpu.cpp); this is its scalar tail and the CUDA
// kernel's per-value rule (F = float, and F = double for float64 inputs).
template <typename F>
HS_HD int32_t threshold_ordinal(F v, const HistSpec& h, const F* T) {
  if (v != v) return h.bins + 2;
  const F scale = sizeof(F) == 4 ? static_cast<F>(h.scale_f) : static_cast<F>(h.scale);
  const F shift = sizeof(F) == 4 ? static_cast<F>(h.shift_f) : static_cast<F>(h.shift);
  const F t = v * scale + shift;
  F tc = t > F(0) ? t : F(0);
  const F fb = static_cast<F>(h.bins);
  tc = tc < fb ? tc : fb;
  const int32_t r = static_cast<int32_t>(tc + F(0.5));  // tc >= 0: truncation of tc + 1/2 rounds
  return r + (v >= T[r] ? 1 : 0);
}

// Floats or doubles in order as unsigned keys (-0.0 just below +0.0), and back.
template <typename F> struct OrderKey;
template <> struct OrderKey<float> { using U = uint32_t; };
template <> struct OrderKey<double> { using U = uint64_t; };
template <typename F>
inline typename OrderKey<F>::U order_key(F f) {
  using U = typename OrderKey<F>::U;
  constexpr U sign = U(1) << (8 * sizeof(U) - 1);
  U b;
  std::memcpy(&b, &f, sizeof b);
  return (b & sign) ? ~b : (b | sign);
}
template <typename F>
inline F key_value(typename OrderKey<F>::U k) {
  using U = typename OrderKey<F>::U;
  constexpr U sign = U(1) << (8 * sizeof(U) - 1);
  const U b = (k & sign) ? (k & ~sign) : ~k;
  F f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// Fills T[0..bins] as Note [exact bin thresholds] defines them, by bisection over the finite values
// of F (T[m] can lie far from the float64 edge: with lo = -4, every x > -2^-51 has x - lo == 4 in
// float64, so T of the edge at 0 is about -4.4e-16). False when a threshold is not a finite F (then
// the caller keeps fixed_slot).
template <typename F>
inline bool exact_thresholds(const HistSpec& h, F* T) {
  using U = typename OrderKey<F>::U;
  const int32_t bins = h.bins;
  auto ord = [&](U k) { return ordinal_of_slot(fixed_slot_exact(static_cast<double>(key_value<F>(k)), h), bins); };
  const F big = std::numeric_limits<F>::max();
  const U kmin = order_key<F>(-big), kmax = order_key<F>(big);
  for (int32_t m = 0; m <= bins; ++m) {
    const double edge = m == bins ? h.hi : h.lo + (h.hi - h.lo) * static_cast<double>(m) / static_cast<double>(bins);
    const F g = static_cast<F>(edge);
    if (!(g - g == F(0))) return false;
    // Bracket: ord(lo_k) <= m < ord(hi_k), widening by doubling steps in key space.
    U lo_k = order_key<F>(g), hi_k = lo_k;
    uint64_t step = 1;
    while (ord(hi_k) <= m) {
      if (hi_k == kmax) return false;
      lo_k = hi_k;
      hi_k = static_cast<U>(kmax - hi_k > step ? hi_k + step : kmax);
      step *= 2;
    }
    step = 1;
    while (lo_k == hi_k || ord(lo_k) > m) {
      if (lo_k == kmin) return false;
      hi_k = lo_k;
      lo_k = static_cast<U>(lo_k - kmin > step ? lo_k - step : kmin);
      step *= 2;
    }
    while (hi_k - lo_k > 1) {  // ord(lo_k) <= m < ord(hi_k)
      const U mid = lo_k + (hi_k - lo_k) / 2;
      if (ord(mid) > m) hi_k = mid; else lo_k = mid;
    }
    T[m] = key_value<F>(hi_k);
  }
  return true;
}

// Per-range tables of the calling host thread: the last N (bins, lo, hi) seen, each built once
// (build(vector&) fills it and says whether the table exists), so no allocation and no work per call
// once warm. A returned pointer stays valid until its range is evicted by N newer ones.
template <typename T, int N>
struct RangeCache {
  struct Entry {
    double lo = 0.0, hi = 0.0;
    int32_t bins = -1;
    bool ok = false;
    std::vector<T> data;
  };
  Entry e[N];
  int next = 0;
  template <typename Build>
  const T* get(const HistSpec& h, Build&& build) {
    for (Entry& en : e) {
      if (en.bins == h.bins && en.lo == h.lo && en.hi == h.hi) return en.ok ? en.data.data() : nullptr;
    }
    Entry& en = e[next];
    next = (next + 1) % N;
    en.ok = build(en.data);
    en.bins = h.bins;
    en.lo = h.lo;
    en.hi = h.hi;
    return en.ok ? en.data.data() : nullptr;
  }
};

constexpr int kRangeCacheEntries = 4;

// The thresholds (in F) of a range spec (Note [exact bin thresholds]), cached per calling thread;
// nullptr when they do not apply. The CPU kernel reads them in place; the CUDA kernel receives a copy
// of the float ones in its arguments (cuda/stats_cuda.cu, Note [thresholds in shared memory]) or in a device table (cuda/device_tables.cu).
template <typename F>
inline const F* cached_thresholds(const HistSpec& h) {
  static thread_local RangeCache<F, kRangeCacheEntries> cache;
  if (!thresholds_apply<F>(h)) return nullptr;
  return cache.get(h, [&](std::vector<F>& T) {
    T.resize(static_cast<size_t>(h.bins) + 1);
    return exact_thresholds<F>(h, T.data());
  });
}

// Note [16-bit ordinal tables]
// An fp16 or bf16 input has 65,536 values, so its range ordinals (Note [exact bin thresholds]) can
// be tabulated once per range (and its exponent slots once, exp_slot_lut): the CPU kernel then places a value by one load, lut[bits], with no
// arithmetic and no edge case (the rule is threshold_ordinal on the value widened to float, exact,
// which is what the CUDA kernel evaluates per value). 128 KB per table; a spread input touches a few
// KB of it. A thread keeps the tables of its last kRangeCacheEntries ranges per dtype, so a
// Monitor's one range costs one build (~0.1 ms) per calling thread.

// E = 5 (fp16) or 8 (bf16) exponent bits: the float value of 16 raw bits.
template <int E>
inline float half_bits_to_float(uint16_t b) {
  uint32_t w;
  if (E == 8) {
    w = static_cast<uint32_t>(b) << 16;
  } else {
    const uint32_t sign = static_cast<uint32_t>(b & 0x8000u) << 16;
    const uint32_t e = (b >> 10) & 0x1fu, m = b & 0x3ffu;
    if (e == 0x1fu) {
      w = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
      w = sign | ((e + 112u) << 23) | (m << 13);
    } else {
      float f = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
      std::memcpy(&w, &f, 4);
      w |= sign;
    }
  }
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// The ordinal table of a range spec for 16-bit inputs with E exponent bits (E = 5 fp16, 8 bf16),
// cached per calling thread; nullptr when Note [exact bin thresholds] does not apply.
template <int E>
inline const uint16_t* cached_ordinal_lut(const HistSpec& h) {
  static thread_local RangeCache<uint16_t, kRangeCacheEntries> cache;
  if (!thresholds_apply<float>(h)) return nullptr;
  return cache.get(h, [&](std::vector<uint16_t>& lut) {
    const float* T = cached_thresholds<float>(h);
    if (T == nullptr) return false;
    lut.resize(65536);
    for (uint32_t b = 0; b < 65536u; ++b) {
      lut[b] = static_cast<uint16_t>(threshold_ordinal(half_bits_to_float<E>(static_cast<uint16_t>(b)), h, T));
    }
    return true;
  });
}

// Exponent histogram slot from the raw bits of a value with E exponent and M mantissa bits.
template <int E, int M, typename bits_t>
HS_HD int32_t exp_slot(bits_t bits) {
  constexpr int32_t nE = (1 << E) - 2;
  constexpr bits_t exp_mask = static_cast<bits_t>((static_cast<uint64_t>(1) << E) - 1);
  const bool neg = (bits >> (E + M)) & 1;
  const int32_t e = static_cast<int32_t>((bits >> M) & exp_mask);
  const bits_t mant = bits & static_cast<bits_t>((static_cast<uint64_t>(1) << M) - 1);
  if (e == static_cast<int32_t>(exp_mask)) return mant ? 2 * nE + 5 : (neg ? 2 * nE + 3 : 2 * nE + 4);
  if (e == 0) return mant ? (neg ? 2 * nE : 2 * nE + 1) : 2 * nE + 2;
  return (neg ? 0 : nE) + e - 1;
}

template <int E>
constexpr int64_t exp_hist_length() { return 2 * ((1 << E) - 2) + 6; }

// The exponent slots of every 16-bit pattern (E exponent and M mantissa bits), built once per process:
// Note [16-bit ordinal tables] for the exponent histogram.
template <int E, int M>
inline const uint16_t* exp_slot_lut() {
  static const std::vector<uint16_t> lut = [] {
    std::vector<uint16_t> t(65536);
    for (uint32_t b = 0; b < 65536u; ++b) t[b] = static_cast<uint16_t>(exp_slot<E, M>(static_cast<uint16_t>(b)));
    return t;
  }();
  return lut.data();
}

}  // namespace hookstats
