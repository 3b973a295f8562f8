// CUDA implementation of the multi-tensor norm and clipping ops: hookstats::norms,
// hookstats::scale_by_norm_ and hookstats::clamp_count_.
//
// Note [cuda tensor lists]
// Every tensor of the list is cut into chunks of chunk_len elements (>= 64K, and large enough
// that a list has at most about 4 chunks per SM beyond one per tensor); one block of 256
// threads handles one chunk, so one launch covers every tensor, whatever their number, sizes
// and dtypes (the block switches on its tensor's dtype). A list of more than one tensor is
// described in device memory (TensorDesc, StridedLayout and each tensor's first chunk: the
// list's table, Note [capture-safe tables]); a block finds its tensor by binary search. A
// single flat tensor travels in the kernel arguments instead, and needs no table.
//   norms: each thread reduces its share of a chunk (at most kMaxFastPiece values) on the fast
//     path of core/norm_ops.h, re-reading it in acc_t only to flag NaN/Inf or with a power-of-two
//     scale (Note [norm piece]; general p takes the careful path), the block merges
//     in a fixed order into a per-chunk partial, and the last block to finish (atomic ticket)
//     merges every tensor's chunks, then all tensors: per-tensor norms and the total, in the
//     same launch (Note [last-block merge]). No float atomics: results are bitwise reproducible.
//   scale_by_norm_: reads the total norm on the device; blocks exit at once when the
//     coefficient, rounded to their tensor's acc_t, is 1 (Note [coefficient one]).
//   clamp_count_: counts with integer atomics, one per block.
//
// Tables: Note [capture-safe tables] (cuda/device_tables.cuh). The fused clip_norm_ path is not used under
// capture (Note [clip_norm_ paths]).
// Flat 16-byte-aligned chunks use 16-byte loads and stores; other layouts go element by element
// (Note [layouts]).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/layout.h"
#include "../core/norm_ops.h"
#include "../core/tensor_list.h"
#include "cuda_util.cuh"
#include "device_tables.cuh"

namespace hookstats {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMinChunk = 65536;
constexpr int64_t kMaxChunk = int64_t(kThreads) * kMaxFastPiece;  // a thread's share stays a fast piece
constexpr int64_t kThreadMerge = 16;  // Note [last-block merge]

template <typename scalar_t> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

struct ListArgs {
  const TensorDesc* descs;       // device memory, unless single
  const StridedLayout* layouts;  // device memory
  const int64_t* chunk_start;    // device memory: n + 1 entries, tensor t's first chunk
  int64_t ntensors;
  int64_t chunk_len;
  bool single;  // one flat tensor, described by `one`: no device metadata
  TensorDesc one;
};

// The chunk a block handles.
struct Piece {
  TensorDesc d;
  const StridedLayout* layout;  // nullptr when flat
  int64_t begin, len;
};

__device__ __forceinline__ Piece locate(const ListArgs& a, int64_t chunk) {
  Piece p;
  int64_t first = 0;
  if (a.single) {
    p.d = a.one;
    p.layout = nullptr;
  } else {
    int64_t lo = 0, hi = a.ntensors - 1;  // the last tensor whose first chunk is <= chunk
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (a.chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    p.d = a.descs[lo];
    p.layout = p.d.layout >= 0 ? a.layouts + p.d.layout : nullptr;
    first = a.chunk_start[lo];
  }
  p.begin = (chunk - first) * a.chunk_len;
  p.len = min(a.chunk_len, p.d.numel - p.begin);
  return p;
}

// Calls f for each element of this thread's share of the piece, in a fixed order. Reading
// (kWrite false): f(value). Writing: f(value&) returns whether it changed the value, and a
// 16-byte pack is stored back only when one of its values changed.
template <bool kWrite, typename scalar_t, int UNROLL = 4, typename F>
__device__ __forceinline__ void for_share(const Piece& p, F&& f) {
  scalar_t* x = static_cast<scalar_t*>(p.d.data);
  if (p.layout != nullptr) {
    for (int64_t i = threadIdx.x; i < p.len; i += kThreads) f(x[strided_offset(p.layout, p.begin + i)]);
    return;
  }
  x += p.begin;
  constexpr int kVec = 16 / sizeof(scalar_t);
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t npacks = p.len / kVec;
    uint4* packs = reinterpret_cast<uint4*>(x);
#pragma unroll UNROLL
    for (int64_t k = threadIdx.x; k < npacks; k += kThreads) {
      uint4 r = kWrite ? packs[k] : __ldg(packs + k);
      scalar_t* v = reinterpret_cast<scalar_t*>(&r);
      if constexpr (kWrite) {
        bool changed = false;
#pragma unroll
        for (int j = 0; j < kVec; ++j) changed |= f(v[j]);
        if (changed) packs[k] = r;
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) f(v[j]);
      }
    }
    done = npacks * kVec;
  }
  for (int64_t i = done + threadIdx.x; i < p.len; i += kThreads) f(x[i]);
}

