// The per-channel statistics kernel's task bodies (Note [channel stats], Note [channel layouts]), written once over
// B-byte vectors and compiled per ISA into the entry points of cpu/channel_chunk_{default,avx2,avx512}.cpp
// (Note [cpu dispatch]); cpu/channel_cpu.cpp splits the work into tasks and picks the table at run time.
//
// Rows order (channels innermost): a task owns a tile of kChanTile channels and a group of rows.
// It reads kRowBlock rows at a time; each SIMD vector of W channels is reduced over the block's
// rows in registers (abs, add, fma, min, max: five operations per vector of values), then the
// block's float sums are added into the tile's double accumulators. Runs order (channel outer):
// a task owns one channel and a group of its rows, reduced along the contiguous runs (strided
// runs are gathered into a stack buffer first) in blocks of kRunBlock values. A block whose float
// result cannot be trusted (NaN/Inf, magnitudes outside [2^-40, 2^40]) is re-read in double by
// channel_add. Task counts depend only on the shape: results do not depend on the thread count.
// Across levels, per channel: min, max, absmax, the non-finite count and the count are the same bits (min_of / max_of
// keep the `a < b ? a : b` rule on every level); sums differ in rounding only (the runs order's lane split and the
// rows order's vector tail, which channel_add reads in double, depend on the vector width).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../core/channel_bindings.h"
#include "../core/channel_ops.h"
#include "../core/layout.h"
#include "cpu_common.h"
#include "simd.h"

