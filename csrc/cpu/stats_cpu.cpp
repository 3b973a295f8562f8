// CPU implementation of hookstats::stats and hookstats::stats_into.
//
// The input is cut into chunks of kChunk elements (a strided input is gathered chunk by
// chunk into a stack buffer, Note [layouts]). Each chunk is reduced in SIMD on the fast
// path (Note [stats partials]): scaled by a power of two when its magnitudes call for it
// (Note [stats scaling]), only counted once its task has seen NaN/Inf (Note [stats nonfinite]). Chunks are grouped into at most kMaxTasks tasks whose number
// depends only on numel, so the merge order, and hence every bit of the result, does not
// depend on the number of threads. A histogram is binned after each chunk's statistics, which
// settle it at once for a constant or all-NaN chunk (Note [cpu constant chunks]); other chunks
// are binned and counted in two passes (Note [cpu histogram counters]). The chunk kernels themselves, for
// each ISA (Note [cpu dispatch]), are in cpu/stats_chunk.h and cpu/hist_chunk.h; this file holds the
// driver: tasks, counters, locations, the ops.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
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
#include "stats_chunk.h"

namespace hookstats {
namespace {

using namespace cpu;  // NOLINT: the chunk kernels (cpu/stats_chunk.h)

constexpr int64_t kMaxTasks = 64;
constexpr int64_t kMinTaskElems = 32768;

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


// The chunk entry points of the ISA that runs now (Note [cpu dispatch]).
template <typename scalar_t>
chunk_fn<scalar_t> pick_chunk_fn(int mode) {
  switch (simd::isa()) {
    case simd::kIsaAvx512: return table_entry<scalar_t>(kChunksAvx512, mode);
    case simd::kIsaAvx2: return table_entry<scalar_t>(kChunksAvx2, mode);
    default: return table_entry<scalar_t>(kChunksDefault, mode);
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
  // 2^-ex as one factor where it is a normal double (one library call, not one per value)
  const double inv = ex > -1000 && ex < 1000 ? ldexp(1.0, -ex) : 0.0;
  for (int64_t i = 0; i < n && i < 8; ++i) {
    const double v = static_cast<double>(p[i]);
    const double y = inv != 0.0 ? v * inv : ldexp(v, -ex);  // |y| < 1: no overflow or underflow in y * y
    if (!(y - y == 0.0)) continue;
    s += y;
    ss += y * y;
    ++m;
  }
  // A shift only where the sample says |mean| > its spread: elsewhere 0 is as good, and a mean that
  // one large value dominates is a poor shift for the rest.
  const double mean = m ? s / m : 0.0;
  const double shift = m && mean * mean > ss / m - mean * mean ? ldexp(mean, ex) : 0.0;
  return TaskState{shift, scale_exponent<acc_t>(amax), nonfinite, false};
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
  static thread_local std::vector<uint32_t> sliced_cache;  // Note [one-hot chunk counts]
  static thread_local bool caches_zero = true;  // false only after a call that did not finish
  HistCounters* counters = nullptr;
  if (mode != kHistNone) {
    if (!caches_zero) {
      std::fill(counter_cache.begin(), counter_cache.end(), 0u);
      std::fill(total_cache.begin(), total_cache.end(), 0);
      std::fill(sliced_cache.begin(), sliced_cache.end(), 0u);
    }
    caches_zero = false;
    if (counter_cache.size() < static_cast<size_t>(nthreads * copies * len)) {
      counter_cache.resize(static_cast<size_t>(nthreads * copies * len), 0u);
    }
    if (total_cache.size() < static_cast<size_t>(nthreads * len)) total_cache.resize(static_cast<size_t>(nthreads * len), 0);
    if (sliced_cache.size() < static_cast<size_t>(nthreads * kSlicedWords)) {
      sliced_cache.resize(static_cast<size_t>(nthreads * kSlicedWords), 0u);
    }
    counter_refs.resize(static_cast<size_t>(nthreads));
    counters = counter_refs.data();
    for (int64_t t = 0; t < nthreads; ++t) {
      counters[t] = HistCounters{counter_cache.data() + t * copies * len, total_cache.data() + t * len, len, copies, 0,
                                 sliced_cache.data() + t * kSlicedWords, {-1, -1}, 0, 0};
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
    TaskState k{0.0, 0, false, false};
    // the note on fast_chunk_simd (cpu/stats_chunk.h): prefetch where the tensor is flat and larger than caches hold
    const bool prefetch = layout.ndim == 0 && numel * static_cast<int64_t>(sizeof(scalar_t)) > kPrefetchMinBytes;
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
      if (c == t * chunks_per_task) {
        k = initial_state(p, clen);
        k.prefetch = prefetch;
      }
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
  TORCH_CHECK_VALUE(mode.empty() || mode == "avx512" || mode == "avx2" || mode == "default",
                    "hookstats._cpu_isa takes '', 'avx512', 'avx2' or 'default', got '", mode, "'");
  if (!mode.empty()) simd::set_isa(mode == "avx512" ? simd::kIsaAvx512 : (mode == "avx2" ? simd::kIsaAvx2 : simd::kIsaDefault));
  return simd::isa_name(simd::isa());
}

namespace simd {
// Note [cpu dispatch]: HOOKSTATS_CPU_ISA when set, else ATen's level (which reads ATEN_CPU_CAPABILITY).
Isa requested_isa() {
  std::string want;
  if (const char* env = std::getenv("HOOKSTATS_CPU_ISA")) {
    want = env;
  } else {
    want = at::get_cpu_capability();  // "DEFAULT", "AVX2", "AVX512" (other names on other architectures)
  }
  for (char& ch : want) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return want == "avx512" ? kIsaAvx512 : (want == "avx2" ? kIsaAvx2 : kIsaDefault);
}
}  // namespace simd

TORCH_LIBRARY_IMPL(hookstats, CPU, m) {
  m.impl("stats", &stats_op<run_cpu>);
  m.impl("stats_into", &stats_into_op<run_cpu>);
  m.impl("stats_hist", &stats_hist_op<run_cpu>);
  m.impl("stats_loc", &stats_loc_op<run_cpu>);
}

}  // namespace hookstats