template <typename scalar_t, typename F>
__device__ __forceinline__ void visit(const Piece& p, F&& f) { for_share<false, scalar_t>(p, f); }

template <typename scalar_t, typename F>
__device__ __forceinline__ void update(const Piece& p, F&& f) { for_share<true, scalar_t>(p, f); }

// ---------------------------------------------------------------------------------------
// Norms.
// A thread's share as Note [norm piece] (core/norm_ops.h) reads it: visit(f) calls f(value) on
// each of its values in a fixed order, once per pass. Every pass is in acc_t: the fast sum
// (scaled by 2^-e when e != 0), or the NaN / Inf flags by compares alone.
template <int KIND, typename scalar_t, typename Visit>
struct ShareNormReader {
  using acc_t = typename AccOf<scalar_t>::type;
  const Visit& visit;
  __device__ __forceinline__ FastNorm<acc_t> fast(int32_t e) const {
    FastNorm<acc_t> f;
    fast_norm_init(f);
    if (KIND == kNormInf || e == 0) {
      visit([&](scalar_t r) { fast_norm_add<KIND, acc_t>(f, static_cast<acc_t>(r)); });
    } else {
      const acc_t sc = static_cast<acc_t>(ldexp(1.0, -e));  // exact: a normal power of two
      visit([&](scalar_t r) { fast_norm_add_scaled<KIND, acc_t>(f, static_cast<acc_t>(r), sc); });
    }
    return f;
  }
  __device__ __forceinline__ int32_t flags() const {
    int32_t fl = 0;
    visit([&](scalar_t r) { fl |= nonfinite_norm_flag<acc_t>(static_cast<acc_t>(r)); });
    return fl;
  }
};

// General p: the careful path, in double (it needs pow() per element anyway).
template <typename scalar_t, typename Visit>
__device__ __forceinline__ NormPartial careful_norm(const Visit& visit, const NormSpec& ns) {
  using acc_t = typename AccOf<scalar_t>::type;
  CarefulNorm c = careful_norm_init();
  visit([&](scalar_t r) { careful_norm_scan(c, static_cast<double>(static_cast<acc_t>(r))); });
  const int32_t ce = careful_norm_exponent(c, ns);
  double s = 0.0;
  if (!(c.flags & kNormHasNan)) {
    visit([&](scalar_t r) { s += careful_norm_term(static_cast<double>(static_cast<acc_t>(r)), ce, ns); });
  }
  return careful_norm_partial(c, s, ce, ns);
}

// The norm partial of the values a thread visits. first_amax: the largest finite |x| of the
// share's first values, for the first pass's scale (so vanishing or huge shares are read once).
// Every pass inline: the fused kernel, which reads its shared-memory tile (Note [fused clip_norm_]).
template <typename scalar_t, typename Visit>
__device__ NormPartial thread_norm(Visit&& visit, const NormSpec& ns, double first_amax) {
  using acc_t = typename AccOf<scalar_t>::type;
  using V = typename std::remove_reference<Visit>::type;
  int32_t e = norm_scale_exponent<acc_t>(first_amax);
  switch (ns.kind) {
    case kNorm2: return fast_norm_piece<acc_t>(ShareNormReader<kNorm2, scalar_t, V>{visit}, kNorm2, e);
    case kNorm1: return fast_norm_piece<acc_t>(ShareNormReader<kNorm1, scalar_t, V>{visit}, kNorm1, e);
    case kNormInf: return fast_norm_piece<acc_t>(ShareNormReader<kNormInf, scalar_t, V>{visit}, kNormInf, e);
    default: break;
  }
  return careful_norm<scalar_t>(visit, ns);
}

// Note [cuda norm cold paths]
// The norms kernel switches on each chunk's dtype, so it holds every dtype's passes: only its first,
// unscaled pass per norm kind is unrolled (piece_fast); the passes that unusual data needs (a scaled
// re-read, the NaN / Inf flags, general p) run out of line and without unrolling, as Note [cuda cold
// paths] (kernels/stats_kernel.cuh) does for the stats kernels. Each is a __noinline__ function of the
// chunk (Piece, by value).
template <int KIND, typename scalar_t>
__device__ __noinline__ FastNorm<typename AccOf<scalar_t>::type> piece_fast(const Piece p) {
  const auto visit = [&](auto&& f) { for_share<false, scalar_t, 4>(p, f); };
  return ShareNormReader<KIND, scalar_t, decltype(visit)>{visit}.fast(0);
}

template <int KIND, typename scalar_t>
__device__ __noinline__ FastNorm<typename AccOf<scalar_t>::type> piece_fast_scaled(const Piece p, int32_t e) {
  const auto visit = [&](auto&& f) { for_share<false, scalar_t, 1>(p, f); };
  return ShareNormReader<KIND, scalar_t, decltype(visit)>{visit}.fast(e);
}

