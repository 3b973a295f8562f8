// Torch-free per-channel statistics math shared by the CPU and CUDA kernels of
// hookstats::channel_stats and hookstats::channel_stats_into.
//
// Note [channel stats]
// For each index c of the kept dimension ("channel"), over every element x whose index along
// that dimension is c:
//   absmax    max |x| over the finite x (0 when there is none)
//   sum_abs   sum |x| over the finite x
//   sum_sq    sum x^2 over the finite x
//   min, max  over the finite x (+inf / -inf when there is none: the identities of min / max)
//   nonfinite how many x are NaN or +-inf
//   count     how many x there are (finite or not)
// NaN and +-inf are *counted and skipped*, unlike hookstats::stats, which propagates them: these
// statistics accumulate over calls (channel_stats_into, calibration over many batches), where a
// propagated NaN would stick in max/min forever and hide the good batches, while the per-channel
// count says exactly which channels saw a bad value.
// Row layout of a channel_stats_into buffer ([kNumChannelFields, C], float32 or float64) and of
// hookstats.CHANNEL_FIELDS: kAbsmax, kSumAbs, kSumSq, kMin, kMax, kNonfinite, kCount.
// hookstats::channel_stats returns (values [5, C] of the result dtype: absmax..max; counts
// [2, C] int64: nonfinite, count).
//
// Accumulation: a piece (a CPU block of rows or run of one channel, a CUDA thread's share) is
// reduced in the input's accumulation type; sums go into double once per piece (CPU) or are
// accumulated in double directly (CUDA), so float32 results carry float64-grade sums rounded
// once. A CPU piece whose fast result cannot be trusted (a NaN/Inf inside, or magnitudes whose
// float squares would overflow or underflow) is re-read element by element in double: channel_add.
#pragma once

#include <cmath>
#include <cstdint>

#include "stats_ops.h"  // HS_HD, hs_fmin, hs_fmax

