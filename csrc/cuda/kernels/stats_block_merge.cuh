// The block-wide merges of the stats kernels' per-thread partials (StatsPartial, and LocPartial with locations):
// warp shuffles, then the warps' results through shared memory, in a fixed order, so that the merged partial is the
// same on every run (no float atomics). Included by stats_kernel.cuh only. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "stats_launch.h"

namespace hookstats {
namespace stats_cuda {
namespace {

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

__device__ __noinline__ StatsPartial block_merge(StatsPartial p, StatsPartial* smem) {
  return block_merge_with(p, smem, empty_partial(), [](StatsPartial& a, const StatsPartial& b) { merge(a, b); });
}

// The location merge (Note [element locations]).
__device__ __noinline__ LocPartial block_merge_loc(LocPartial l, LocPartial* smem) {
  return block_merge_with(l, smem, empty_loc(), [](LocPartial& a, const LocPartial& b) { loc_merge(a, b); });
}

}  // namespace
}  // namespace stats_cuda
}  // namespace hookstats