template <typename scalar_t>
__device__ __noinline__ int32_t piece_flags(const Piece p) {
  const auto visit = [&](auto&& f) { for_share<false, scalar_t, 1>(p, f); };
  return ShareNormReader<kNorm2, scalar_t, decltype(visit)>{visit}.flags();
}

template <typename scalar_t>
__device__ __noinline__ NormPartial piece_careful(const Piece p, const NormSpec ns) {
  const auto visit = [&](auto&& f) { for_share<false, scalar_t, 1>(p, f); };
  return careful_norm<scalar_t>(visit, ns);
}

// The R of fast_norm_piece (Note [norm piece]) over one chunk, through the functions above.
template <int KIND, typename scalar_t>
struct PieceNormReader {
  Piece p;
  __device__ __forceinline__ FastNorm<typename AccOf<scalar_t>::type> fast(int32_t e) const {
    return KIND == kNormInf || e == 0 ? piece_fast<KIND, scalar_t>(p) : piece_fast_scaled<KIND, scalar_t>(p, e);
  }
  __device__ __forceinline__ int32_t flags() const { return piece_flags<scalar_t>(p); }
};

// The largest finite |x| of the first values this thread visits in p (its first 16-byte pack,
// or its first element).
template <typename scalar_t>
__device__ __forceinline__ double first_amax(const Piece& p) {
  using acc_t = typename AccOf<scalar_t>::type;
  const scalar_t* x = static_cast<const scalar_t*>(p.d.data);
  constexpr int kVec = 16 / sizeof(scalar_t);
  int64_t first = threadIdx.x, count = 1;
  if (p.layout == nullptr && reinterpret_cast<uintptr_t>(x + p.begin) % 16 == 0 && threadIdx.x < p.len / kVec) {
    first = static_cast<int64_t>(threadIdx.x) * kVec;
    count = kVec;
  }
  acc_t amax = acc_t(0);
  for (int64_t i = first; i < first + count && i < p.len; ++i) {
    const acc_t v = static_cast<acc_t>(p.layout != nullptr ? x[strided_offset(p.layout, p.begin + i)] : x[p.begin + i]);
    const acc_t a = v < acc_t(0) ? -v : v;
    if (a - a == acc_t(0) && a > amax) amax = a;
  }
  return static_cast<double>(amax);
}

template <typename scalar_t>
__device__ NormPartial piece_norm(const Piece& p, const NormSpec& ns) {
  using acc_t = typename AccOf<scalar_t>::type;
  int32_t e = norm_scale_exponent<acc_t>(first_amax<scalar_t>(p));
  switch (ns.kind) {
    case kNorm2: return fast_norm_piece<acc_t>(PieceNormReader<kNorm2, scalar_t>{p}, kNorm2, e);
    case kNorm1: return fast_norm_piece<acc_t>(PieceNormReader<kNorm1, scalar_t>{p}, kNorm1, e);
    case kNormInf: return fast_norm_piece<acc_t>(PieceNormReader<kNormInf, scalar_t>{p}, kNormInf, e);
    default: return piece_careful<scalar_t>(p, ns);
  }
}

// Warp-wide merge in a fixed order; the result is valid in lane 0.
__device__ __forceinline__ NormPartial warp_merge(NormPartial p, const NormSpec& ns) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    NormPartial q;
    q.s = __shfl_down_sync(0xffffffffu, p.s, offset);
    q.e = __shfl_down_sync(0xffffffffu, p.e, offset);
    q.flags = __shfl_down_sync(0xffffffffu, p.flags, offset);
    norm_merge(p, q, ns);
  }
  return p;
}

// Block-wide merge in a fixed order; the result is valid in thread 0.
__device__ NormPartial block_merge(NormPartial p, const NormSpec& ns, NormPartial* smem) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  p = warp_merge(p, ns);
  if (lane == 0) smem[warp] = p;
  __syncthreads();
  if (warp == 0) p = warp_merge(lane < kWarps ? smem[lane] : empty_norm(), ns);
  __syncthreads();
  return p;
}

__device__ __forceinline__ NormPartial load_partial(const NormPartial* src) {
  const volatile NormPartial* v = src;
  NormPartial r;
  r.s = v->s; r.e = v->e; r.flags = v->flags;
  return r;
}

