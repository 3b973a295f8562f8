// The statistics of one CPU chunk (Note [stats partials]) and its histogram (cpu/hist_chunk.h): the kernel
// body that each ISA's translation unit, cpu/stats_chunk_{default,avx2,avx512}.cpp, instantiates for its
// vector width (Note [cpu dispatch]), and the table of entry points through which the driver,
// cpu/stats_cpu.cpp, calls them.
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
#include "../core/stats_ops.h"
#include "cpu_common.h"
#include "hist_chunk.h"
#include "simd.h"

namespace hookstats {
namespace cpu {

// The fast path over one contiguous chunk (Note [cpu dispatch]): the SIMD version of
// fast_add() in core/stats_ops.h, in S interleaved sets of lanes (to hide the add and
// fma latencies). The sum lanes restart every kBlock elements and their sums are added into
// double lanes, so no float lane adds more than about kBlock / (S W) values (32 with AVX2, 16 with
// AVX-512, 64 with the baseline's 4 lanes): a constant tensor's l1 stays within ~1e-6 of the truth (a single
// lane over the whole chunk drifted to ~5e-6). min, max and the zero count run over the whole chunk. The first
// pass over an unscaled chunk of a flat tensor larger than kPrefetchMinBytes (TaskState::prefetch) prefetches
// kPrefetchBytes ahead (8 KB; 4 KB measured alike), one prefetch per cache line, into the next chunk too: from DRAM
// (2^24 fp32, one thread) the hardware prefetcher alone left the op at ~1.4x one `x.sum()`, with it ~1.1-1.3x (shared machine); on
// a tensor that the L3 holds (2^20 fp32) the prefetches cost ~5%, hence the size.
template <int W>
constexpr int64_t kBlock = W <= 4 ? 512 : 64 * W;

constexpr int kPrefetchBytes = 8192;
constexpr int64_t kPrefetchMinBytes = int64_t(16) << 20;

template <typename scalar_t>
using CpuAcc = FastAcc<acc_of<scalar_t>, double>;

// SCALED: e != 0 (Note [stats scaling]); SHIFTED: k != 0 (without a shift, d is the value itself:
// one vector operation fewer per element group, for the data whose mean is small beside its spread).
template <int B, typename scalar_t, bool SCALED, bool SHIFTED, bool PREFETCH>
HS_INLINE CpuAcc<scalar_t> fast_chunk_simd(const scalar_t* p, int64_t n, acc_of<scalar_t> k, int32_t e) {
  HS_LANE_TYPES(scalar_t, B);
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
  auto restart = [](Lanes& a) { a.sd = V{}; a.ssd = V{}; a.l1 = V{}; };
  auto init = [&](Lanes& a) {
    restart(a);
    a.z = M{};
    a.mn = V{} + static_cast<acc_t>(INFINITY);
    a.mx = V{} - static_cast<acc_t>(INFINITY);
  };
  // 16-bit inputs on AVX-512 count their zeros on the raw bits, 32 values an instruction pair (vptestnmw and a masked
  // add on 16-bit lanes) instead of a compare and a masked add per 16 converted values; the counts are the same:
  // v == 0 exactly where the bits without the sign are 0 (DAZ is off, Note [stats scaling]).
  // bfloat16 on AVX-512 also converts 32 values from one 64-byte load in two instructions: the odd values' float32
  // bits are the 32-bit lanes' high halves (an and), the even values' their low halves shifted up. The lanes then hold
  // values in another order than the 16-value loads' (sums round alike, min, max and counts are the same bits), for
  // two instructions per 32 values fewer than two widening loads and two shifts.
#if HS_X86_BUILTINS
  constexpr bool kZero16 = B == 64 && sizeof(scalar_t) == 2;
  constexpr bool kPairs16 = B == 64 && std::is_same_v<scalar_t, c10::BFloat16>;
  typedef short v32hi __attribute__((vector_size(64)));
  v32hi z16{};  // at most 2 * kChunk / (S * W) = 128 a lane: no 16-bit lane can wrap
#else
  constexpr bool kZero16 = false;
  constexpr bool kPairs16 = false;
#endif
  auto step = [&](Lanes& a, const V& v, auto count_zeros) {
    const V y = SCALED ? v * vs : v;  // exact: a power of two (Note [stats scaling])
    const V d = SHIFTED ? y - vk : y;
    a.sd += d;
    a.ssd += d * d;
    a.l1 += simd::abs_bits<V, M>(y);
    a.mn = simd::min_of<B>(v, a.mn);  // v < mn ? v : mn
    a.mx = simd::max_of<B>(v, a.mx);
    if constexpr (!decltype(count_zeros)::value) return;
#if HS_X86_BUILTINS
    if constexpr (B == 64 && sizeof(acc_t) == 4) {  // one masked add (simd::k16)
      a.z = simd::k16::add_where(simd::k16::cmp<0 /*EQ_OQ*/>(v, V{}), a.z, M{} + 1);
      return;
    }
#endif
    a.z -= (M)(v == 0);
  };
  // S interleaved sets of lanes: enough independent add / fma chains to cover their latency at the
  // vector width's pace (4 at 64 bytes, where a step is as fast as a 32-byte one).
  constexpr int S = B == 64 ? 4 : 2;
  int64_t i = 0;
  const int64_t n_vec = n - n % W;
  Lanes a[S];
  for (int u = 0; u < S; ++u) init(a[u]);
  while (i < n_vec) {
    for (int u = 0; u < S; ++u) restart(a[u]);
    const int64_t end = std::min(n_vec, i + kBlock<W>);
    for (; i + S * W <= end; i += S * W) {
      if constexpr (PREFETCH) {  // (a run-time test here leaves the lanes on the stack: GCC 12)
        for (int off = 0; off < S * W * static_cast<int>(sizeof(scalar_t)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(p + i) + kPrefetchBytes + off);
        }
      }
#if HS_X86_BUILTINS
      if constexpr (kZero16) {
        static_assert(S * W == 64, "two 64-byte loads of 16-bit values");
        for (int h = 0; h < 2; ++h) {
          v32hi raw;
          std::memcpy(&raw, p + i + 32 * h, sizeof raw);
          const unsigned int zero = __builtin_ia32_ptestnmw512(raw, v32hi{} + 0x7FFF, 0xFFFFFFFFu);
          z16 = __builtin_ia32_paddw512_mask(z16, v32hi{} + 1, z16, zero);
        }
      }
#endif
      if constexpr (kPairs16) {
        static_assert(S == 4, "two 64-byte loads of 32 bfloat16 values, four float32 vectors");
        using U = typename simd::VT<B>::u32;
        for (int h = 0; h < 2; ++h) {
          U raw;
          std::memcpy(&raw, p + i + 32 * h, sizeof raw);
          step(a[2 * h], (V)(raw << 16), std::false_type{});
          step(a[2 * h + 1], (V)(raw & 0xFFFF0000u), std::false_type{});
        }
        continue;
      }
      for (int u = 0; u < S; ++u) step(a[u], L::load(p + i + u * W), std::integral_constant<bool, !kZero16>{});
    }
    for (; i + W <= end; i += W) step(a[0], L::load(p + i), std::true_type{});  // a block's last (< S) vectors
    V sd = a[0].sd, ssd = a[0].ssd, l1 = a[0].l1;
    for (int u = 1; u < S; ++u) {
      sd += a[u].sd;
      ssd += a[u].ssd;
      l1 += a[u].l1;
    }
    dsd += __builtin_convertvector(sd, DV);
    dssd += __builtin_convertvector(ssd, DV);
    dl1 += __builtin_convertvector(l1, DV);
  }
  V mn = a[0].mn, mx = a[0].mx;
  M z = a[0].z;
#if HS_X86_BUILTINS
  if constexpr (kZero16) {  // pairs of 16-bit counts into the 32-bit lanes
    z += (M)__builtin_ia32_pmaddwd512_mask(z16, v32hi{} + 1, typename simd::VT<64>::i32{}, (unsigned short)0xFFFF);
  }
#endif
  for (int u = 1; u < S; ++u) {
    mn = simd::min_of<B>(mn, a[u].mn);
    mx = simd::max_of<B>(mx, a[u].mx);
    z += a[u].z;
  }
  for (int j = 0; j < W; ++j) {
    f.sd += dsd[j];
    f.ssd += dssd[j];
    f.l1 += dl1[j];
    f.mn = mn[j] < f.mn ? mn[j] : f.mn;
    f.mx = mx[j] > f.mx ? mx[j] : f.mx;
    f.zero += z[j];
  }
  f.n = i;
  for (; i < n; ++i) {
    fast_add<acc_t>(f, static_cast<acc_t>(p[i]));
  }
  return f;
}

template <int B, typename scalar_t>
HS_INLINE CpuAcc<scalar_t> fast_chunk(const scalar_t* p, int64_t n, acc_of<scalar_t> k, int32_t e,
                                      bool prefetch = false) {
  // (scaled chunks, of magnitudes beyond ~2^+-60, go without the prefetch: two fewer instantiations)
  if (k == 0) {
    if (e != 0) return fast_chunk_simd<B, scalar_t, true, false, false>(p, n, k, e);
    return prefetch ? fast_chunk_simd<B, scalar_t, false, false, true>(p, n, k, 0)
                    : fast_chunk_simd<B, scalar_t, false, false, false>(p, n, k, 0);
  }
  if (e != 0) return fast_chunk_simd<B, scalar_t, true, true, false>(p, n, k, e);
  return prefetch ? fast_chunk_simd<B, scalar_t, false, true, true>(p, n, k, 0)
                  : fast_chunk_simd<B, scalar_t, false, true, false>(p, n, k, 0);
}

// The counting pass of a piece with NaN/Inf (Note [stats nonfinite]), in SIMD: NaN, Inf and zero
// counts by vector compares, NaN-free min and max.
template <int B, typename scalar_t>
HS_INLINE NonfiniteAcc<acc_of<scalar_t>> nonfinite_chunk_simd(const scalar_t* p, int64_t n) {
  HS_LANE_TYPES(scalar_t, B);
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

// What a task carries from chunk to chunk: the next chunk's shift (the previous chunk's mean, or 0 where
// that mean is small beside its spread), its scale exponent (Note [stats scaling]), and whether a NaN/Inf
// was seen (Note [stats nonfinite]).
struct TaskState {
  double mean;
  int32_t e;
  bool nonfinite;
  bool prefetch;  // set by the driver: a flat tensor of more than kPrefetchMinBytes (the note on fast_chunk_simd)
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
  CpuAcc<scalar_t> f = fast_chunk<B, scalar_t>(p, n, input_shift<scalar_t>(hs_ldexp(st.mean, -e)), e, st.prefetch);
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
  // The next shift: no shift where mean^2 <= var / 4 (then n * mean^2 <= m2 / 4, so unshifted sums lose
  // under a bit of m2 and sum(x^2) to cancellation, and shift_is_poor never asks for a second pass).
  const double nd = static_cast<double>(f.n), sd = static_cast<double>(f.sd);
  const double mean_s = static_cast<double>(f.k) + sd / nd;  // in scaled units
  const double m2_s = static_cast<double>(f.ssd) - sd * sd / nd;
  st.mean = 4.0 * nd * mean_s * mean_s <= m2_s ? 0.0 : hs_ldexp(static_cast<double>(fast_mean<acc_t>(f)), e);
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
      bin_chunk<B, scalar_t, HM>(p, n, *hist, *hs, part.mn, part.mx, part.zero, part.nan);
    }
    hist->pending += n;
    if (hist->pending >= (int64_t(1) << 31)) flush_counters(*hist);
  }
  return part;
}


// The chunk entry points of one ISA (Note [cpu dispatch]): [mode] = kHistNone, kHistRange, kHistExp.
template <typename scalar_t>
using chunk_fn = StatsPartial (*)(const scalar_t*, int64_t, TaskState&, HistCounters*, const BinPlan*);

struct ChunkTable {
  chunk_fn<float> f32[3];
  chunk_fn<double> f64[3];
  chunk_fn<c10::Half> f16[3];
  chunk_fn<c10::BFloat16> bf16[3];
};

template <typename scalar_t> HS_INLINE chunk_fn<scalar_t> table_entry(const ChunkTable& t, int mode);
template <> HS_INLINE chunk_fn<float> table_entry<float>(const ChunkTable& t, int mode) { return t.f32[mode]; }
template <> HS_INLINE chunk_fn<double> table_entry<double>(const ChunkTable& t, int mode) { return t.f64[mode]; }
template <> HS_INLINE chunk_fn<c10::Half> table_entry<c10::Half>(const ChunkTable& t, int mode) { return t.f16[mode]; }
template <> HS_INLINE chunk_fn<c10::BFloat16> table_entry<c10::BFloat16>(const ChunkTable& t, int mode) {
  return t.bf16[mode];
}

// Each defined in its own unit, compiled for its ISA (the wider ones alias the baseline off x86).
extern const ChunkTable kChunksDefault;
extern const ChunkTable kChunksAvx2;
extern const ChunkTable kChunksAvx512;

// HS_CHUNK_TABLE(name, B, TARGET): the table of one ISA, its entry points fast_chunk_body<B> marked TARGET.
#define HS_CHUNK_TABLE(NAME, B, TARGET)                                                                       \
  namespace {                                                                                               \
  template <typename scalar_t, int HM>                                                                      \
  TARGET StatsPartial chunk_entry(const scalar_t* p, int64_t n, TaskState& k, HistCounters* hist,            \
                                  const BinPlan* hs) {                                                      \
    return fast_chunk_body<B, scalar_t, HM>(p, n, k, hist, hs);                                             \
  }                                                                                                         \
  }                                                                                                         \
  const ChunkTable NAME = {                                                                                 \
      {&chunk_entry<float, kHistNone>, &chunk_entry<float, kHistRange>, &chunk_entry<float, kHistExp>},       \
      {&chunk_entry<double, kHistNone>, &chunk_entry<double, kHistRange>, &chunk_entry<double, kHistExp>},    \
      {&chunk_entry<c10::Half, kHistNone>, &chunk_entry<c10::Half, kHistRange>,                              \
       &chunk_entry<c10::Half, kHistExp>},                                                                  \
      {&chunk_entry<c10::BFloat16, kHistNone>, &chunk_entry<c10::BFloat16, kHistRange>,                      \
       &chunk_entry<c10::BFloat16, kHistExp>}};

}  // namespace cpu
}  // namespace hookstats
