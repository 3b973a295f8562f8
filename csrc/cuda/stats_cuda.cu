// CUDA implementation of hookstats::stats and hookstats::stats_into.
//
// One launch per tensor, on the current stream, no host sync:
//   * each thread reads its grid-stride share with 16-byte loads (an aligned body, a scalar
//     head for misaligned slices and a scalar tail), accumulates on the fast path of
//     core/stats_ops.h (Note [stats partials]) and re-reads its share only to count it when it
//     holds NaN/Inf (Note [stats nonfinite]), to scale it when its magnitudes ask for another
//     scale than its first pack did (Note [stats scaling]), or with a better shift;
//   * histograms go to per-warp shared sub-histograms, warp-aggregated (Note [cuda block histograms]);
//     range bins are decided by exact thresholds (Note [exact bin thresholds] in core/hist_ops.h),
//     passed by value for float inputs of up to 512 bins and read from a device table for float64
//     inputs and more bins (Note [capture-safe tables]), with no per-value float64 fallback near edges;
//   * partials are merged by warp shuffles and shared memory in a fixed order; with several blocks,
//     written to a per-block slot of a small workspace (grid <= 2 blocks of 256 threads per SM, ~100
//     bytes a block), and the last block to finish (atomic ticket) merges the block partials in block
//     order and writes the results; a single block writes them itself (Note [single-block rows]).
//     No float atomics: results are bitwise reproducible on a device.
// Non-dense layouts are read element by element through StridedLayout (Note [layouts]).
// With locations (Note [element locations]) a second instantiation of the kernel (LOC = true) also
// keeps, per thread, the first largest |x| and first NaN/Inf of its share with their flat indices
// (loc_add of core/loc_ops.h, in the share's first read), merged like the partials: warp shuffles,
// shared memory, one slot per block, the last block in block order (loc_merge: larger |x|, then
// smaller index; smaller first-NaN/Inf index). Every non-contiguous tensor is then read in logical
// order. The kernel without locations is the same code as before.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

#include "../core/bindings.h"
#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/hist_ops.h"
#include "../core/layout.h"
#include "../core/loc_ops.h"
#include "../core/multi_bindings.h"
#include "../core/stats_ops.h"
#include "cuda_util.cuh"
#include "device_tables.cuh"

namespace hookstats {
namespace {

constexpr int kThreads = 256;  // ~92 registers a thread: two blocks fit an SM
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;

template <typename scalar_t> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

__device__ __forceinline__ StatsPartial shfl_down(const StatsPartial& p, int offset) {
  StatsPartial q;
  q.n = __shfl_down_sync(0xffffffffu, p.n, offset);
  q.nan = __shfl_down_sync(0xffffffffu, p.nan, offset);
  q.inf = __shfl_down_sync(0xffffffffu, p.inf, offset);
  q.zero = __shfl_down_sync(0xffffffffu, p.zero, offset);
  q.sum = __shfl_down_sync(0xffffffffu, p.sum, offset);
  q.l1 = __shfl_down_sync(0xffffffffu, p.l1, offset);
  q.mn = __shfl_down_sync(0xffffffffu, p.mn, offset);
  q.mx = __shfl_down_sync(0xffffffffu, p.mx, offset);
  q.ssq = __shfl_down_sync(0xffffffffu, p.ssq, offset);
  q.mean = __shfl_down_sync(0xffffffffu, p.mean, offset);
  q.m2 = __shfl_down_sync(0xffffffffu, p.m2, offset);
  q.e = __shfl_down_sync(0xffffffffu, p.e, offset);
  return q;
}

__device__ __forceinline__ LocPartial shfl_down(const LocPartial& l, int offset) {
  LocPartial q;
  q.amax = __shfl_down_sync(0xffffffffu, l.amax, offset);
  q.amax_i = __shfl_down_sync(0xffffffffu, l.amax_i, offset);
  q.nf_i = __shfl_down_sync(0xffffffffu, l.nf_i, offset);
  return q;
}

// Block-wide merge of one partial per thread, in a fixed order (warp shuffles, then the warps' results through smem,
// kWarps of them); the result is valid in thread 0.
template <typename P, typename Merge>
__device__ __forceinline__ P block_merge_with(P p, P* smem, const P& empty, Merge merge_into) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) merge_into(p, shfl_down(p, offset));
  if (lane == 0) smem[warp] = p;
  __syncthreads();
  if (warp == 0) {
    p = lane < kWarps ? smem[lane] : empty;
    for (int offset = 16; offset > 0; offset >>= 1) merge_into(p, shfl_down(p, offset));
  }
  __syncthreads();
  return p;
}

__device__ StatsPartial block_merge(StatsPartial p, StatsPartial* smem) {
  return block_merge_with(p, smem, empty_partial(), [](StatsPartial& a, const StatsPartial& b) { merge(a, b); });
}

