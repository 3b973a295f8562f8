// Lists of tensors for the multi-tensor ops (norms, scale_by_norm_, clamp_count_): the
// argument checks shared by the CPU and CUDA bindings, and a torch-free description of each
// tensor that the kernels read.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "layout.h"
#include "tensor_desc.h"

namespace hookstats {

inline int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return kF64;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: return kF32;
  }
}


// Whether no two elements of x share memory, provably: dense tensors, and layouts whose dims,
// sorted by stride, each step over everything the smaller dims span. (ATen's
// has_internal_overlap answers "too hard" for some overlapping layouts, e.g. as_strided
// windows, which an in-place kernel would then update twice.)
inline bool provably_non_overlapping(const at::Tensor& x) {
  if (x.numel() <= 1 || x.is_non_overlapping_and_dense()) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (x.size(d) > 1) dims.emplace_back(x.stride(d) < 0 ? -x.stride(d) : x.stride(d), x.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // largest offset reachable with the smaller dims
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return false;
    span += stride * (size - 1);
  }
  return true;
}

// Checks every tensor of a list: dense (strided) floating tensors on one device; for an
// in-place op (writes), no element may alias another.
inline void check_tensor_list(at::TensorList xs, const char* op, bool writes) {
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    check_float_input(x, op);
    TORCH_CHECK_VALUE(x.device() == xs[0].device(), "hookstats.", op, ": tensor ", i, " is on ", x.device(),
                      " but tensor 0 is on ", xs[0].device(), "; group the tensors by device");
    if (writes) {
      TORCH_CHECK(provably_non_overlapping(x), "hookstats.", op,
                  " writes in place, but elements of tensor ", i,
                  " may refer to the same memory location (an expanded or overlapping as_strided tensor); pass a "
                  "tensor whose elements do not overlap, e.g. .clone()");
    }
  }
}

// Descriptions of xs (layouts of the non-dense ones into `layouts`), cleared first.
inline void describe(at::TensorList xs, std::vector<TensorDesc>& descs, std::vector<StridedLayout>& layouts) {
  descs.clear();
  layouts.clear();
  for (const at::Tensor& x : xs) {
    TensorDesc d;
    d.data = x.numel() == 0 ? nullptr : const_cast<void*>(first_element(x));
    d.numel = x.numel();
    d.dtype = dtype_code(x.scalar_type());
    d.layout = -1;
    if (x.numel() > 0) {
      const StridedLayout l = layout_of(x);
      if (l.ndim != 0) {
        d.layout = static_cast<int32_t>(layouts.size());
        layouts.push_back(l);
      }
    }
    descs.push_back(d);
  }
}

inline void check_norm_type(double p, const char* op) {
  TORCH_CHECK_VALUE(p > 0.0, "hookstats.", op, " needs norm_type > 0 (a finite p or inf), got ", p);
}

// The total norm a scale_by_norm_ reads: one float64 element on the tensors' device.
inline void check_total(at::TensorList xs, const at::Tensor& total) {
  TORCH_CHECK_VALUE(total.numel() == 1 && total.scalar_type() == at::kDouble,
                    "hookstats.scale_by_norm_ needs the total norm as one float64 element, got ", total.scalar_type(),
                    " of shape ", total.sizes());
  TORCH_CHECK_VALUE(xs.empty() || total.device() == xs[0].device(), "hookstats.scale_by_norm_: the total norm is on ",
                    total.device(), " but the tensors are on ", xs[0].device());
}

inline void check_clip_args(double max_norm, double eps, int64_t policy) {
  TORCH_CHECK_VALUE(max_norm >= 0.0, "hookstats: max_norm must be >= 0, got ", max_norm);
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), "hookstats: eps must be finite and >= 0, got ", eps);
  TORCH_CHECK_VALUE(policy == 0 || policy == 1, "hookstats: nonfinite policy must be 0 (propagate) or 1 (zero), got ",
                    policy);
}

// Note [clip_norm_ paths]
// clip_norm_'s `path` argument: 0 (auto) takes the fused one-launch path on CUDA (Note [fused
// clip_norm_]) for tensors of kFusedAutoMinBytes..kFusedAutoMaxBytes that qualify, else the
// two-launch (CPU: two-pass) path; 1 forces the two launches; 2 requires the fused path and
// raises when it is unavailable (does not qualify, refused by the driver, CPU, graph capture);
// 3 prefers it at any size and falls back like auto. A refused cooperative launch (MPS, a
// partitioned device, cudaErrorCooperativeLaunchTooLarge) is never an error under 0 and 3.
// The size window is provisional: the fused path saves one read of x but needs every SM at
// once (it waits behind resident kernels such as NCCL's), and scripts/gpu_bench.py prints
// "fused vs two-launch" per size so that a GPU run can set these two constants.
enum ClipPath : int64_t { kPathAuto = 0, kPathTwoLaunch = 1, kPathFused = 2, kPathPreferFused = 3 };
constexpr int64_t kFusedAutoMinBytes = int64_t(1) << 20;   // 1 MiB
constexpr int64_t kFusedAutoMaxBytes = int64_t(16) << 20;  // 16 MiB

inline void check_clip_path(int64_t path) {
  TORCH_CHECK_VALUE(path >= kPathAuto && path <= kPathPreferFused, "hookstats.clip_norm_: path must be 0 (auto), "
                    "1 (two launches), 2 (fused, required) or 3 (fused where possible), got ", path);
}

// Whether clip_norm_ should try the fused path for a tensor of `bytes` bytes.
inline bool wants_fused(int64_t path, int64_t bytes) {
  if (path == kPathFused || path == kPathPreferFused) return true;
  return path == kPathAuto && bytes >= kFusedAutoMinBytes && bytes <= kFusedAutoMaxBytes;
}

// The fused path is unavailable (why): an error when it was required (path 2), else the caller
// falls back to the two-launch path.
inline void fused_unavailable(int64_t path, const std::string& why) {
  TORCH_CHECK_VALUE(path != kPathFused, "hookstats.clip_norm_: the fused path (path 2) is unavailable: ", why);
}

inline void check_bounds(double lo, double hi) {
  TORCH_CHECK_VALUE(lo <= hi, "hookstats.clip_value_ needs lo <= hi (and no NaN bound), got [", lo, ", ", hi, "]");
}

}  // namespace hookstats