__global__ void __launch_bounds__(kThreads)
norms_kernel(ListArgs a, NormSpec ns, NormPartial* __restrict__ partials, unsigned int* __restrict__ ticket,
             double* __restrict__ per, double* __restrict__ total) {
  __shared__ NormPartial smem[kWarps];
  __shared__ bool is_last;
  const Piece piece = locate(a, blockIdx.x);
  NormPartial p = empty_norm();
  switch (piece.d.dtype) {
    case kF64: p = piece_norm<double>(piece, ns); break;
    case kF16: p = piece_norm<c10::Half>(piece, ns); break;
    case kBF16: p = piece_norm<c10::BFloat16>(piece, ns); break;
    default: p = piece_norm<float>(piece, ns); break;
  }
  p = block_merge(p, ns, smem);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = p;
    __threadfence();
    is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Note [last-block merge]
  // The last block merges every tensor's chunk partials, tile by tile of kThreads tensors. A
  // tensor of at most kThreadMerge chunks is merged by its own thread, in chunk order; the
  // larger ones (one big tensor has up to ~4 chunks per SM: 528 on an H200) are listed in tensor
  // order and shared out to the warps (the k-th to warp k % kWarps), whose lane l merges chunks
  // l, l + 32, ... in order before warp_merge's fixed shuffle tree. Each thread's tensors then
  // merge into its total, and block_merge merges the threads. Which thread or warp merges what
  // depends only on the chunk counts, never on timing: results are bitwise reproducible, and no
  // thread merges more than ~kThreadMerge + a few partials serially.
  __shared__ int64_t big[kThreads];
  __shared__ int warp_big[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  NormPartial acc = empty_norm();
  for (int64_t base = 0; base < a.ntensors; base += kThreads) {
    const int64_t t = base + threadIdx.x;
    int64_t c0 = 0, c1 = 0;
    if (t < a.ntensors) {
      c0 = a.single ? 0 : a.chunk_start[t];
      c1 = a.single ? gridDim.x : a.chunk_start[t + 1];
    }
    const bool is_big = c1 - c0 > kThreadMerge;
    if (t < a.ntensors && !is_big) {
      NormPartial q = empty_norm();
      for (int64_t c = c0; c < c1; ++c) norm_merge(q, load_partial(partials + c), ns);
      per[t] = norm_finalize(q, ns);
      norm_merge(acc, q, ns);
    }
    const unsigned int mask = __ballot_sync(0xffffffffu, is_big);
    if (lane == 0) warp_big[warp] = __popc(mask);
    __syncthreads();
    int first = 0, nbig = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) first += warp_big[w];
      nbig += warp_big[w];
    }
    if (is_big) big[first + __popc(mask & ((1u << lane) - 1u))] = t;
    __syncthreads();
    for (int k = warp; k < nbig; k += kWarps) {
      const int64_t tb = big[k];
      const int64_t b0 = a.single ? 0 : a.chunk_start[tb];
      const int64_t b1 = a.single ? gridDim.x : a.chunk_start[tb + 1];
      NormPartial q = empty_norm();
      for (int64_t c = b0 + lane; c < b1; c += 32) norm_merge(q, load_partial(partials + c), ns);
      q = warp_merge(q, ns);
      if (lane == 0) {
        per[tb] = norm_finalize(q, ns);
        norm_merge(acc, q, ns);
      }
    }
    __syncthreads();  // big and warp_big are rewritten by the next tile
  }
  acc = block_merge(acc, ns, smem);
  if (threadIdx.x == 0) {
    *total = norm_finalize(acc, ns);
    *ticket = 0u;
  }
}

// ---------------------------------------------------------------------------------------
// Scaling and clamping.
template <typename scalar_t>
__device__ __forceinline__ void scale_piece(const Piece& p, double coef, bool zero) {
  using acc_t = typename AccOf<scalar_t>::type;
  if (scale_is_identity<acc_t>(coef, zero)) return;  // Note [coefficient one]
  const acc_t c = static_cast<acc_t>(coef);
  update<scalar_t>(p, [&](scalar_t& v) {
    v = static_cast<scalar_t>(scale_value<acc_t>(static_cast<acc_t>(v), c, zero));
    return true;
  });
}

__global__ void __launch_bounds__(kThreads)
scale_kernel(ListArgs a, const double* __restrict__ total, double max_norm, double eps, int policy) {
  const double norm = *total;
  const double coef = clip_coef(norm, max_norm, eps, policy);
  if (coef_is_identity(coef)) return;
  const bool zero = policy == kZero && !(norm - norm == 0.0);
  const Piece piece = locate(a, blockIdx.x);
  switch (piece.d.dtype) {
    case kF64: scale_piece<double>(piece, coef, zero); break;
    case kF16: scale_piece<c10::Half>(piece, coef, zero); break;
    case kBF16: scale_piece<c10::BFloat16>(piece, coef, zero); break;
    default: scale_piece<float>(piece, coef, zero); break;
  }
}

// The bounds of clamp_count_ rounded to each dtype (by the host, as torch.clamp rounds them),
// indexed by DtypeCode.
struct Bounds {
  double lo[4], hi[4];
};