// The location merge (Note [element locations]).
__device__ LocPartial block_merge_loc(LocPartial l, LocPartial* smem) {
  return block_merge_with(l, smem, empty_loc(), [](LocPartial& a, const LocPartial& b) { loc_merge(a, b); });
}

// What one thread reads: its grid-stride share of the tensor.
template <typename scalar_t>
struct Share {
  const scalar_t* __restrict__ x;
  int64_t n;
  int64_t head;  // scalar elements before the first 16-byte aligned one (flat layout)
  StridedLayout layout;
  bool flat;

  static constexpr int kVec = 16 / sizeof(scalar_t);

  // Calls f(value) for every element of thread tid's share, in a fixed order.
  template <typename F>
  __device__ __forceinline__ void visit(int64_t tid, int64_t nthreads, F&& f) const {
    visit_i(tid, nthreads, [&](scalar_t v, int64_t) { f(v); });  // the unused indices compile away
  }

  // Calls f(value, flat index) for every element of thread tid's share, in a fixed order; visit() drops the index.
  template <typename F>
  __device__ __forceinline__ void visit_i(int64_t tid, int64_t nthreads, F&& f) const {
    if (!flat) {
      for (int64_t i = tid; i < n; i += nthreads) f(x[element_offset(layout, i)], i);
      return;
    }
    if (tid < head) f(x[tid], tid);
    const int64_t npacks = (n - head) / kVec;
    const uint4* packs = reinterpret_cast<const uint4*>(x + head);
    int64_t p = tid;
    for (; p + (kUnroll - 1) * nthreads < npacks; p += kUnroll * nthreads) {
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = __ldg(packs + p + u * nthreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const scalar_t* v = reinterpret_cast<const scalar_t*>(&r[u]);
        const int64_t i0 = head + (p + u * nthreads) * kVec;
#pragma unroll
        for (int j = 0; j < kVec; ++j) f(v[j], i0 + j);
      }
    }
    for (; p < npacks; p += nthreads) {
      const uint4 r = __ldg(packs + p);
      const scalar_t* v = reinterpret_cast<const scalar_t*>(&r);
      const int64_t i0 = head + p * kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(v[j], i0 + j);
    }
    const int64_t t = head + npacks * kVec + tid;
    if (t < n) f(x[t], t);
  }

  // What the share's first pack suggests: a shift (its mean, in scaled units), a scale exponent
  // (Note [stats scaling]) and whether it holds NaN/Inf (Note [stats nonfinite]).
  struct Guess {
    typename AccOf<scalar_t>::type k;
    int32_t e;
    bool nonfinite;
  };
  __device__ __forceinline__ Guess first_guess(int64_t tid) const {
    using acc_t = typename AccOf<scalar_t>::type;
    int64_t first = tid, count = 1;
    if (flat && tid >= head) {
      first = head + tid * kVec;
      count = kVec;
    }
    double s = 0.0, amax = 0.0;
    int64_t m = 0;
    bool nonfinite = false;
    for (int64_t i = first; i < first + count && i < n; ++i) {
      const double v = static_cast<double>(static_cast<acc_t>(x[flat ? i : element_offset(layout, i)]));
      if (!(v - v == 0.0)) { nonfinite = true; continue; }
      s += v;
      ++m;
      amax = fabs(v) > amax ? fabs(v) : amax;
    }
    Guess g;
    g.e = scale_exponent<acc_t>(amax);
    g.k = shift_of(m ? ldexp(s / m, -g.e) : 0.0);
    g.nonfinite = nonfinite;
    return g;
  }

  // A shift representable in the input dtype (see input_shift in cpu/stats_cpu.cpp).
  static __device__ __forceinline__ typename AccOf<scalar_t>::type shift_of(double mean) {
    using acc_t = typename AccOf<scalar_t>::type;
    const acc_t k = static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(mean)));
    return k - k == acc_t(0) ? k : acc_t(0);
  }
};

__device__ __forceinline__ int32_t exp_slot_raw(float v) { return exp_slot<8, 23>(__float_as_uint(v)); }
__device__ __forceinline__ int32_t exp_slot_raw(double v) {
  return exp_slot<11, 52>(static_cast<uint64_t>(__double_as_longlong(v)));
}
__device__ __forceinline__ int32_t exp_slot_raw(c10::Half v) { return exp_slot<5, 10>(v.x); }
__device__ __forceinline__ int32_t exp_slot_raw(c10::BFloat16 v) { return exp_slot<8, 7>(v.x); }

