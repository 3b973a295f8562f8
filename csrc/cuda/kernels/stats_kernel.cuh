// The stats kernels (hookstats::stats, stats_into, stats_multi_into on CUDA), included by one small
// translation unit per dtype and variant (kernels/stats_*.cu, HOOKSTATS_STATS_KERNELS below) so that
// ptxas runs them side by side. Torch-free: raw pointers and the structs of stats_launch.h.
//
// One launch per tensor (or per pack of tensors), on the caller's stream, no host sync:
//   * each thread reads its grid-stride share with 16-byte loads (an aligned body, a scalar
//     head for misaligned slices and a scalar tail), accumulates on the fast path of
//     core/stats_ops.h (Note [stats partials]) with a shift and a scale guessed from the first
//     packs of its warp (Note [cuda shift guess]), and re-reads its share, out of line
//     (reread_share), only to count it when it holds NaN/Inf (Note [stats nonfinite]), to scale it
//     when its magnitudes ask for another scale than its first pack did (Note [stats scaling]), or
//     with a better shift;
//   * histograms go to per-warp shared sub-histograms, warp-aggregated (Note [cuda block histograms]);
//     range bins are decided by exact thresholds staged in shared memory (Note [exact bin thresholds],
//     Note [thresholds in shared memory]), with no per-value float64 fallback near edges;
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
// order. The kernel without locations is the same code without those steps.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "stats_block_merge.cuh"
#include "stats_launch.h"

namespace hookstats {
namespace stats_cuda {
namespace {

// What one thread reads: its grid-stride share of the tensor.
template <typename scalar_t>
struct Share {
  const scalar_t* __restrict__ x;
  int64_t n;
  int64_t head;  // scalar elements before the first 16-byte aligned one (flat layout)
  const StridedLayout* layout;  // nullptr: flat; else the launch's (in its arguments)

  static constexpr int kVec = 16 / sizeof(scalar_t);