template <typename scalar_t>
__device__ __forceinline__ unsigned long long clamp_piece(const Piece& p, const Bounds& b) {
  using acc_t = typename AccOf<scalar_t>::type;
  const int code = p.d.dtype;
  const acc_t lo = static_cast<acc_t>(b.lo[code]), hi = static_cast<acc_t>(b.hi[code]);
  const scalar_t lo_t = static_cast<scalar_t>(lo), hi_t = static_cast<scalar_t>(hi);
  unsigned long long n = 0;
  update<scalar_t>(p, [&](scalar_t& v) {
    const acc_t x = static_cast<acc_t>(v);
    if (!is_clipped(x, lo, hi)) return false;
    v = x < lo ? lo_t : hi_t;
    ++n;
    return true;
  });
  return n;
}

__global__ void __launch_bounds__(kThreads)
clamp_kernel(ListArgs a, const __grid_constant__ Bounds b, unsigned long long* __restrict__ count) {
  __shared__ unsigned long long smem[kWarps];
  const Piece piece = locate(a, blockIdx.x);
  unsigned long long n = 0;
  switch (piece.d.dtype) {
    case kF64: n = clamp_piece<double>(piece, b); break;
    case kF16: n = clamp_piece<c10::Half>(piece, b); break;
    case kBF16: n = clamp_piece<c10::BFloat16>(piece, b); break;
    default: n = clamp_piece<float>(piece, b); break;
  }
  for (int offset = 16; offset > 0; offset >>= 1) n += __shfl_down_sync(0xffffffffu, n, offset);
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long s = 0;
    for (int w = 0; w < kWarps; ++w) s += smem[w];
    if (s != 0) atomicAdd(count, s);  // integer atomics: exact, order-free
  }
}

// ---------------------------------------------------------------------------------------
// Note [fused clip_norm_]
// A flat, 16-byte-aligned tensor that fits in the shared memory of one co-resident grid (one
// block per SM, ~227 KB each on an H100/H200: ~29 MB) is clipped by one cooperative launch
// that reads and writes it once: each block copies its slice of x into shared memory and
// reduces it there (a flag or scaled pass re-reads shared memory, not x); the blocks' partials meet
// at a grid-wide barrier; every block merges them in block order (the same order in every
// block, so all compute the same coefficient, bit for bit); each block scales its slice from
// shared memory into x. Other tensors take the two-launch path (norms_kernel, scale_kernel);
// which tensors take which path, and the fall-back when the driver refuses the cooperative
// launch, are Note [clip_norm_ paths] (core/tensor_list.h).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
fused_clip_kernel(scalar_t* __restrict__ x, int64_t n, int64_t per_block, NormSpec ns, double max_norm, double eps,
                  int policy, NormPartial* __restrict__ partials, double* __restrict__ total_out) {
  extern __shared__ uint4 tile[];
  __shared__ NormPartial smem[kWarps];
  __shared__ double coef_s;
  __shared__ bool zero_s;
  using acc_t = typename AccOf<scalar_t>::type;
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t len = b0 < n ? min(per_block, n - b0) : 0;
  const int64_t full = len / kVec;  // whole 16-byte packs; only the last block can have a tail
  uint4* src = reinterpret_cast<uint4*>(x + b0);
  scalar_t* el = reinterpret_cast<scalar_t*>(tile);
#pragma unroll 4
  for (int64_t k = threadIdx.x; k < full; k += kThreads) tile[k] = src[k];  // several loads in flight
  for (int64_t i = full * kVec + threadIdx.x; i < len; i += kThreads) el[i] = x[b0 + i];
  __syncthreads();
  auto visit_tile = [&](auto&& f) {
    for (int64_t k = threadIdx.x; k < full; k += kThreads) {
      const uint4 r = tile[k];
      const scalar_t* v = reinterpret_cast<const scalar_t*>(&r);
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(v[j]);
    }
    for (int64_t i = full * kVec + threadIdx.x; i < len; i += kThreads) f(el[i]);
  };
  acc_t amax0 = acc_t(0);  // the largest finite |x| of this thread's first pack: the first pass's scale
  if (threadIdx.x < full) {
    const uint4 r = tile[threadIdx.x];
    const scalar_t* v = reinterpret_cast<const scalar_t*>(&r);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const acc_t y = static_cast<acc_t>(v[j]);
      const acc_t a = y < acc_t(0) ? -y : y;
      if (a - a == acc_t(0) && a > amax0) amax0 = a;
    }
  }
  NormPartial p = block_merge(thread_norm<scalar_t>(visit_tile, ns, static_cast<double>(amax0)), ns, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = p;
  cooperative_groups::this_grid().sync();
  if (threadIdx.x < 32) {  // warp 0 of every block: lane l merges partials l, l + 32, ..., then a fixed tree
    NormPartial acc = empty_norm();
    for (unsigned int b = threadIdx.x; b < gridDim.x; b += 32) norm_merge(acc, load_partial(partials + b), ns);
    acc = warp_merge(acc, ns);
    if (threadIdx.x == 0) {
      const double total = norm_finalize(acc, ns);
      coef_s = clip_coef(total, max_norm, eps, policy);
      zero_s = policy == kZero && !(total - total == 0.0);
      if (blockIdx.x == 0) *total_out = total;
    }
  }
  __syncthreads();
  const double coef = coef_s;
  const bool zero = zero_s;
  if (scale_is_identity<acc_t>(coef, zero)) return;  // Note [coefficient one]
  const acc_t c = static_cast<acc_t>(coef);
  for (int64_t k = threadIdx.x; k < full; k += kThreads) {
    uint4 r = tile[k];
    scalar_t* v = reinterpret_cast<scalar_t*>(&r);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = static_cast<scalar_t>(scale_value<acc_t>(static_cast<acc_t>(v[j]), c, zero));
    src[k] = r;
  }
  for (int64_t i = full * kVec + threadIdx.x; i < len; i += kThreads) {
    x[b0 + i] = static_cast<scalar_t>(scale_value<acc_t>(static_cast<acc_t>(el[i]), c, zero));
  }
}