// Note [cuda block histograms]
// Each block counts into shared-memory sub-histograms, one per warp when they fit in
// kHistSmemBytes (so warps never contend for an address), else one for the block. Before its
// shared atomic, a warp's lanes that hold the same slot are combined (__match_any_sync): the
// lowest of them adds the group's size. Data concentrated in one bin (ReLU zeros, dead units,
// saturated values) then costs one atomic per warp and value position instead of 32 serialized
// ones on one address. Integer counts: exact, order-free. With several blocks, each adds its
// sub-histograms into the int64 output row with one global atomic per nonzero slot; a single block
// stores its row (Note [single-block rows]).
constexpr int64_t kHistSmemBytes = 32 * 1024;

__device__ __forceinline__ void hist_inc(uint32_t* h, int32_t slot) {
  const unsigned active = __activemask();
  const unsigned peers = __match_any_sync(active, static_cast<unsigned>(slot));
  const int lane = threadIdx.x & 31;
  if (lane == __ffs(peers) - 1) atomicAdd(h + slot, static_cast<uint32_t>(__popc(peers)));
}

// The exact thresholds of a range histogram (Note [exact bin thresholds]), by value in the kernel's
// arguments: a captured graph replays them with the launch, no device table to keep alive. n = 0:
// none (fp64 input, more than kMaxArgThresholds - 1 bins, or a range the float transform cannot
// serve); the kernel then reads hs.T or hs.T64 from a device table (exact_thresholds), or keeps
// fixed_slot where neither is set.
struct BinThresholds {
  float T[kMaxArgThresholds];
  int32_t n;
};

// A value's range ordinal from the thresholds of its accumulation type (Note [exact bin thresholds]).
__device__ __forceinline__ int32_t range_ordinal(float v, const HistSpec& hs) { return threshold_ordinal(v, hs, hs.T); }
__device__ __forceinline__ int32_t range_ordinal(double v, const HistSpec& hs) {
  return threshold_ordinal(v, hs, hs.T64);
}

// Whether a range spec's counters are indexed by ordinal: the kernel has thresholds for it.
__device__ __forceinline__ bool by_ordinal(const HistSpec& hs) {
  return hs.mode == kHistRange && (hs.T != nullptr || hs.T64 != nullptr);
}

// Calls f(value, index) for every element of the share (index: its flat logical position), counting
// its histogram slot into this warp's sub-histogram h when the spec has one (by ordinal when hs.T or
// hs.T64 is set). Callers that need no index ignore it, and the compiler drops its arithmetic.
template <typename scalar_t, typename F>
__device__ __forceinline__ void visit_counting(const Share<scalar_t>& share, int64_t tid, int64_t nthreads,
                                               const HistSpec& hs, uint32_t* h, F&& f) {
  using acc_t = typename AccOf<scalar_t>::type;
  if (by_ordinal(hs)) {  // Note [exact bin thresholds]: counted by ordinal
    share.visit_i(tid, nthreads, [&](scalar_t r, int64_t i) {
      const acc_t v = static_cast<acc_t>(r);
      f(v, i);
      hist_inc(h, range_ordinal(v, hs));
    });
  } else if (hs.mode == kHistRange) {
    share.visit_i(tid, nthreads, [&](scalar_t r, int64_t i) {
      const acc_t v = static_cast<acc_t>(r);
      f(v, i);
      hist_inc(h, fixed_slot<acc_t>(v, hs));
    });
  } else if (hs.mode == kHistExp) {
    share.visit_i(tid, nthreads, [&](scalar_t r, int64_t i) {
      f(static_cast<acc_t>(r), i);
      hist_inc(h, exp_slot_raw(r));
    });
  } else {
    share.visit_i(tid, nthreads, [&](scalar_t r, int64_t i) { f(static_cast<acc_t>(r), i); });
  }
}

// The first read of a share: visit_counting, and with LOC each element also goes to loc_add.
template <bool LOC, typename scalar_t, typename F>
__device__ __forceinline__ void first_visit(const Share<scalar_t>& share, int64_t tid, int64_t nthreads,
                                            const HistSpec& hs, uint32_t* h,
                                            LocAcc<typename AccOf<scalar_t>::type>& loc, F&& f) {
  using acc_t = typename AccOf<scalar_t>::type;
  visit_counting(share, tid, nthreads, hs, h, [&](acc_t v, int64_t i) {
    f(v);
    if constexpr (LOC) loc_add<acc_t>(loc, v, i);
  });
}

