// Torch-free description of where a tensor's elements are, shared by CPU and CUDA kernels.
//
// Note [layouts]
// Statistics do not depend on element order. A tensor whose elements fill a dense block of
// memory without overlap (contiguous, channels_last, any permutation: ATen's
// is_non_overlapping_and_dense) is read as one flat span of numel elements. Anything else
// (slices with steps, stride-0 expanded dims) is read through a coalesced StridedLayout,
// element by element in logical order, with 64-bit offsets. Nothing is ever copied into a
// contiguous temporary.
#pragma once

#include <cstdint>

#include "stats_ops.h"  // HS_HD

namespace hookstats {

constexpr int kMaxDims = 25;

struct StridedLayout {
  int ndim;  // 0 means flat: element i is at offset i
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

// Builds a layout from sizes/strides (outermost first): drops size-1 dims, merges dims
// that are contiguous with each other. Returns false when more than kMaxDims remain.
inline bool make_layout(int ndim, const int64_t* sizes, const int64_t* strides, StridedLayout& out) {
  out.ndim = 0;
  int64_t cs[64], cst[64];
  int k = 0;
  for (int d = 0; d < ndim; ++d) {
    if (sizes[d] == 1) continue;
    if (k > 0 && cst[k - 1] == sizes[d] * strides[d]) {
      cs[k - 1] *= sizes[d];
      cst[k - 1] = strides[d];
    } else {
      if (k == 64) return false;
      cs[k] = sizes[d];
      cst[k] = strides[d];
      ++k;
    }
  }
  if (k > kMaxDims) return false;
  if (k == 0 || (k == 1 && cst[0] == 1)) return true;  // flat
  out.ndim = k;
  for (int d = 0; d < k; ++d) { out.sizes[d] = cs[d]; out.strides[d] = cst[d]; }
  return true;
}

// Offset (in elements) of logical element i.
HS_HD int64_t element_offset(const StridedLayout& l, int64_t i) {
  if (l.ndim == 0) return i;
  int64_t off = 0;
  for (int d = l.ndim - 1; d > 0; --d) {
    const int64_t q = i / l.sizes[d];
    off += (i - q * l.sizes[d]) * l.strides[d];
    i = q;
  }
  return off + i * l.strides[0];
}

#if defined(__CUDACC__)
// element_offset out of line for CUDA kernels: its 64-bit divisions would otherwise be inlined into every
// traversal of every kernel (Note [cuda cold paths] in cuda/kernels/stats_kernel.cuh); a strided read goes
// element by element anyway.
static __device__ __noinline__ int64_t strided_offset(const StridedLayout* l, int64_t i) {
  return element_offset(*l, i);
}
#endif

}  // namespace hookstats