// ---------------------------------------------------------------------------------------
// Host side: the chunks of a list (Note [cuda tensor lists]).
struct DeviceList {
  ListArgs args;
  int64_t nchunks;
  at::Tensor meta;  // the device table; cached, or freed by the caching allocator in stream order
};

DeviceList prepare(at::TensorList xs) {
  static thread_local std::vector<TensorDesc> descs;
  static thread_local std::vector<StridedLayout> layouts;
  static thread_local std::vector<uint4> words;
  describe(xs, descs, layouts);
  const int64_t n = static_cast<int64_t>(xs.size());
  int64_t total = 0;
  for (const TensorDesc& d : descs) total += d.numel;
  const int64_t sms = sm_count(xs[0].device().index());
  int64_t chunk = (total + 4 * sms - 1) / (4 * sms);
  chunk = (chunk + 4095) / 4096 * 4096;
  chunk = std::min(kMaxChunk, std::max(kMinChunk, chunk));
  DeviceList dl;
  std::memset(&dl.args, 0, sizeof(dl.args));
  dl.args.ntensors = n;
  dl.args.chunk_len = chunk;
  std::vector<int64_t> starts(static_cast<size_t>(n + 1));
  starts[0] = 0;
  for (int64_t t = 0; t < n; ++t) starts[t + 1] = starts[t] + (descs[t].numel + chunk - 1) / chunk;
  dl.nchunks = starts[n];
  TORCH_CHECK(dl.nchunks < (int64_t(1) << 31), "hookstats: too many chunks for one launch");
  if (n == 1 && descs[0].layout < 0) {
    dl.args.single = true;
    dl.args.one = descs[0];
    return dl;
  }
  if (dl.nchunks == 0) return dl;  // nothing to launch
  const size_t b_desc = descs.size() * sizeof(TensorDesc);
  const size_t b_lay = layouts.size() * sizeof(StridedLayout);
  const size_t off_lay = (b_desc + 15) / 16 * 16;
  const size_t off_cs = off_lay + (b_lay + 15) / 16 * 16;
  const size_t bytes = off_cs + starts.size() * sizeof(int64_t);
  const int64_t nwords = static_cast<int64_t>((bytes + 15) / 16);
  words.assign(static_cast<size_t>(nwords), uint4{0u, 0u, 0u, 0u});  // padding bytes zeroed: they are hashed
  char* h = reinterpret_cast<char*>(words.data());
  std::memcpy(h, descs.data(), b_desc);
  for (size_t i = 0; i < layouts.size(); ++i) {  // field by field: padding and unused dims stay zero
    StridedLayout z;
    std::memset(&z, 0, sizeof(z));
    z.ndim = layouts[i].ndim;
    for (int k = 0; k < z.ndim; ++k) {
      z.sizes[k] = layouts[i].sizes[k];
      z.strides[k] = layouts[i].strides[k];
    }
    std::memcpy(h + off_lay + i * sizeof(StridedLayout), &z, sizeof(z));
  }
  std::memcpy(h + off_cs, starts.data(), starts.size() * sizeof(int64_t));
  const c10::Device device = xs[0].device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  dl.meta = device_table(words.data(), nwords, device, stream, [&](std::vector<uint4>& w) { w = words; });
  char* d = static_cast<char*>(dl.meta.data_ptr());
  dl.args.descs = reinterpret_cast<const TensorDesc*>(d);
  dl.args.layouts = reinterpret_cast<const StridedLayout*>(d + off_lay);
  dl.args.chunk_start = reinterpret_cast<const int64_t*>(d + off_cs);
  return dl;
}