// The histogram is counted in the first visit only; re-reads only redo statistics. A share whose
// first pack holds NaN/Inf is only counted (Note [stats nonfinite]); a share whose magnitudes do
// not fit the first pack's scale is read again with its own (Note [stats scaling]).
// With LOC, loc receives the share's locations (from the first read).
template <typename scalar_t, bool LOC = false>
__device__ StatsPartial thread_partial(const Share<scalar_t>& share, int64_t tid, int64_t nthreads,
                                       const HistSpec& hs, uint32_t* sh_hist,
                                       LocAcc<typename AccOf<scalar_t>::type>* loc = nullptr) {
  using acc_t = typename AccOf<scalar_t>::type;
  const typename Share<scalar_t>::Guess g = share.first_guess(tid);
  LocAcc<acc_t> none;
  LocAcc<acc_t>& l = LOC ? *loc : none;
  if (g.nonfinite) {
    NonfiniteAcc<acc_t> c;
    nonfinite_init<acc_t>(c);
    first_visit<LOC>(share, tid, nthreads, hs, sh_hist, l, [&](acc_t v) { nonfinite_add<acc_t>(c, v); });
    return nonfinite_to_partial<acc_t>(c);
  }
  FastAcc<acc_t> f;
  fast_init<acc_t>(f, g.k, g.e);
  first_visit<LOC>(share, tid, nthreads, hs, sh_hist, l, [&](acc_t v) { fast_add<acc_t>(f, v); });
  if (fast_nonfinite<acc_t>(f)) {
    NonfiniteAcc<acc_t> c;
    nonfinite_init<acc_t>(c);
    share.visit(tid, nthreads, [&](scalar_t r) { nonfinite_add<acc_t>(c, static_cast<acc_t>(r)); });
    if (c.nan > 0 || c.inf > 0) return nonfinite_to_partial<acc_t>(c);
  }
  const double amax = fast_amax<acc_t>(f);
  if (fast_nonfinite<acc_t>(f) || !scale_fits<acc_t>(amax, f.e)) {
    fast_init<acc_t>(f, acc_t(0), scale_exponent<acc_t>(amax));  // no shift: see stats_cpu.cpp
    share.visit(tid, nthreads, [&](scalar_t r) { fast_add<acc_t>(f, static_cast<acc_t>(r)); });
  }
  if (shift_is_poor<acc_t>(f)) {
    fast_init<acc_t>(f, Share<scalar_t>::shift_of(static_cast<double>(fast_mean<acc_t>(f))), f.e);
    share.visit(tid, nthreads, [&](scalar_t r) { fast_add<acc_t>(f, static_cast<acc_t>(r)); });
  }
  return fast_to_partial<acc_t>(f);
}

// Note [single-block rows]
// How a launch's blocks put their counts into the histogram row. With several blocks, each adds its nonzero
// counts with global atomics into a row the host zeroed first (unless accumulating): kRowAtomic. A launch of one
// block (every tensor of up to kThreads * kVec * kUnroll values: a Monitor's small activations) owns its row, so it
// writes every slot with a plain store (kRowStore), or adds to it (kRowAdd, accumulate): no zeroing launch, and it
// needs no workspace and no ticket either (it writes its results itself), so such a stats_into is one launch and
// no allocation, where it was a memset, an allocation, a second memset and the launch.
enum RowMode : int { kRowAtomic = 0, kRowStore = 1, kRowAdd = 2 };

