// CUDA implementation of hookstats::stats and hookstats::stats_into.
//
// One launch per tensor, on the current stream, no host sync:
//   * each thread reads its grid-stride share with 16-byte loads (an aligned body, a scalar
//     head for misaligned slices and a scalar tail), accumulates on the fast path of
//     core/stats_ops.h (Note [stats partials]) and re-reads its share only to count it when it
//     holds NaN/Inf (Note [stats nonfinite]), to scale it when its magnitudes ask for another
//     scale than its first pack did (Note [stats scaling]), or with a better shift;
//   * histograms go to per-warp shared sub-histograms, warp-aggregated (Note [cuda block histograms]);
//     range bins of float inputs are decided by exact thresholds passed by value (Note [exact bin
//     thresholds] in core/hist_ops.h), with no per-value float64 fallback near edges;
//   * partials are merged by warp shuffles and shared memory in a fixed order, written to a
//     per-block slot of a small workspace (grid <= 2 blocks of 256 threads per SM, ~100 bytes a block);
//   * the last block to finish (atomic ticket) merges the block partials in block order and
//     writes the results. No float atomics: results are bitwise reproducible on a device.
// Non-dense layouts are read element by element through StridedLayout (Note [layouts]).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../core/bindings.h"
#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/hist_ops.h"
#include "../core/layout.h"
#include "../core/stats_ops.h"
#include "cuda_util.cuh"

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

// Block-wide merge in a fixed order; the result is valid in thread 0.
__device__ StatsPartial block_merge(StatsPartial p, StatsPartial* smem) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const StatsPartial q = shfl_down(p, offset);
    merge(p, q);
  }
  if (lane == 0) smem[warp] = p;
  __syncthreads();
  if (warp == 0) {
    p = lane < kWarps ? smem[lane] : empty_partial();
    for (int offset = 16; offset > 0; offset >>= 1) {
      const StatsPartial q = shfl_down(p, offset);
      merge(p, q);
    }
  }
  __syncthreads();
  return p;
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
    if (!flat) {
      for (int64_t i = tid; i < n; i += nthreads) f(x[element_offset(layout, i)]);
      return;
    }
    if (tid < head) f(x[tid]);
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
#pragma unroll
        for (int j = 0; j < kVec; ++j) f(v[j]);
      }
    }
    for (; p < npacks; p += nthreads) {
      const uint4 r = __ldg(packs + p);
      const scalar_t* v = reinterpret_cast<const scalar_t*>(&r);
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(v[j]);
    }
    const int64_t t = head + npacks * kVec + tid;
    if (t < n) f(x[t]);
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
// ones on one address. Integer counts: exact, order-free. The block adds its sub-histograms
// into the int64 output row with one global atomic per nonzero slot.
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
// serve); the kernel then keeps fixed_slot.
struct BinThresholds {
  float T[kMaxArgThresholds];
  int32_t n;
};

// Calls f(value) for every element of the share, counting its histogram slot into this warp's
// sub-histogram h when the spec has one (by ordinal when hs.T is set).
template <typename scalar_t, typename F>
__device__ __forceinline__ void visit_counting(const Share<scalar_t>& share, int64_t tid, int64_t nthreads,
                                               const HistSpec& hs, uint32_t* h, F&& f) {
  using acc_t = typename AccOf<scalar_t>::type;
  if (hs.mode == kHistRange && hs.T != nullptr) {  // Note [exact bin thresholds]: counted by ordinal
    share.visit(tid, nthreads, [&](scalar_t r) {
      const acc_t v = static_cast<acc_t>(r);
      f(v);
      hist_inc(h, threshold_ordinal(static_cast<float>(v), hs, hs.T));
    });
  } else if (hs.mode == kHistRange) {
    share.visit(tid, nthreads, [&](scalar_t r) {
      const acc_t v = static_cast<acc_t>(r);
      f(v);
      hist_inc(h, fixed_slot<acc_t>(v, hs));
    });
  } else if (hs.mode == kHistExp) {
    share.visit(tid, nthreads, [&](scalar_t r) {
      f(static_cast<acc_t>(r));
      hist_inc(h, exp_slot_raw(r));
    });
  } else {
    share.visit(tid, nthreads, [&](scalar_t r) { f(static_cast<acc_t>(r)); });
  }
}

