// The device code the norm and clipping kernels share (kernels/clip_*.cu): a chunk's reads (Note [cuda tensor
// lists] in cuda/clip_cuda.cu), the per-thread norm passes (Note [norm piece], Note [cuda norm cold paths]) and
// the block merges. Torch-free.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "clip_launch.h"

namespace hookstats {
namespace clip_cuda {
namespace {

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

}  // namespace
}  // namespace clip_cuda
}  // namespace hookstats