// block_locs: one LocPartial per block (LOC only).
// Block `block` of the `nblocks` blocks that reduce share (a stats launch, or one tensor's blocks in a multi-tensor
// launch, Note [multi-tensor stats launches]): its threads' partials (and histogram counts) merged in a fixed order
// into block_partials[block]; the last of the nblocks blocks to finish (the ticket) merges them in block order and
// writes the row. A single block (nblocks == 1) writes its row at once and touches neither block_partials,
// block_locs nor ticket (nullptr then, Note [single-block rows]). No float atomics: results are bitwise
// reproducible on a device.
template <typename scalar_t, bool LOC>
__device__ __forceinline__ void stats_block(const Share<scalar_t>& share, int block, int nblocks,
                                            StatsPartial* __restrict__ block_partials, LocPartial* __restrict__ block_locs,
                                            unsigned int* __restrict__ ticket, const StatsOut& out, const HistSpec& hs,
                                            int64_t hist_len, int hist_copies, unsigned long long* hist_out,
                                            const BinThresholds& thr, int row_mode) {
  using acc_t = typename AccOf<scalar_t>::type;
  __shared__ StatsPartial smem[kWarps];
  __shared__ bool is_last;
  // The location merges reuse smem once block_merge is done with it (it ends with a barrier).
  static_assert(sizeof(LocPartial) <= sizeof(StatsPartial), "smem holds kWarps LocPartials");
  LocPartial* const smem_loc = reinterpret_cast<LocPartial*>(smem);
  // hist_copies sub-histograms (Note [cuda block histograms]), then thr's thresholds
  extern __shared__ uint32_t sh_hist[];
  for (int64_t i = threadIdx.x; i < hist_len * hist_copies; i += kThreads) sh_hist[i] = 0u;
  float* sh_T = reinterpret_cast<float*>(sh_hist + hist_len * hist_copies);
  for (int i = threadIdx.x; i < thr.n; i += kThreads) sh_T[i] = thr.T[i];
  HistSpec h = hs;
  if (thr.n > 0) h.T = sh_T;
  if (hist_len > 0) __syncthreads();
  const int64_t nthreads = static_cast<int64_t>(nblocks) * kThreads;
  const int64_t tid = static_cast<int64_t>(block) * kThreads + threadIdx.x;
  uint32_t* my_hist = sh_hist + ((threadIdx.x >> 5) % (hist_copies > 0 ? hist_copies : 1)) * hist_len;
  LocAcc<acc_t> tl;  // unused without LOC (and its address not taken)
  loc_init(tl);
  StatsPartial p = block_merge(thread_partial<scalar_t, LOC>(share, tid, nthreads, h, my_hist, LOC ? &tl : nullptr),
                               smem);  // syncs the block
  LocPartial bl = empty_loc();
  if constexpr (LOC) bl = block_merge_loc(loc_to_partial(tl), smem_loc);
  if (out.ring != nullptr && hist_len > 0) hist_out += ring_slot(out) * out.ring_hist_elems;  // Note [ring rows]
  for (int64_t i = threadIdx.x; i < hist_len; i += kThreads) {
    uint32_t c = 0u;
    for (int r = 0; r < hist_copies; ++r) c += sh_hist[r * hist_len + i];
    const int64_t slot = by_ordinal(h) ? slot_of_ordinal(static_cast<int32_t>(i), h.bins) : i;
    if (row_mode == kRowAtomic) {  // Note [single-block rows]
      if (c != 0u) atomicAdd(hist_out + slot, static_cast<unsigned long long>(c));
    } else {
      hist_out[slot] = (row_mode == kRowAdd ? hist_out[slot] : 0ull) + static_cast<unsigned long long>(c);
    }
  }
  if (nblocks == 1) {
    if (threadIdx.x == 0) {
      store(p, out);
      if constexpr (LOC) store_loc(bl, ring_loc(out));
    }
    return;
  }
  if (threadIdx.x == 0) {
    block_partials[block] = p;
    if constexpr (LOC) block_locs[block] = bl;
    __threadfence();
    is_last = atomicAdd(ticket, 1u) == static_cast<unsigned int>(nblocks) - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Thread t merges block partials t, t + kThreads, ... in order, then the block merges.
  StatsPartial q = empty_partial();
  for (int b = threadIdx.x; b < nblocks; b += kThreads) {
    const volatile StatsPartial* src = block_partials + b;
    StatsPartial r;
    r.n = src->n; r.nan = src->nan; r.inf = src->inf; r.zero = src->zero;
    r.sum = src->sum; r.l1 = src->l1; r.mn = src->mn; r.mx = src->mx;
    r.ssq = src->ssq; r.mean = src->mean; r.m2 = src->m2; r.e = src->e;
    merge(q, r);
  }
  q = block_merge(q, smem);
  LocPartial ql = empty_loc();
  if constexpr (LOC) {
    for (int b = threadIdx.x; b < nblocks; b += kThreads) {
      const volatile LocPartial* src = block_locs + b;
      LocPartial r;
      r.amax = src->amax; r.amax_i = src->amax_i; r.nf_i = src->nf_i;
      loc_merge(ql, r);
    }
    ql = block_merge_loc(ql, smem_loc);
  }
  if (threadIdx.x == 0) {
    store(q, out);
    if constexpr (LOC) store_loc(ql, ring_loc(out));
    *ticket = 0u;
  }
}

template <typename scalar_t, bool LOC = false>
__global__ void __launch_bounds__(kThreads)
stats_kernel(Share<scalar_t> share, StatsPartial* __restrict__ block_partials,
             unsigned int* __restrict__ ticket, StatsOut out, HistSpec hs, int64_t hist_len, int hist_copies, int row_mode,
             unsigned long long* __restrict__ hist_out, LocPartial* __restrict__ block_locs,
             const __grid_constant__ BinThresholds thr) {
  stats_block<scalar_t, LOC>(share, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), block_partials,
                             block_locs, ticket, out, hs, hist_len, hist_copies, hist_out, thr, row_mode);
}