// The histogram is counted in the first visit only; re-reads only redo statistics. A share whose
// first pack holds NaN/Inf is only counted (Note [stats nonfinite]); a share whose magnitudes do
// not fit the first pack's scale is read again with its own (Note [stats scaling]).
template <typename scalar_t>
__device__ StatsPartial thread_partial(const Share<scalar_t>& share, int64_t tid, int64_t nthreads,
                                       const HistSpec& hs, uint32_t* sh_hist) {
  using acc_t = typename AccOf<scalar_t>::type;
  const typename Share<scalar_t>::Guess g = share.first_guess(tid);
  if (g.nonfinite) {
    NonfiniteAcc<acc_t> c;
    nonfinite_init<acc_t>(c);
    visit_counting(share, tid, nthreads, hs, sh_hist, [&](acc_t v) { nonfinite_add<acc_t>(c, v); });
    return nonfinite_to_partial<acc_t>(c);
  }
  FastAcc<acc_t> f;
  fast_init<acc_t>(f, g.k, g.e);
  visit_counting(share, tid, nthreads, hs, sh_hist, [&](acc_t v) { fast_add<acc_t>(f, v); });
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

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
stats_kernel(Share<scalar_t> share, StatsPartial* __restrict__ block_partials,
             unsigned int* __restrict__ ticket, StatsOut out, HistSpec hs, int64_t hist_len, int hist_copies,
             unsigned long long* __restrict__ hist_out, const __grid_constant__ BinThresholds thr) {
  __shared__ StatsPartial smem[kWarps];
  __shared__ bool is_last;
  // hist_copies sub-histograms (Note [cuda block histograms]), then thr's thresholds
  extern __shared__ uint32_t sh_hist[];
  for (int64_t i = threadIdx.x; i < hist_len * hist_copies; i += kThreads) sh_hist[i] = 0u;
  float* sh_T = reinterpret_cast<float*>(sh_hist + hist_len * hist_copies);
  for (int i = threadIdx.x; i < thr.n; i += kThreads) sh_T[i] = thr.T[i];
  if (thr.n > 0) hs.T = sh_T;
  if (hist_len > 0) __syncthreads();
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t* my_hist = sh_hist + ((threadIdx.x >> 5) % (hist_copies > 0 ? hist_copies : 1)) * hist_len;
  StatsPartial p = block_merge(thread_partial(share, tid, nthreads, hs, my_hist), smem);  // syncs the block
  for (int64_t i = threadIdx.x; i < hist_len; i += kThreads) {
    uint32_t c = 0u;
    for (int r = 0; r < hist_copies; ++r) c += sh_hist[r * hist_len + i];
    const int64_t slot = thr.n > 0 ? slot_of_ordinal(static_cast<int32_t>(i), hs.bins) : i;
    if (c != 0u) atomicAdd(hist_out + slot, static_cast<unsigned long long>(c));
  }
  if (gridDim.x == 1) {
    if (threadIdx.x == 0) store(p, out);
    return;
  }
  if (threadIdx.x == 0) {
    block_partials[blockIdx.x] = p;
    __threadfence();
    is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Thread t merges block partials t, t + kThreads, ... in order, then the block merges.
  StatsPartial q = empty_partial();
  for (unsigned int b = threadIdx.x; b < gridDim.x; b += kThreads) {
    const volatile StatsPartial* src = block_partials + b;
    StatsPartial r;
    r.n = src->n; r.nan = src->nan; r.inf = src->inf; r.zero = src->zero;
    r.sum = src->sum; r.l1 = src->l1; r.mn = src->mn; r.mx = src->mx;
    r.ssq = src->ssq; r.mean = src->mean; r.m2 = src->m2; r.e = src->e;
    merge(q, r);
  }
  q = block_merge(q, smem);
  if (threadIdx.x == 0) {
    store(q, out);
    *ticket = 0u;
  }
}

// hist: int64 counts on x's device (nullptr: no histogram); zeroed first unless accumulate.
void run_cuda(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
              bool accumulate) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const StridedLayout layout = layout_of(x);
  const int64_t n = x.numel();
  if (hist == nullptr) hist_len = 0;
  if (hist_len > 0 && !accumulate) {
    C10_CUDA_CHECK(cudaMemsetAsync(hist, 0, hist_len * sizeof(int64_t), stream));
  }
  HOOKSTATS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hookstats_stats_cuda", [&] {
    Share<scalar_t> share;
    share.x = static_cast<const scalar_t*>(first_element(x));
    share.n = n;
    share.layout = layout;
    share.flat = layout.ndim == 0;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(share.x);
    const int64_t head = static_cast<int64_t>(((16 - addr % 16) % 16) / sizeof(scalar_t));
    share.head = head < n ? head : n;
    const int64_t per_block = static_cast<int64_t>(kThreads) * Share<scalar_t>::kVec * kUnroll;
    const int64_t wanted = (n + per_block - 1) / per_block;
    const int64_t cap = 2 * static_cast<int64_t>(sm_count(x.device().index()));
    const int blocks = static_cast<int>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
    // Workspace: one partial per block and the ticket, from the caching allocator (stream
    // ordered, no cudaMalloc once warm).
    const int64_t ws_bytes = static_cast<int64_t>(blocks) * sizeof(StatsPartial) + 16;
    at::Tensor ws = at::empty({ws_bytes}, x.options().dtype(at::kByte));
    auto* partials = reinterpret_cast<StatsPartial*>(ws.data_ptr());
    auto* ticket = reinterpret_cast<unsigned int*>(static_cast<char*>(ws.data_ptr()) + ws_bytes - 16);
    C10_CUDA_CHECK(cudaMemsetAsync(ticket, 0, sizeof(unsigned int), stream));
    // Note [cuda block histograms]: a sub-histogram per warp when they fit, else one per block
    // (<= 8192 + 3 bins or 4098 exponent slots: at most 32 KB).
    const int copies = hist_len == 0 ? 0 : (hist_len * kWarps * 4 <= kHistSmemBytes ? kWarps : 1);
    // Note [exact bin thresholds]: float32-accumulated inputs, up to kMaxArgThresholds - 1 bins.
    BinThresholds thr;
    thr.n = 0;
    if (hist_len > 0 && hs.mode == kHistRange && !std::is_same<scalar_t, double>::value &&
        hs.bins < kMaxArgThresholds) {
      if (const float* T = cached_thresholds_f32(hs)) {
        thr.n = hs.bins + 1;
        std::memcpy(thr.T, T, static_cast<size_t>(thr.n) * sizeof(float));
      }
    }
    const size_t smem = (static_cast<size_t>(hist_len) * copies + static_cast<size_t>(thr.n)) * sizeof(uint32_t);
    stats_kernel<scalar_t><<<blocks, kThreads, smem, stream>>>(
        share, partials, ticket, out, hs, hist_len, copies, reinterpret_cast<unsigned long long*>(hist), thr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

// The single-tensor runner, for hookstats::stats_multi_into (cuda/multi_stats_cuda.cu).
void stats_cuda_runner(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
                       bool accumulate) {
  run_cuda(x, out, hs, hist, hist_len, accumulate);
}

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("stats", &stats_op<run_cuda>);
  m.impl("stats_into", &stats_into_op<run_cuda>);
  m.impl("stats_hist", &stats_hist_op<run_cuda>);
}

}  // namespace hookstats