std::tuple<at::Tensor, at::Tensor> norms_cuda(at::TensorList xs, double p) {
  check_tensor_list(xs, "norms", false);
  check_norm_type(p, "norms");
  TORCH_CHECK_VALUE(!xs.empty(), "hookstats.norms needs at least one tensor");
  const c10::cuda::CUDAGuard guard(xs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs[0].device().index());
  const auto opts = xs[0].options().dtype(at::kDouble);
  DeviceList dl = prepare(xs);
  if (dl.nchunks == 0) {
    return {at::zeros({static_cast<int64_t>(xs.size())}, opts), at::zeros({}, opts)};
  }
  at::Tensor per = at::empty({static_cast<int64_t>(xs.size())}, opts);
  at::Tensor total = at::empty({}, opts);
  const int64_t ws_bytes = dl.nchunks * static_cast<int64_t>(sizeof(NormPartial)) + 16;
  at::Tensor ws = at::empty({ws_bytes}, xs[0].options().dtype(at::kByte));
  auto* partials = reinterpret_cast<NormPartial*>(ws.data_ptr());
  auto* ticket = reinterpret_cast<unsigned int*>(static_cast<char*>(ws.data_ptr()) + ws_bytes - 16);
  C10_CUDA_CHECK(cudaMemsetAsync(ticket, 0, sizeof(unsigned int), stream));
  norms_kernel<<<static_cast<unsigned int>(dl.nchunks), kThreads, 0, stream>>>(
      dl.args, make_norm_spec(p), partials, ticket, per.data_ptr<double>(), total.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {per, total};
}

void scale_by_norm_cuda(at::TensorList xs, const at::Tensor& total, double max_norm, double eps, int64_t policy) {
  check_tensor_list(xs, "scale_by_norm_", true);
  check_total(xs, total);
  check_clip_args(max_norm, eps, policy);
  if (xs.empty()) return;
  const c10::cuda::CUDAGuard guard(xs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs[0].device().index());
  DeviceList dl = prepare(xs);
  if (dl.nchunks == 0) return;
  scale_kernel<<<static_cast<unsigned int>(dl.nchunks), kThreads, 0, stream>>>(
      dl.args, total.data_ptr<double>(), max_norm, eps, static_cast<int>(policy));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor clamp_count_cuda(at::TensorList xs, double lo, double hi) {
  check_tensor_list(xs, "clamp_count_", true);
  check_bounds(lo, hi);
  TORCH_CHECK_VALUE(!xs.empty(), "hookstats.clamp_count_ needs at least one tensor");
  const c10::cuda::CUDAGuard guard(xs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs[0].device().index());
  at::Tensor count = at::zeros({}, xs[0].options().dtype(at::kLong));
  DeviceList dl = prepare(xs);
  if (dl.nchunks == 0) return count;
  Bounds b;
  b.lo[kF32] = static_cast<float>(lo); b.hi[kF32] = static_cast<float>(hi);
  b.lo[kF64] = lo; b.hi[kF64] = hi;
  b.lo[kF16] = static_cast<float>(static_cast<c10::Half>(lo)); b.hi[kF16] = static_cast<float>(static_cast<c10::Half>(hi));
  b.lo[kBF16] = static_cast<float>(static_cast<c10::BFloat16>(lo));
  b.hi[kBF16] = static_cast<float>(static_cast<c10::BFloat16>(hi));
  clamp_kernel<<<static_cast<unsigned int>(dl.nchunks), kThreads, 0, stream>>>(
      dl.args, b, reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return count;
}


// The launch of the fused path (Note [fused clip_norm_]) for x, if x qualifies on this device.
struct FusedPlan {
  int grid;
  int64_t per_block;  // elements per block, a multiple of 16 bytes
  size_t smem;
};

// Whether x qualifies for the fused path on its device; if not, why.
template <typename scalar_t>
bool plan_fused(const at::Tensor& x, FusedPlan& plan, std::string& why) {
  const int dev = x.device().index();
  int coop = 0, optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (!coop) {
    why = "the device has no cooperative launch";
    return false;
  }
  if (layout_of(x).ndim != 0 || reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) {
    why = "it needs a flat (dense), 16-byte-aligned tensor";
    return false;
  }
  const int64_t sms = sm_count(dev);
  const int64_t elem = sizeof(scalar_t);
  const int64_t max_tile = (static_cast<int64_t>(optin) - 1024) / 16 * 16;  // room for the static shared memory
  const int64_t bytes = x.numel() * elem;
  if (max_tile <= 0 || bytes > sms * max_tile) {
    why = "the tensor (" + std::to_string(bytes) + " bytes) does not fit in the shared memory of one grid (" +
          std::to_string(max_tile > 0 ? sms * max_tile : 0) + " bytes on this device)";
    return false;
  }
  static bool attr_set[64] = {false};
  if (dev >= 0 && dev < 64 && !attr_set[dev]) {
    const cudaError_t err = cudaFuncSetAttribute(fused_clip_kernel<scalar_t>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_tile));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the two-launch path must not see it
      why = std::string("cudaFuncSetAttribute failed (") + cudaGetErrorString(err) + ")";
      return false;
    }
    attr_set[dev] = true;
  }
  // Small tensors use fewer blocks (at least 4 KB each): fewer partials to merge.
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(sms, (bytes + 4095) / 4096));
  const int64_t vec = 16 / elem;
  int64_t per_block = (x.numel() + grid - 1) / grid;
  per_block = (per_block + vec - 1) / vec * vec;
  const size_t smem = static_cast<size_t>(per_block * elem);
  int resident = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fused_clip_kernel<scalar_t>, kThreads, smem);
  if (err != cudaSuccess) (void)cudaGetLastError();
  if (static_cast<int64_t>(smem) > max_tile || err != cudaSuccess || resident < 1 || grid > resident * sms) {
    why = "one block per multiprocessor does not fit its slice in shared memory";
    return false;
  }
  plan = FusedPlan{static_cast<int>(grid), per_block, smem};
  // Tests only: one block more than can be co-resident, so that the driver refuses the launch
  // (cudaErrorCooperativeLaunchTooLarge) and the fall-back runs (tests/test_clip.py).
  const char* over = std::getenv("HOOKSTATS_TEST_OVERSUBSCRIBE_FUSED");
  if (over != nullptr && over[0] == '1') plan.grid = static_cast<int>(resident * sms + 1);
  return true;
}