// The exact bin thresholds of a launch over scalar_t (Note [exact bin thresholds]): by value in thr for
// float32-accumulated inputs and range histograms of up to kMaxArgThresholds - 1 bins (thr.n = 0 otherwise);
// else, for float64 inputs (float64 thresholds, hs.T64) and more bins (hs.T), a device table, cached per stream
// and range and uploaded afresh under capture (Note [capture-safe tables]), returned to be kept until the launch
// is enqueued. Neither where no thresholds apply: the kernel keeps fixed_slot.
template <typename scalar_t>
at::Tensor exact_thresholds(HistSpec& hs, int64_t hist_len, BinThresholds& thr, const at::Tensor& like,
                            cudaStream_t stream) {
  using F = typename AccOf<scalar_t>::type;
  thr.n = 0;
  hs.T = nullptr;
  hs.T64 = nullptr;
  if (hist_len == 0 || hs.mode != kHistRange) return at::Tensor();
  const F* T = cached_thresholds<F>(hs);
  if (T == nullptr) return at::Tensor();
  if (sizeof(F) == 4 && hs.bins < kMaxArgThresholds) {
    thr.n = hs.bins + 1;
    std::memcpy(thr.T, T, static_cast<size_t>(thr.n) * sizeof(float));
    return at::Tensor();
  }
  struct Key {  // 32 bytes: two table words
    int32_t width, bins;
    double lo, hi;
    int64_t zero;
  } key{static_cast<int32_t>(sizeof(F)), hs.bins, hs.lo, hs.hi, 0};
  static_assert(sizeof(Key) == 2 * sizeof(uint4), "the key is two 16-byte words");
  uint4 kw[2];
  std::memcpy(kw, &key, sizeof kw);
  const size_t bytes = (static_cast<size_t>(hs.bins) + 1) * sizeof(F);
  at::Tensor table = device_table(kw, 2, like.device(), stream, [&](std::vector<uint4>& w) {
    w.assign((bytes + 15) / 16, uint4{0u, 0u, 0u, 0u});
    std::memcpy(w.data(), T, bytes);
  });
  if (sizeof(F) == 8) hs.T64 = reinterpret_cast<const double*>(table.data_ptr());
  else hs.T = reinterpret_cast<const float*>(table.data_ptr());
  return table;
}

// The blocks of a stats launch over n values: one per kThreads * kUnroll packs, at most two per SM.
template <typename scalar_t>
int launch_blocks(int64_t n, int device) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * Share<scalar_t>::kVec * kUnroll;
  const int64_t wanted = (n + per_block - 1) / per_block;
  const int64_t cap = 2 * static_cast<int64_t>(sm_count(device));
  return static_cast<int>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

// Zeroes the histogram row of the ring slot read on the device (Note [ring rows]): what
// cudaMemsetAsync does for a row whose address is known at launch.
__global__ void zero_ring_row_kernel(unsigned long long* __restrict__ hist, int64_t len, StatsOut out) {
  unsigned long long* row = hist + ring_slot(out) * out.ring_hist_elems;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < len;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    row[i] = 0ull;
  }
}

