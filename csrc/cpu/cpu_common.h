// Pieces shared by the CPU kernels (stats, channel and clip): the SIMD lane types of each
// dtype, and walking a strided tensor (Note [layouts]) in contiguous runs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "../core/layout.h"
#include "simd.h"

namespace hookstats {

template <typename scalar_t> struct BitsOf { using type = scalar_t; };
template <> struct BitsOf<c10::Half> { using type = simd::HalfBits; };
template <> struct BitsOf<c10::BFloat16> { using type = simd::BF16Bits; };

template <typename scalar_t>
using acc_of = typename simd::Lanes<typename BitsOf<scalar_t>::type, 16>::acc_t;

template <typename scalar_t, int B>
using LanesOf = simd::Lanes<typename BitsOf<scalar_t>::type, B>;

// The lane types of a kernel body over B-byte vectors of scalar_t (Note [cpu dispatch]), declared in its scope:
// L (loads and stores), acc_t (the type values are read in), V (W lanes of acc_t) and M (their -1 / 0 masks).
#define HS_LANE_TYPES(scalar_t, B)                                   \
  using L = LanesOf<scalar_t, B>;                                    \
  using acc_t [[maybe_unused]] = typename L::acc_t;                  \
  using V [[maybe_unused]] = typename L::V;                          \
  using M [[maybe_unused]] = typename L::M;                          \
  [[maybe_unused]] constexpr int W = L::W

// Calls f(q, stride, n) for the runs of the innermost dimension that hold logical elements
// [start, start + len) of a strided tensor, in logical order: q points at the run's first
// element, which is followed by n - 1 more at `stride` elements apart.
template <typename scalar_t, typename F>
HS_INLINE void for_each_run(scalar_t* base, const StridedLayout& l, int64_t start, int64_t len, F&& f) {
  int64_t idx[kMaxDims];
  int64_t rem = start, off = 0;
  const int last = l.ndim - 1;
  for (int d = last; d >= 0; --d) {
    idx[d] = rem % l.sizes[d];
    rem /= l.sizes[d];
    off += idx[d] * l.strides[d];
  }
  int64_t i = 0;
  const int64_t st = l.strides[last];
  while (i < len) {
    const int64_t inner = std::min(l.sizes[last] - idx[last], len - i);
    f(base + off, st, inner);
    i += inner;
    off += inner * st;
    idx[last] += inner;
    for (int d = last; d > 0 && idx[d] == l.sizes[d]; --d) {
      off -= l.sizes[d] * l.strides[d];
      idx[d] = 0;
      idx[d - 1] += 1;
      off += l.strides[d - 1];
    }
  }
}

// Copies logical elements [start, start + len) of a strided tensor into buf.
template <typename scalar_t>
void gather(const scalar_t* base, const StridedLayout& l, int64_t start, int64_t len, scalar_t* buf) {
  scalar_t* out = buf;
  for_each_run(base, l, start, len, [&](const scalar_t* q, int64_t st, int64_t n) {
    for (int64_t j = 0; j < n; ++j) out[j] = q[j * st];
    out += n;
  });
}

}  // namespace hookstats