// One cooperative launch of the fused path, if x qualifies and the driver accepts it; else
// false with the reason, and no CUDA error left behind.
template <typename scalar_t>
bool try_fused(const at::Tensor& x, double p, double max_norm, double eps, int64_t policy, const at::Tensor& total,
               cudaStream_t stream, std::string& why) {
  FusedPlan plan;
  if (!plan_fused<scalar_t>(x, plan, why)) return false;
  at::Tensor ws = at::empty({static_cast<int64_t>(plan.grid) * static_cast<int64_t>(sizeof(NormPartial))},
                            x.options().dtype(at::kByte));
  scalar_t* xp = static_cast<scalar_t*>(x.data_ptr());
  int64_t n = x.numel();
  int64_t per_block = plan.per_block;
  NormSpec ns = make_norm_spec(p);
  int pol = static_cast<int>(policy);
  NormPartial* partials = reinterpret_cast<NormPartial*>(ws.data_ptr());
  double* out = total.data_ptr<double>();
  void* args[] = {&xp, &n, &per_block, &ns, &max_norm, &eps, &pol, &partials, &out};
  const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&fused_clip_kernel<scalar_t>),
                                                      dim3(plan.grid), dim3(kThreads), args, plan.smem, stream);
  if (err != cudaSuccess) {
    // Refused (cudaErrorCooperativeLaunchTooLarge under MPS or on a partitioned device, ...):
    // nothing ran. Clear the error state so the two-launch path starts clean.
    (void)cudaGetLastError();
    why = std::string("the driver refused the cooperative launch (") + cudaGetErrorName(err) + ": " +
          cudaGetErrorString(err) + ")";
    return false;
  }
  return true;
}

// path: Note [clip_norm_ paths] (core/tensor_list.h).
at::Tensor clip_norm_cuda(const at::Tensor& x, double p, double max_norm, double eps, int64_t policy, int64_t path) {
  const at::Tensor xs[1] = {x};
  check_tensor_list(xs, "clip_norm_", true);
  check_norm_type(p, "clip_norm_");
  check_clip_args(max_norm, eps, policy);
  check_clip_path(path);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  if (x.numel() == 0) return at::zeros({}, x.options().dtype(at::kDouble));
  if (wants_fused(path, x.numel() * static_cast<int64_t>(x.element_size()))) {
    if (capturing()) {
      fused_unavailable(path, "not under CUDA graph capture (path 0 captures the two launches)");
    } else {
      at::Tensor total = at::empty({}, x.options().dtype(at::kDouble));
      bool launched = false;
      std::string why;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hookstats_clip_norm_cuda", [&] {
        launched = try_fused<scalar_t>(x, p, max_norm, eps, policy, total, stream, why);
      });
      if (launched) return total;
      fused_unavailable(path, why);
    }
  }
  auto [per, t] = norms_cuda(xs, p);
  scale_by_norm_cuda(xs, t, max_norm, eps, policy);
  return t;
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("norms", &norms_cuda);
  m.impl("scale_by_norm_", &scale_by_norm_cuda);
  m.impl("clamp_count_", &clamp_count_cuda);
  m.impl("clip_norm_", &clip_norm_cuda);
}

}  // namespace hookstats