namespace hookstats {

enum ChannelField : int {
  kAbsmax = 0, kSumAbs, kSumSq, kChMin, kChMax, kNonfinite, kCount, kNumChannelFields
};
constexpr int kNumChannelValues = 5;  // absmax .. max
constexpr int kNumChannelCounts = 2;  // nonfinite, count

struct ChannelPartial {
  double sum_abs, sum_sq;
  double mn, mx;  // over finite values; absmax = max(0, -mn, mx)
  int64_t nonfinite, count;
};

HS_HD ChannelPartial channel_empty() {
  ChannelPartial p;
  p.sum_abs = 0.0; p.sum_sq = 0.0;
  p.mn = INFINITY; p.mx = -INFINITY;
  p.nonfinite = 0; p.count = 0;
  return p;
}

// One element, exactly (double accumulation): the careful path and the CUDA path.
HS_HD void channel_add(ChannelPartial& p, double v) {
  p.count += 1;
  const double a = fabs(v);
  if (!(a <= 1.7976931348623157e308)) { p.nonfinite += 1; return; }  // NaN fails the comparison too
  p.sum_abs += a;
  p.sum_sq += a * a;
  p.mn = hs_fmin(p.mn, v);
  p.mx = hs_fmax(p.mx, v);
}

HS_HD void channel_merge(ChannelPartial& a, const ChannelPartial& b) {
  a.sum_abs += b.sum_abs;
  a.sum_sq += b.sum_sq;
  a.mn = hs_fmin(a.mn, b.mn);
  a.mx = hs_fmax(a.mx, b.mx);
  a.nonfinite += b.nonfinite;
  a.count += b.count;
}

HS_HD double channel_absmax(const ChannelPartial& p) {
  return hs_fmax(0.0, hs_fmax(-p.mn, p.mx));
}

// Limits of the float fast path (CPU): a piece whose largest finite magnitude m has
// kChannelFastLo <= m <= kChannelFastHi (or m == 0) has float squares that neither overflow
// nor underflow over a piece; others take the careful path.
constexpr float kChannelFastHi = 1.099511627776e12f;   // 2^40
constexpr float kChannelFastLo = 9.094947017729282e-13f;  // 2^-40

// Where a finished kernel writes channel c. Either the outputs of channel_stats (values [5, C]
// in OutT, counts [2, C] int64, both contiguous), or a channel_stats_into buffer (OutT, field f
// of channel c at buf[f * field_stride + c * chan_stride]) whose old contents are combined with p.
struct ChannelOut {
  void* values;     // channel_stats values, or the buffer
  int64_t* counts;  // channel_stats counts; nullptr for a buffer
  int64_t channels;
  int64_t field_stride, chan_stride;  // buffer strides (elements)
  bool out_double;
};

template <typename OutT>
HS_HD void channel_store_typed(const ChannelPartial& p, const ChannelOut& o, int64_t c) {
  OutT* v = static_cast<OutT*>(o.values);
  if (o.counts != nullptr) {
    const int64_t C = o.channels;
    v[kAbsmax * C + c] = static_cast<OutT>(channel_absmax(p));
    v[kSumAbs * C + c] = static_cast<OutT>(p.sum_abs);
    v[kSumSq * C + c] = static_cast<OutT>(p.sum_sq);
    v[kChMin * C + c] = static_cast<OutT>(p.mn);
    v[kChMax * C + c] = static_cast<OutT>(p.mx);
    o.counts[c] = p.nonfinite;
    o.counts[C + c] = p.count;
    return;
  }
  OutT* b = v + c * o.chan_stride;
  const int64_t fs = o.field_stride;
  // Accumulate: max for absmax/max, min for min, sums and counts added. The old values are
  // combined in double (a float64 buffer keeps counts exact to 2^53).
  const double am = channel_absmax(p);
  const double old_am = static_cast<double>(b[kAbsmax * fs]);
  b[kAbsmax * fs] = static_cast<OutT>(am > old_am ? am : old_am);
  b[kSumAbs * fs] = static_cast<OutT>(static_cast<double>(b[kSumAbs * fs]) + p.sum_abs);
  b[kSumSq * fs] = static_cast<OutT>(static_cast<double>(b[kSumSq * fs]) + p.sum_sq);
  const double old_mn = static_cast<double>(b[kChMin * fs]);
  const double old_mx = static_cast<double>(b[kChMax * fs]);
  b[kChMin * fs] = static_cast<OutT>(p.mn < old_mn ? p.mn : old_mn);
  b[kChMax * fs] = static_cast<OutT>(p.mx > old_mx ? p.mx : old_mx);
  b[kNonfinite * fs] = static_cast<OutT>(static_cast<double>(b[kNonfinite * fs]) + static_cast<double>(p.nonfinite));
  b[kCount * fs] = static_cast<OutT>(static_cast<double>(b[kCount * fs]) + static_cast<double>(p.count));
}

HS_HD void channel_store(const ChannelPartial& p, const ChannelOut& o, int64_t c) {
  if (o.out_double) channel_store_typed<double>(p, o, c);
  else channel_store_typed<float>(p, o, c);
}

// How a channel_stats input is read (Note [channel layouts]).
//
// Note [channel layouts]
// x is seen as channels c in [0, C) at stride `cstride` (elements), and "rows" r in [0, M) of the
// other dimensions, described by the coalesced StridedLayout `rest` (flat when they fill a dense
// block with unit inner stride). Element (r, c) is at offset element_offset(rest, r) + c * cstride.
// Kernels pick one of two orders:
//   rows  (channel-innermost, e.g. [B, T, C] with dim=-1, NHWC with dim=1): each row's channels
//         are read together and update per-channel accumulators;
//   runs  (channel-outer, e.g. NCHW with dim=1): each channel's elements are reduced on their own,
//         along the contiguous runs of `rest`.
// Empty channels (M == 0) get the identities: absmax/sums/counts 0, min +inf, max -inf.

}  // namespace hookstats