// hist: int64 counts on x's device (nullptr: no histogram); written, or added to with accumulate (Note [single-block rows]).
void run_cuda(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
              bool accumulate) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const bool want_loc = out.loc != nullptr;
  const StridedLayout layout = layout_of(x, want_loc);  // Note [element locations]
  const int64_t n = x.numel();
  if (hist == nullptr) hist_len = 0;
  HOOKSTATS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hookstats_stats_cuda", [&] {
    Share<scalar_t> share;
    share.x = static_cast<const scalar_t*>(first_element(x));
    share.n = n;
    share.layout = layout;
    share.flat = layout.ndim == 0;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(share.x);
    const int64_t head = static_cast<int64_t>(((16 - addr % 16) % 16) / sizeof(scalar_t));
    share.head = head < n ? head : n;
    const int blocks = launch_blocks<scalar_t>(n, x.device().index());
    // Note [single-block rows]: one block writes its histogram row and results itself.
    const int row_mode = blocks > 1 ? kRowAtomic : (accumulate ? kRowAdd : kRowStore);
    if (hist_len > 0 && !accumulate && blocks > 1) {
      if (out.ring != nullptr) {
        const int zb = static_cast<int>(hist_len < 4 * 256 ? (hist_len + 255) / 256 : 4);
        zero_ring_row_kernel<<<zb, 256, 0, stream>>>(reinterpret_cast<unsigned long long*>(hist), hist_len, out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      } else {
        C10_CUDA_CHECK(cudaMemsetAsync(hist, 0, hist_len * sizeof(int64_t), stream));
      }
    }
    // Workspace (several blocks only): one partial per block and the ticket, from the caching allocator
    // (stream ordered, no cudaMalloc once warm). With locations, one LocPartial per block follows the partials.
    at::Tensor ws;
    StatsPartial* partials = nullptr;
    LocPartial* locs = nullptr;
    unsigned int* ticket = nullptr;
    if (blocks > 1) {
      const int64_t loc_bytes = want_loc ? static_cast<int64_t>(blocks) * sizeof(LocPartial) : 0;
      const int64_t ws_bytes = static_cast<int64_t>(blocks) * sizeof(StatsPartial) + loc_bytes + 16;
      ws = at::empty({ws_bytes}, x.options().dtype(at::kByte));
      partials = reinterpret_cast<StatsPartial*>(ws.data_ptr());
      locs = reinterpret_cast<LocPartial*>(static_cast<char*>(ws.data_ptr()) +
                                           static_cast<int64_t>(blocks) * sizeof(StatsPartial));
      ticket = reinterpret_cast<unsigned int*>(static_cast<char*>(ws.data_ptr()) + ws_bytes - 16);
      C10_CUDA_CHECK(cudaMemsetAsync(ticket, 0, sizeof(unsigned int), stream));
    }
    // Note [cuda block histograms]: a sub-histogram per warp when they fit, else one per block
    // (<= 8192 + 3 bins or 4098 exponent slots: at most 32 KB).
    const int copies = hist_len == 0 ? 0 : (hist_len * kWarps * 4 <= kHistSmemBytes ? kWarps : 1);
    // Note [exact bin thresholds]: by value or from a device table.
    BinThresholds thr;
    HistSpec h = hs;
    const at::Tensor table = exact_thresholds<scalar_t>(h, hist_len, thr, x, stream);
    const size_t smem = (static_cast<size_t>(hist_len) * copies + static_cast<size_t>(thr.n)) * sizeof(uint32_t);
    if (want_loc) {
      stats_kernel<scalar_t, true><<<blocks, kThreads, smem, stream>>>(
          share, partials, ticket, out, h, hist_len, copies, row_mode, reinterpret_cast<unsigned long long*>(hist),
          locs, thr);
    } else {
      stats_kernel<scalar_t><<<blocks, kThreads, smem, stream>>>(
          share, partials, ticket, out, h, hist_len, copies, row_mode, reinterpret_cast<unsigned long long*>(hist),
          nullptr, thr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Note [multi-tensor stats launches]
// stats_multi_into on CUDA: the flat tensors of one dtype go up to kPackTensors at a time into one
// launch whose arguments carry each tensor's pointer, length, rows and block range (MultiPack,
// ~1.2 KB, with the 2 KB of exact bin thresholds under the 4 KB kernel-argument limit of every CUDA version; float64
// inputs and more than 512 bins read a device table instead, Note [capture-safe tables]). Each tensor gets the blocks a stats_into launch would
// give it (launch_blocks), and its blocks run what that launch runs: the same grid-stride shares,
// the same block merges, and the last of its blocks to finish (a ticket per tensor) merges its
// block partials in block order. Every row therefore equals stats_into's, bit for bit. A block
// finds its tensor by binary search over the first blocks. Histogram rows are zeroed by one small
// launch per pack first (unless accumulating). Tensors that are not flat (rare for gradients) run
// one stats_into launch each. The parameter gradients of a model: two or three launches per 24.
constexpr int kPackTensors = 24;  // MultiPack ~1.2 KB + BinThresholds ~2 KB of arguments

struct PackDesc {
  const void* x;
  int64_t n;
  void* row;      // the stats row (before any ring offset)
  int64_t* hist;  // the histogram row (before any ring offset), or nullptr
  int32_t first_block, nblocks;
  int32_t head;   // scalar elements before the first 16-byte aligned one
  int32_t pad;
};

struct MultiPack {
  PackDesc d[kPackTensors];
  StatsOut out;  // out_double and the ring; values is each tensor's row
  int32_t count;
};

__device__ __forceinline__ int pack_tensor(const MultiPack& pk) {
  int lo = 0, hi = pk.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (pk.d[mid].first_block <= static_cast<int>(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void multi_zero_hist_kernel(const __grid_constant__ MultiPack pk, int64_t hist_len) {
  const PackDesc& d = pk.d[blockIdx.x];
  unsigned long long* row = reinterpret_cast<unsigned long long*>(d.hist);
  if (pk.out.ring != nullptr) row += ring_slot(pk.out) * pk.out.ring_hist_elems;
  for (int64_t i = threadIdx.x; i < hist_len; i += blockDim.x) row[i] = 0ull;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
multi_stats_kernel(const __grid_constant__ MultiPack pk, HistSpec hs, int64_t hist_len, int hist_copies,
                   StatsPartial* __restrict__ block_partials, unsigned int* __restrict__ tickets,
                   const __grid_constant__ BinThresholds thr) {
  const int t = pack_tensor(pk);
  const PackDesc& d = pk.d[t];
  Share<scalar_t> share;
  share.x = static_cast<const scalar_t*>(d.x);
  share.n = d.n;
  share.head = d.head;
  share.layout.ndim = 0;
  share.flat = true;
  StatsOut out = pk.out;
  out.values = d.row;
  stats_block<scalar_t, false>(share, static_cast<int>(blockIdx.x) - d.first_block, d.nblocks,
                               block_partials + d.first_block, nullptr, tickets + t, out, hs, hist_len, hist_copies,
                               reinterpret_cast<unsigned long long*>(d.hist), thr, kRowAtomic);
}

template <typename scalar_t>
void launch_pack(const std::vector<MultiItem>& items, const std::vector<size_t>& idx, size_t from, size_t to,
                 const HistSpec& hs, int64_t hist_len, bool accumulate, int device, cudaStream_t stream) {
  MultiPack pk;
  std::memset(&pk, 0, sizeof(pk));
  pk.out = items[idx[from]].out;
  pk.out.values = nullptr;
  pk.count = static_cast<int32_t>(to - from);
  int64_t blocks = 0;
  for (size_t k = from; k < to; ++k) {
    const MultiItem& it = items[idx[k]];
    PackDesc& d = pk.d[k - from];
    d.x = first_element(*it.x);
    d.n = it.x->numel();
    d.row = it.out.values;
    d.hist = it.hist;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(d.x);
    const int64_t head = static_cast<int64_t>(((16 - addr % 16) % 16) / sizeof(scalar_t));
    d.head = static_cast<int32_t>(head < d.n ? head : d.n);
    d.first_block = static_cast<int32_t>(blocks);
    d.nblocks = launch_blocks<scalar_t>(d.n, device);
    blocks += d.nblocks;
  }
  if (hist_len > 0 && !accumulate) {
    multi_zero_hist_kernel<<<pk.count, 256, 0, stream>>>(pk, hist_len);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t ws_bytes = blocks * static_cast<int64_t>(sizeof(StatsPartial)) + kPackTensors * 4;
  at::Tensor ws = at::empty({ws_bytes}, items[idx[from]].x->options().dtype(at::kByte));
  auto* partials = reinterpret_cast<StatsPartial*>(ws.data_ptr());
  auto* tickets = reinterpret_cast<unsigned int*>(static_cast<char*>(ws.data_ptr()) + blocks * sizeof(StatsPartial));
  C10_CUDA_CHECK(cudaMemsetAsync(tickets, 0, kPackTensors * 4, stream));
  const int copies = hist_len == 0 ? 0 : (hist_len * kWarps * 4 <= kHistSmemBytes ? kWarps : 1);
  BinThresholds thr;
  HistSpec h = hs;
  const at::Tensor table = exact_thresholds<scalar_t>(h, hist_len, thr, *items[idx[from]].x, stream);
  const size_t smem = (static_cast<size_t>(hist_len) * copies + static_cast<size_t>(thr.n)) * sizeof(uint32_t);
  multi_stats_kernel<scalar_t><<<static_cast<unsigned int>(blocks), kThreads, smem, stream>>>(
      pk, h, hist_len, copies, partials, tickets, thr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// hookstats::stats_multi_into's CUDA backend (cuda/multi_stats_cuda.cu): Note [multi-tensor stats launches].
void stats_multi_cuda(const std::vector<MultiItem>& items, const HistSpec& hs, int64_t hist_len, bool accumulate) {
  if (items.empty()) return;
  const c10::Device device = items[0].x->device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  const int64_t hlen = items[0].hist == nullptr ? 0 : hist_len;
  // Each item once: packed (flat, no locations) by dtype, or on its own.
  std::vector<size_t> by_type[4];
  const at::ScalarType types[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};
  for (size_t i = 0; i < items.size(); ++i) {
    const MultiItem& it = items[i];
    const at::ScalarType st = it.x->scalar_type();
    const int k = st == at::kFloat ? 0 : st == at::kDouble ? 1 : st == at::kHalf ? 2 : 3;
    if (it.out.loc == nullptr && layout_of(*it.x).ndim == 0) by_type[k].push_back(i);
    else run_cuda(*it.x, it.out, hs, it.hist, hlen, accumulate);
  }
  for (int k = 0; k < 4; ++k) {
    const std::vector<size_t>& idx = by_type[k];
    for (size_t from = 0; from < idx.size(); from += kPackTensors) {
      const size_t to = std::min(idx.size(), from + static_cast<size_t>(kPackTensors));
      HOOKSTATS_DISPATCH_FLOATING_TYPES(types[k], "hookstats_stats_multi_cuda", [&] {
        launch_pack<scalar_t>(items, idx, from, to, hs, hlen, accumulate, device.index(), stream);
      });
    }
  }
}

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("stats", &stats_op<run_cuda>);
  m.impl("stats_into", &stats_into_op<run_cuda>);
  m.impl("stats_hist", &stats_hist_op<run_cuda>);
  m.impl("stats_loc", &stats_loc_op<run_cuda>);
}

}  // namespace hookstats