  // Calls f(value, flat index) for every element of thread tid's share, in a fixed order; callers that need no
  // index ignore it, and the compiler drops its arithmetic. UNROLL packs are loaded before they are used (the
  // bandwidth-bound first read); re-reads pass 1 (Note [cuda cold paths]).
  template <int UNROLL = kUnroll, typename F>
  __device__ __forceinline__ void visit_i(int64_t tid, int64_t nthreads, F&& f) const {
    if (layout != nullptr) {
      for (int64_t i = tid; i < n; i += nthreads) f(x[strided_offset(layout, i)], i);
      return;
    }
    if (tid < head) f(x[tid], tid);
    const int64_t npacks = (n - head) / kVec;
    const uint4* packs = reinterpret_cast<const uint4*>(x + head);
    int64_t p = tid;
    if constexpr (UNROLL > 1) {
      for (; p + (UNROLL - 1) * nthreads < npacks; p += UNROLL * nthreads) {
        uint4 r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) r[u] = __ldg(packs + p + u * nthreads);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const scalar_t* v = reinterpret_cast<const scalar_t*>(&r[u]);
          const int64_t i0 = head + (p + u * nthreads) * kVec;
#pragma unroll
          for (int j = 0; j < kVec; ++j) f(v[j], i0 + j);
        }
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

  // Note [cuda shift guess]
  // The fast path's shift k should be near the mean of the thread's share, or sum(d^2) cancels and
  // the share is read again (shift_is_poor). The first pack of one thread holds 2 (fp64) to 8 values:
  // its mean misses the share's by ~0.5-0.7 standard deviations, so ~0.05% of fp32 and ~1.4% of fp64
  // threads re-read their whole share alone after the bandwidth-bound pass. The guess is therefore
  // the mean of the finite values of the warp's first packs (32 x 2-8 values, combined by a fixed
  // shuffle tree in double and broadcast from lane 0): its error is ~1/10 of a standard deviation.
  // The scale exponent stays each thread's own (Note [stats scaling]), and so does the NaN/Inf flag.
  // Requires every lane of the warp (stats_block calls it from all threads).
  struct Guess {
    typename AccOf<scalar_t>::type k;
    int32_t e;
  };
  __device__ __forceinline__ Guess first_guess(int64_t tid) const {
    using acc_t = typename AccOf<scalar_t>::type;
    int64_t first = tid, count = 1;
    if (layout == nullptr && tid >= head) {
      first = head + tid * kVec;
      count = kVec;
    }
    double s = 0.0, amax = 0.0;
    double m = 0.0;
    for (int64_t i = first; i < first + count && i < n; ++i) {
      const double v = static_cast<double>(static_cast<acc_t>(x[layout == nullptr ? i : strided_offset(layout, i)]));
      if (!(v - v == 0.0)) continue;
      s += v;
      m += 1.0;
      amax = fabs(v) > amax ? fabs(v) : amax;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      s += __shfl_down_sync(0xffffffffu, s, offset);
      m += __shfl_down_sync(0xffffffffu, m, offset);
    }
    s = __shfl_sync(0xffffffffu, s, 0);
    m = __shfl_sync(0xffffffffu, m, 0);
    Guess g;
    g.e = scale_exponent<acc_t>(amax);
    g.k = shift_of(m > 0.0 ? ldexp(s / m, -g.e) : 0.0);
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

__device__ __forceinline__ void hist_inc(uint32_t* h, int32_t slot) {
  const unsigned active = __activemask();
  const unsigned peers = __match_any_sync(active, static_cast<unsigned>(slot));
  const int lane = threadIdx.x & 31;
  if (lane == __ffs(peers) - 1) atomicAdd(h + slot, static_cast<uint32_t>(__popc(peers)));
}

// A range slot without thresholds (Note [thresholds in shared memory]: a rare range or device), out of line.
template <typename acc_t>
__device__ __noinline__ int32_t cold_fixed_slot(acc_t v, const HistSpec& hs) { return fixed_slot<acc_t>(v, hs); }

// Calls f(value, index) for every element of the share (index: its flat logical position), counting
// its histogram slot into this warp's sub-histogram h when the spec has one: by ordinal when T (the
// thresholds staged in shared memory, Note [thresholds in shared memory]) is set.
template <typename scalar_t, typename F>
__device__ __forceinline__ void visit_counting(const Share<scalar_t>& share, int64_t tid, int64_t nthreads,
                                               const HistSpec& hs, const typename AccOf<scalar_t>::type* T,
                                               uint32_t* h, F&& f) {
  using acc_t = typename AccOf<scalar_t>::type;
  if (hs.mode == kHistRange && T != nullptr) {  // Note [exact bin thresholds]: counted by ordinal
    share.visit_i(tid, nthreads, [&](scalar_t r, int64_t i) {
      const acc_t v = static_cast<acc_t>(r);
      f(v, i);
      hist_inc(h, threshold_ordinal(v, hs, T));
    });
  } else if (hs.mode == kHistRange) {
    share.visit_i(tid, nthreads, [&](scalar_t r, int64_t i) {
      const acc_t v = static_cast<acc_t>(r);
      f(v, i);
      hist_inc(h, cold_fixed_slot(v, hs));
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

// Note [cuda cold paths]
// What a share needs only when its data is unusual, out of line (__noinline__) and read without
// unrolling, so that the hot first read keeps its registers and each kernel compiles to a fraction of
// the code: the re-reads after the first pass (NaN/Inf counts, another scale, a better shift). The
// histogram is counted in the first read only; re-reads only redo statistics. A share whose first
// read found NaN/Inf is only counted (Note [stats nonfinite]); one whose magnitudes do not fit the
// first pack's scale is read again with its own (Note [stats scaling]); one whose shift was poor, with
// its mean.
template <typename scalar_t>
__device__ __noinline__ StatsPartial reread_share(const Share<scalar_t> share, int64_t tid, int64_t nthreads,
                                                  FastAcc<typename AccOf<scalar_t>::type> f) {
  using acc_t = typename AccOf<scalar_t>::type;
  if (fast_nonfinite<acc_t>(f)) {
    NonfiniteAcc<acc_t> c;
    nonfinite_init<acc_t>(c);
    share.template visit_i<1>(tid, nthreads, [&](scalar_t r, int64_t) { nonfinite_add<acc_t>(c, static_cast<acc_t>(r)); });
    if (c.nan > 0 || c.inf > 0) return nonfinite_to_partial<acc_t>(c);
  }
  const double amax = fast_amax<acc_t>(f);
  if (fast_nonfinite<acc_t>(f) || !scale_fits<acc_t>(amax, f.e)) {
    fast_init<acc_t>(f, acc_t(0), scale_exponent<acc_t>(amax));  // no shift: see stats_cpu.cpp
    share.template visit_i<1>(tid, nthreads, [&](scalar_t r, int64_t) { fast_add<acc_t>(f, static_cast<acc_t>(r)); });
  }
  if (shift_is_poor<acc_t>(f)) {
    fast_init<acc_t>(f, Share<scalar_t>::shift_of(static_cast<double>(fast_mean<acc_t>(f))), f.e);
    share.template visit_i<1>(tid, nthreads, [&](scalar_t r, int64_t) { fast_add<acc_t>(f, static_cast<acc_t>(r)); });
  }
  return fast_to_partial<acc_t>(f);
}

// The partial of thread tid's share: one fast read (counting the histogram, and with LOC the locations into
// *loc), and the cold re-reads only when the fast result cannot be trusted (Note [cuda cold paths]).
template <typename scalar_t, bool LOC>
__device__ __forceinline__ StatsPartial thread_partial(const Share<scalar_t>& share, int64_t tid, int64_t nthreads,
                                                       const HistSpec& hs, const typename AccOf<scalar_t>::type* T,
                                                       uint32_t* sh_hist, LocAcc<typename AccOf<scalar_t>::type>& loc) {
  using acc_t = typename AccOf<scalar_t>::type;
  const typename Share<scalar_t>::Guess g = share.first_guess(tid);
  FastAcc<acc_t> f;
  fast_init<acc_t>(f, g.k, g.e);
  visit_counting(share, tid, nthreads, hs, T, sh_hist, [&](acc_t v, int64_t i) {
    fast_add<acc_t>(f, v);
    if constexpr (LOC) loc_add<acc_t>(loc, v, i);
  });
  if (fast_nonfinite<acc_t>(f) || !scale_fits<acc_t>(fast_amax<acc_t>(f), f.e) || shift_is_poor<acc_t>(f)) {
    return reread_share<scalar_t>(share, tid, nthreads, f);
  }
  return fast_to_partial<acc_t>(f);
}

// The last block's merge of the block partials in block order (Note [single-block rows]).
__device__ __noinline__ StatsPartial merge_block_partials(const StatsPartial* block_partials, int nblocks,
                                                          StatsPartial* smem) {
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
  return block_merge(q, smem);
}

__device__ __noinline__ LocPartial merge_block_locs(const LocPartial* block_locs, int nblocks, LocPartial* smem_loc) {
  LocPartial ql = empty_loc();
  for (int b = threadIdx.x; b < nblocks; b += kThreads) {
    const volatile LocPartial* src = block_locs + b;
    LocPartial r;
    r.amax = src->amax; r.amax_i = src->amax_i; r.nf_i = src->nf_i;
    loc_merge(ql, r);
  }
  return block_merge_loc(ql, smem_loc);
}

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
  // hist_copies sub-histograms (Note [cuda block histograms]), then thr's thresholds (Note [thresholds in shared
  // memory]), 16-byte aligned
  extern __shared__ uint4 dyn_smem[];
  uint32_t* const sh_hist = reinterpret_cast<uint32_t*>(dyn_smem);
  for (int64_t i = threadIdx.x; i < hist_len * hist_copies; i += kThreads) sh_hist[i] = 0u;
  acc_t* const sh_T = reinterpret_cast<acc_t*>(reinterpret_cast<char*>(dyn_smem) +
                                               hist_smem_bytes(hist_len, hist_copies));
  if (thr.table == nullptr) {
    for (int i = threadIdx.x; i < thr.n; i += kThreads) sh_T[i] = static_cast<acc_t>(thr.T[i]);
  } else {
    const acc_t* table = static_cast<const acc_t*>(thr.table);
    for (int i = threadIdx.x; i < thr.n; i += kThreads) sh_T[i] = __ldg(table + i);
  }
  if (hist_len > 0) __syncthreads();
  const int64_t nthreads = static_cast<int64_t>(nblocks) * kThreads;
  const int64_t tid = static_cast<int64_t>(block) * kThreads + threadIdx.x;
  uint32_t* my_hist = sh_hist + ((threadIdx.x >> 5) % (hist_copies > 0 ? hist_copies : 1)) * hist_len;
  const bool ordinal = thr.n > 0;
  LocAcc<acc_t> tl;  // unused without LOC
  loc_init(tl);
  StatsPartial p = block_merge(thread_partial<scalar_t, LOC>(share, tid, nthreads, hs, ordinal ? sh_T : nullptr,
                                                             my_hist, tl),
                               smem);  // syncs the block
  LocPartial bl = empty_loc();
  if constexpr (LOC) bl = block_merge_loc(loc_to_partial(tl), smem_loc);
  if (out.ring != nullptr && hist_len > 0) hist_out += ring_slot(out) * out.ring_hist_elems;  // Note [ring rows]
  for (int64_t i = threadIdx.x; i < hist_len; i += kThreads) {
    uint32_t c = 0u;
    for (int r = 0; r < hist_copies; ++r) c += sh_hist[r * hist_len + i];
    const int64_t slot = ordinal ? slot_of_ordinal(static_cast<int32_t>(i), hs.bins) : i;
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
  const StatsPartial q = merge_block_partials(block_partials, nblocks, smem);
  LocPartial ql = empty_loc();
  if constexpr (LOC) ql = merge_block_locs(block_locs, nblocks, smem_loc);
  if (threadIdx.x == 0) {
    store(q, out);
    if constexpr (LOC) store_loc(ql, ring_loc(out));
    *ticket = 0u;
  }
}

template <typename scalar_t, bool LOC>
__global__ void __launch_bounds__(kThreads)
stats_kernel(const __grid_constant__ StatsLaunch a, const __grid_constant__ BinThresholds thr) {
  Share<scalar_t> share;
  share.x = static_cast<const scalar_t*>(a.x);
  share.n = a.n;
  share.head = a.head;
  share.layout = a.layout.ndim == 0 ? nullptr : &a.layout;
  stats_block<scalar_t, LOC>(share, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), a.partials, a.locs,
                             a.ticket, a.out, a.hs, a.hist_len, a.hist_copies, a.hist, thr, a.row_mode);
}

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
multi_stats_kernel(const __grid_constant__ MultiPack pk, const __grid_constant__ MultiLaunch a,
                   const __grid_constant__ BinThresholds thr) {
  const int t = pack_tensor(pk);
  const PackDesc& d = pk.d[t];
  Share<scalar_t> share;
  share.x = static_cast<const scalar_t*>(d.x);
  share.n = d.n;
  share.head = d.head;
  share.layout = nullptr;
  StatsOut out = pk.out;
  out.values = d.row;
  stats_block<scalar_t, false>(share, static_cast<int>(blockIdx.x) - d.first_block, d.nblocks,
                               a.partials + d.first_block, nullptr, a.tickets + t, out, a.hs, a.hist_len,
                               a.hist_copies, reinterpret_cast<unsigned long long*>(d.hist), thr, kRowAtomic);
}

// Note [dynamic shared memory opt-in]
// A block's shared memory is the kernel's static part (stats_block's merge slots, kStaticSmemBytes in the source,
// the compiler's own figure in cudaFuncAttributes::sharedSizeBytes) plus the launch's dynamic part (sub-histograms
// and staged thresholds). Past 48 KB in all, not in dynamic memory alone, the kernel must have been opted in
// (cudaFuncAttributeMaxDynamicSharedMemorySize), else every launch fails with "invalid argument": before issue 33
// the test was on the dynamic part only, and range histograms of 6,044-6,141 bins (float32/16, bf16) or 4,030-4,093
// (float64) did not launch. Launches far below the limit ask nothing; near it the kernel's static size is asked
// (a host call, no stream operation: allowed under graph capture). The opt-in is for the most any launch needs (so
// that concurrent launches cannot shrink it under each other), or for this launch's need on a device that has
// less. tests/test_cuda_smem.py launches every entry point at both ends of those bands.
constexpr int kDefaultSmemLimit = 48 * 1024;
constexpr int kMaxDynamicSmem = static_cast<int>(kHistSmemBytes + 16 + (kMaxHistBins + 1) * sizeof(double));
constexpr size_t kStaticSmemSlack = 4096;  // far more than any static part could be (kStaticSmemBytes is 784)
static_assert(kStaticSmemBytes < kStaticSmemSlack, "the static part must stay far below the slack");
template <typename K>
cudaError_t allow_smem(K kernel, size_t smem) {
  if (smem + kStaticSmemSlack <= static_cast<size_t>(kDefaultSmemLimit)) return cudaSuccess;
  cudaFuncAttributes fa;
  const cudaError_t err = cudaFuncGetAttributes(&fa, kernel);
  if (err != cudaSuccess) return err;
  if (smem + fa.sharedSizeBytes <= static_cast<size_t>(kDefaultSmemLimit)) return cudaSuccess;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicSmem) == cudaSuccess) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

}  // namespace

template <typename scalar_t, bool LOC>
cudaError_t launch_stats(const StatsLaunch& a, const BinThresholds& thr, cudaStream_t stream) {
  const cudaError_t err = allow_smem(stats_kernel<scalar_t, LOC>, a.smem);
  if (err != cudaSuccess) return err;
  stats_kernel<scalar_t, LOC><<<a.blocks, kThreads, a.smem, stream>>>(a, thr);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t launch_multi(const MultiPack& pk, const MultiLaunch& a, const BinThresholds& thr, cudaStream_t stream) {
  if (a.zero_hist) {
    multi_zero_hist_kernel<<<pk.count, 256, 0, stream>>>(pk, a.hist_len);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const cudaError_t err = allow_smem(multi_stats_kernel<scalar_t>, a.smem);
  if (err != cudaSuccess) return err;
  multi_stats_kernel<scalar_t><<<a.blocks, kThreads, a.smem, stream>>>(pk, a, thr);
  return cudaGetLastError();
}

}  // namespace stats_cuda
}  // namespace hookstats

// One translation unit's kernels: kernels/stats_<dtype>.cu, stats_loc_<dtype>.cu and stats_multi_<dtype>.cu
// each expand one of these.
#define HOOKSTATS_STATS_KERNELS(scalar_t, LOC)                                                                    \
  namespace hookstats::stats_cuda {                                                                              \
  template cudaError_t launch_stats<scalar_t, LOC>(const StatsLaunch&, const BinThresholds&, cudaStream_t);       \
  }
#define HOOKSTATS_STATS_MULTI_KERNELS(scalar_t)                                                                   \
  namespace hookstats::stats_cuda {                                                                              \
  template cudaError_t launch_multi<scalar_t>(const MultiPack&, const MultiLaunch&, const BinThresholds&,        \
                                              cudaStream_t);                                                     \
  }