namespace hookstats {
namespace channel_cpu {

constexpr int64_t kRowBlock = 32;    // rows per float block (rows order): float sums of <= 32 values
// Channels per task tile (rows order): the tile's block accumulators (4 KB for float) and four rows of it stay in
// L1 (whole rows of 1024 channels measured 1.6x slower: accumulators and rows then thrash L1).
template <typename acc_t> constexpr int64_t kChanTile = 256;
constexpr int64_t kGatherTile = 128; // channels per tile when they are gathered (a 32 KB stack tile)
constexpr int64_t kRunBlock = 512;   // values per float block (runs order)
constexpr int64_t kGather = 4096;    // gather buffer (runs order)
constexpr int64_t kMaxTasks = 64;
constexpr int64_t kMinTaskElems = 32768;

template <typename acc_t> struct ChanLimits;
template <> struct ChanLimits<float> {
  static constexpr float hi = kChannelFastHi;
  static constexpr float lo = kChannelFastLo;
};
template <> struct ChanLimits<double> {  // double squares: no wider type to fall back to
  static constexpr double hi = std::numeric_limits<double>::max();
  static constexpr double lo = 0.0;
};

template <typename V>
HS_INLINE V load_acc(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename V>
HS_INLINE void store_acc(void* p, const V& v) { std::memcpy(p, &v, sizeof v); }

// Running accumulators of one rows-order task's channel tile.
template <typename acc_t>
struct TileAcc {
  double sum_abs[kChanTile<acc_t>];
  double sum_sq[kChanTile<acc_t>];
  alignas(64) acc_t mn[kChanTile<acc_t>];
  alignas(64) acc_t mx[kChanTile<acc_t>];
  int64_t nonfinite[kChanTile<acc_t>];

  void init(int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      sum_abs[j] = sum_sq[j] = 0.0;
      mn[j] = static_cast<acc_t>(INFINITY);
      mx[j] = -static_cast<acc_t>(INFINITY);
      nonfinite[j] = 0;
    }
  }
  void add(int64_t j, const ChannelPartial& q) {
    sum_abs[j] += q.sum_abs;
    sum_sq[j] += q.sum_sq;
    if (q.mn < static_cast<double>(mn[j])) mn[j] = static_cast<acc_t>(q.mn);  // q.mn is an input value
    if (q.mx > static_cast<double>(mx[j])) mx[j] = static_cast<acc_t>(q.mx);
    nonfinite[j] += q.nonfinite;
  }
};

// The lanes of a block whose float results cannot be trusted, as bits (lane l: bit l): a sum that is not finite
// (NaN/Inf in the lane, or an overflow), or an absmax am outside the fast path's [lo, hi] other than 0. At 64 bytes the
// compares go to mask registers (GCC 12 builds the `&` / `|` of 64-byte compares lane by lane: simd::select);
// the predicates are the negations of sa - sa == 0, am <= hi, am >= lo and am == 0, NaN counted as untrusted.
template <int B, typename acc_t, typename V, typename M>
HS_INLINE uint32_t untrusted_lanes(const V& sa, const V& am) {
  constexpr acc_t hi = ChanLimits<acc_t>::hi, lo = ChanLimits<acc_t>::lo;
#if HS_X86_BUILTINS
  if constexpr (B == 64 && sizeof(acc_t) == 4) {
    using simd::k16::cmp;
    const V f = sa - sa;
    // _CMP_NEQ_UQ 4, _CMP_NLE_UQ 6, _CMP_NGE_UQ 9
    return cmp<4>(f, V{}) | cmp<6>(am, V{} + hi) | (cmp<9>(am, V{} + lo) & cmp<4>(am, V{}));
  }
  if constexpr (B == 64 && sizeof(acc_t) == 8) {
    const V f = sa - sa;
    const auto c = [](const V& a, const V& b, auto p) {
      return static_cast<uint32_t>(__builtin_ia32_cmppd512_mask(a, b, decltype(p)::value, (unsigned char)0xFF, 4));
    };
    using P4 = std::integral_constant<int, 4>;
    return c(f, V{}, P4{}) | c(am, V{} + hi, std::integral_constant<int, 6>{}) |
           (c(am, V{} + lo, std::integral_constant<int, 9>{}) & c(am, V{}, P4{}));
  }
#endif
  constexpr int W = sizeof(V) / sizeof(acc_t);
  const M ok = ((sa - sa) == 0) & (am <= hi) & ((am >= lo) | (am == 0));
  const M bad = (ok == 0);
  if (!simd::any_lane_of<B>(bad)) return 0;
  uint32_t bits = 0;
  for (int l = 0; l < W; ++l) bits |= static_cast<uint32_t>(bad[l] != 0) << l;
  return bits;
}

// Adds one block's float results of W channels (lanes of sa, sq, mn, mx over nrows rows) into the tile
// at channel j (the sums widened to double lanes); lanes that cannot be trusted are re-read in double.
template <int B, typename scalar_t, typename V, typename M>
HS_INLINE void rows_flush(const scalar_t* const* rowp, int64_t nrows, int64_t j, const V& sa, const V& sq,
                          const V& mn, const V& mx, TileAcc<acc_of<scalar_t>>& t) {
  using acc_t = acc_of<scalar_t>;
  constexpr int W = sizeof(V) / sizeof(acc_t);
  using DV = typename simd::F64Lanes<W>::type;
  const V nmn = -mn;
  const uint32_t bad = untrusted_lanes<B, acc_t, V, M>(sa, simd::max_of<B>(nmn, mx));
  if (bad == 0) {
    store_acc<DV>(t.sum_abs + j, load_acc<DV>(t.sum_abs + j) + __builtin_convertvector(sa, DV));
    store_acc<DV>(t.sum_sq + j, load_acc<DV>(t.sum_sq + j) + __builtin_convertvector(sq, DV));
    const V omn = load_acc<V>(t.mn + j), omx = load_acc<V>(t.mx + j);
    store_acc<V>(t.mn + j, simd::min_of<B>(mn, omn));
    store_acc<V>(t.mx + j, simd::max_of<B>(mx, omx));
    return;
  }
  for (int l = 0; l < W; ++l) {
    ChannelPartial q = channel_empty();
    if ((bad >> l) & 1u) {
      for (int64_t i = 0; i < nrows; ++i) channel_add(q, static_cast<double>(rowp[i][j + l]));
    } else {
      q.sum_abs = sa[l]; q.sum_sq = sq[l]; q.mn = mn[l]; q.mx = mx[l];
    }
    t.add(j + l, q);
  }
}

// One block of rows: rowp[i] points at the tile's first channel in row i, channels at unit stride.
// The block is read row by row (four rows at a time, each walked forward: streams the prefetchers
// follow), into float accumulators of the whole tile kept in L1; four rows are combined in a tree
// before they reach the accumulators. Then the block is flushed into the tile's double sums.
template <int B, typename scalar_t>
HS_INLINE void rows_block(const scalar_t* const* rowp, int64_t nrows, int64_t nch, TileAcc<acc_of<scalar_t>>& t) {
  HS_LANE_TYPES(scalar_t, B);
  const int64_t nvec = nch / W;
  alignas(64) acc_t bsa[kChanTile<acc_t>], bsq[kChanTile<acc_t>], bmn[kChanTile<acc_t>], bmx[kChanTile<acc_t>];
  if (nvec > 0) {
    const V inf = V{} + static_cast<acc_t>(INFINITY);
    for (int64_t k = 0; k < nvec * W; k += W) {
      store_acc<V>(bsa + k, V{}); store_acc<V>(bsq + k, V{});
      store_acc<V>(bmn + k, inf); store_acc<V>(bmx + k, -inf);
    }
    int64_t i = 0;
    for (; i + 4 <= nrows; i += 4) {
      const scalar_t* r0 = rowp[i];
      const scalar_t* r1 = rowp[i + 1];
      const scalar_t* r2 = rowp[i + 2];
      const scalar_t* r3 = rowp[i + 3];
      for (int64_t k = 0; k < nvec * W; k += W) {
        const V v0 = L::load(r0 + k), v1 = L::load(r1 + k), v2 = L::load(r2 + k), v3 = L::load(r3 + k);
        const V a0 = simd::abs_bits<V, M>(v0), a1 = simd::abs_bits<V, M>(v1);
        const V a2 = simd::abs_bits<V, M>(v2), a3 = simd::abs_bits<V, M>(v3);
        const V l01 = simd::min_of<B>(v0, v1), l23 = simd::min_of<B>(v2, v3);
        const V h01 = simd::max_of<B>(v0, v1), h23 = simd::max_of<B>(v2, v3);
        const V l = simd::min_of<B>(l01, l23), h = simd::max_of<B>(h01, h23);
        const V mn = load_acc<V>(bmn + k), mx = load_acc<V>(bmx + k);
        store_acc<V>(bsa + k, load_acc<V>(bsa + k) + ((a0 + a1) + (a2 + a3)));
        store_acc<V>(bsq + k, load_acc<V>(bsq + k) + ((a0 * a0 + a1 * a1) + (a2 * a2 + a3 * a3)));
        store_acc<V>(bmn + k, simd::min_of<B>(l, mn));
        store_acc<V>(bmx + k, simd::max_of<B>(h, mx));
      }
    }
    for (; i < nrows; ++i) {
      const scalar_t* r0 = rowp[i];
      for (int64_t k = 0; k < nvec * W; k += W) {
        const V v = L::load(r0 + k);
        const V a = simd::abs_bits<V, M>(v);
        const V mn = load_acc<V>(bmn + k), mx = load_acc<V>(bmx + k);
        store_acc<V>(bsa + k, load_acc<V>(bsa + k) + a);
        store_acc<V>(bsq + k, load_acc<V>(bsq + k) + a * a);
        store_acc<V>(bmn + k, simd::min_of<B>(v, mn));
        store_acc<V>(bmx + k, simd::max_of<B>(v, mx));
      }
    }
    for (int64_t k = 0; k < nvec * W; k += W) {
      rows_flush<B, scalar_t, V, M>(rowp, nrows, k, load_acc<V>(bsa + k), load_acc<V>(bsq + k), load_acc<V>(bmn + k),
                                    load_acc<V>(bmx + k), t);
    }
  }
  for (int64_t j = nvec * W; j < nch; ++j) {
    ChannelPartial q = channel_empty();
    for (int64_t i = 0; i < nrows; ++i) channel_add(q, static_cast<double>(rowp[i][j]));
    t.add(j, q);
  }
}

struct RowsTask {
  int64_t c0, nch, r0, r1;
};

// A rows-order task: channels [c0, c0 + nch) of rows [r0, r1), into partials[c] (c relative to c0).
template <int B, typename scalar_t>
HS_INLINE void rows_task_body(const ChannelView& v, const RowsTask& task, ChannelPartial* partials) {
  using acc_t = acc_of<scalar_t>;
  const scalar_t* base = static_cast<const scalar_t*>(v.data);
  TileAcc<acc_t> t;
  t.init(task.nch);
  const bool gather = v.cstride != 1;
  const scalar_t* rowp[kRowBlock];
  alignas(64) scalar_t tile[kRowBlock * kGatherTile];  // rows gathered when channels are strided
  for (int64_t r = task.r0; r < task.r1; r += kRowBlock) {
    const int64_t n = std::min(kRowBlock, task.r1 - r);
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* p = base + element_offset(v.rest, r + i) + task.c0 * v.cstride;
      if (gather) {
        scalar_t* dst = tile + i * kGatherTile;
        for (int64_t c = 0; c < task.nch; ++c) dst[c] = p[c * v.cstride];
        p = dst;
      }
      rowp[i] = p;
    }
    rows_block<B, scalar_t>(rowp, n, task.nch, t);
  }
  for (int64_t j = 0; j < task.nch; ++j) {
    ChannelPartial& q = partials[j];
    q.sum_abs = t.sum_abs[j];
    q.sum_sq = t.sum_sq[j];
    q.mn = static_cast<double>(t.mn[j]);
    q.mx = static_cast<double>(t.mx[j]);
    q.nonfinite = t.nonfinite[j];
    q.count = task.r1 - task.r0;
  }
}

// kRunBlock-sized blocks of one contiguous span, merged into q.
template <int B, typename scalar_t>
HS_INLINE void span_body(const scalar_t* p, int64_t n, ChannelPartial& q) {
  HS_LANE_TYPES(scalar_t, B);
  const V inf = V{} + static_cast<acc_t>(INFINITY);
  int64_t i = 0;
  while (i < n) {
    const int64_t end = std::min(n, i + kRunBlock);
    const int64_t start = i;
    // Four vectors per step, summed in a tree before they reach the accumulators: the loop-carried chains
    // are one add per four vectors.
    V sa0{}, sq0{}, mn0 = inf, mx0 = -inf;
    for (; i + 4 * W <= end; i += 4 * W) {
      const V v0 = L::load(p + i), v1 = L::load(p + i + W), v2 = L::load(p + i + 2 * W), v3 = L::load(p + i + 3 * W);
      const V a0 = simd::abs_bits<V, M>(v0), a1 = simd::abs_bits<V, M>(v1);
      const V a2 = simd::abs_bits<V, M>(v2), a3 = simd::abs_bits<V, M>(v3);
      sa0 += (a0 + a1) + (a2 + a3);
      sq0 += (a0 * a0 + a1 * a1) + (a2 * a2 + a3 * a3);
      const V l01 = simd::min_of<B>(v0, v1), l23 = simd::min_of<B>(v2, v3);
      const V h01 = simd::max_of<B>(v0, v1), h23 = simd::max_of<B>(v2, v3);
      const V l = simd::min_of<B>(l01, l23), h = simd::max_of<B>(h01, h23);
      mn0 = simd::min_of<B>(l, mn0);
      mx0 = simd::max_of<B>(h, mx0);
    }
    for (; i + W <= end; i += W) {
      const V v0 = L::load(p + i);
      const V a0 = simd::abs_bits<V, M>(v0);
      sa0 += a0; sq0 += a0 * a0; mn0 = simd::min_of<B>(v0, mn0); mx0 = simd::max_of<B>(v0, mx0);
    }
    acc_t sa = 0, sq = 0, mn = static_cast<acc_t>(INFINITY), mx = -static_cast<acc_t>(INFINITY);
    if constexpr (B == 64 && sizeof(acc_t) == 4) {
      // A float run of a [N, C, 16, 16] activation is 4 steps here: the 16 lanes are first folded in halves (one add,
      // min or max each), else their scalar reduction costs what the wider vectors saved (double: 8 lanes, unfolded).
      typedef acc_t H __attribute__((vector_size(B / 2)));
      const auto fold = [](const V& v, auto op) __attribute__((always_inline)) {
        H lo, hi;
        std::memcpy(&lo, &v, sizeof lo);
        std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
        return op(lo, hi);
      };
      const H hsa = fold(sa0, [](const H& x, const H& y) { return x + y; });
      const H hsq = fold(sq0, [](const H& x, const H& y) { return x + y; });
      const H hmn = fold(mn0, [](const H& x, const H& y) { return simd::min_of<B / 2>(x, y); });
      const H hmx = fold(mx0, [](const H& x, const H& y) { return simd::max_of<B / 2>(x, y); });
      for (int l = 0; l < W / 2; ++l) {
        sa += hsa[l]; sq += hsq[l];
        mn = hmn[l] < mn ? hmn[l] : mn;
        mx = hmx[l] > mx ? hmx[l] : mx;
      }
    } else {
      for (int l = 0; l < W; ++l) {
        sa += sa0[l]; sq += sq0[l];
        mn = mn0[l] < mn ? mn0[l] : mn;
        mx = mx0[l] > mx ? mx0[l] : mx;
      }
    }
    for (; i < end; ++i) {
      const acc_t x = static_cast<acc_t>(p[i]);
      const acc_t a = x < 0 ? -x : x;
      sa += a; sq += a * a;
      mn = x < mn ? x : mn;
      mx = x > mx ? x : mx;
    }
    const acc_t am = -mn > mx ? -mn : mx;
    const bool ok = (sa - sa == 0) && am <= ChanLimits<acc_t>::hi && (am >= ChanLimits<acc_t>::lo || am == 0);
    ChannelPartial b = channel_empty();
    if (ok) {
      b.sum_abs = sa; b.sum_sq = sq; b.mn = mn; b.mx = mx; b.count = end - start;
    } else {
      for (int64_t k = start; k < end; ++k) channel_add(b, static_cast<double>(p[k]));
    }
    channel_merge(q, b);
  }
}

struct RunsTask {
  int64_t c, r0, r1;
};

template <int B, typename scalar_t>
HS_INLINE void runs_task_body(const ChannelView& v, const RunsTask& task, ChannelPartial* out) {
  const scalar_t* base = static_cast<const scalar_t*>(v.data) + task.c * v.cstride;
  ChannelPartial q = channel_empty();
  const int64_t len = task.r1 - task.r0;
  if (v.rest.ndim == 0) {
    span_body<B, scalar_t>(base + task.r0, len, q);
  } else {
    alignas(64) scalar_t buf[kGather];
    int64_t fill = 0;
    // (always_inline: a lambda takes no target attribute, so only inlined into the entry point is it built for the
    // level's ISA; before, the AVX2 level's gathered runs were read with baseline vectors.)
    auto add_run = [&](const scalar_t* s, int64_t st, int64_t n) __attribute__((always_inline)) {
      if (st == 1 && n >= 64) {
        span_body<B, scalar_t>(s, n, q);
        return;
      }
      for (int64_t k = 0; k < n; ++k) {
        buf[fill++] = s[k * st];
        if (fill == kGather) { span_body<B, scalar_t>(buf, fill, q); fill = 0; }
      }
    };
    for_each_run(base, v.rest, task.r0, len, add_run);
    if (fill) span_body<B, scalar_t>(buf, fill, q);
  }
  q.count = len;
  *out = q;
}

// The task entry points of one ISA (Note [cpu dispatch]).
template <typename scalar_t>
struct ChannelFns {
  void (*rows)(const ChannelView&, const RowsTask&, ChannelPartial*);
  void (*runs)(const ChannelView&, const RunsTask&, ChannelPartial*);
};
struct ChannelTable {
  ChannelFns<float> f32;
  ChannelFns<double> f64;
  ChannelFns<c10::Half> f16;
  ChannelFns<c10::BFloat16> bf16;
};

template <typename scalar_t> HS_INLINE ChannelFns<scalar_t> table_entry(const ChannelTable& t);
template <> HS_INLINE ChannelFns<float> table_entry<float>(const ChannelTable& t) { return t.f32; }
template <> HS_INLINE ChannelFns<double> table_entry<double>(const ChannelTable& t) { return t.f64; }
template <> HS_INLINE ChannelFns<c10::Half> table_entry<c10::Half>(const ChannelTable& t) { return t.f16; }
template <> HS_INLINE ChannelFns<c10::BFloat16> table_entry<c10::BFloat16>(const ChannelTable& t) { return t.bf16; }

// Each defined in its own unit, compiled for its ISA (the wider ones alias the baseline off x86).
extern const ChannelTable kChannelDefault;
extern const ChannelTable kChannelAvx2;
extern const ChannelTable kChannelAvx512;

// HS_CHANNEL_TABLE(name, B, TARGET): the table of one ISA, its entry points the task bodies at B bytes, marked TARGET.
#define HS_CHANNEL_TABLE(NAME, B, TARGET)                                                                  \
  namespace {                                                                                            \
  template <typename scalar_t>                                                                           \
  TARGET void rows_entry(const ChannelView& v, const RowsTask& t, ChannelPartial* p) {                  \
    rows_task_body<B, scalar_t>(v, t, p);                                                                \
  }                                                                                                      \
  template <typename scalar_t>                                                                           \
  TARGET void runs_entry(const ChannelView& v, const RunsTask& t, ChannelPartial* p) {                  \
    runs_task_body<B, scalar_t>(v, t, p);                                                                \
  }                                                                                                      \
  }                                                                                                      \
  const ChannelTable NAME = {{&rows_entry<float>, &runs_entry<float>},                                   \
                             {&rows_entry<double>, &runs_entry<double>},                                 \
                             {&rows_entry<c10::Half>, &runs_entry<c10::Half>},                           \
                             {&rows_entry<c10::BFloat16>, &runs_entry<c10::BFloat16>}};

}  // namespace channel_cpu
}  // namespace hookstats
