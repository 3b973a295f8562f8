// Argument checks shared by the CPU and CUDA bindings. Every message says what was wrong
// and what to do. TORCH_CHECK_TYPE raises TypeError in Python, TORCH_CHECK_VALUE ValueError.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <tuple>

#include "hist_ops.h"
#include "layout.h"
#include "stats_ops.h"

#define HOOKSTATS_CHECK(cond, ...) TORCH_CHECK(cond, "hookstats: ", __VA_ARGS__)

namespace hookstats {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The dtype results come back in: fp64 for fp64 inputs, fp32 otherwise.
inline at::ScalarType result_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_float_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK_TYPE(x.layout() == at::kStrided, "hookstats.", op, " needs a dense (strided) tensor, got layout ",
                   x.layout(), "; call .to_dense() first");
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()), "hookstats.", op,
                   " needs a floating tensor (float32, float64, float16 or bfloat16), got ", x.scalar_type());
}

// A stats_into buffer: 2-D [slots, kNumStatFields], float32 or float64, rows with unit
// stride, on x's device, slot in range.
inline void check_stats_buffer(const at::Tensor& x, const at::Tensor& out, int64_t slot) {
  TORCH_CHECK_TYPE(out.layout() == at::kStrided && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble),
                   "hookstats.stats_into needs a float32 or float64 buffer, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(1) == kNumStatFields,
                    "hookstats.stats_into needs a buffer of shape [slots, ", int(kNumStatFields),
                    "] (see hookstats.stats_buffer), got ", out.sizes());
  TORCH_CHECK_VALUE(out.stride(1) == 1, "hookstats.stats_into needs buffer rows with unit stride, got strides ",
                    out.strides());
  TORCH_CHECK_VALUE(out.device() == x.device(), "hookstats.stats_into: the buffer is on ", out.device(),
                    " but the tensor is on ", x.device(), "; allocate the buffer on the tensor's device");
  TORCH_CHECK_VALUE(slot >= 0 && slot < out.size(0), "hookstats.stats_into: slot ", slot,
                    " is out of range for a buffer of ", out.size(0), " slots");
}

// Flat when the elements fill a dense block (Note [layouts]). With logical_order (a kernel that also
// finds locations, Note [element locations]) only a contiguous tensor is flat, so a dense but permuted
// one (channels_last, a transpose) is read through its strides, in logical order.
inline StridedLayout layout_of(const at::Tensor& x, bool logical_order = false) {
  StridedLayout l;
  l.ndim = 0;
  if (logical_order ? x.is_contiguous() : x.is_non_overlapping_and_dense()) return l;
  const bool ok = make_layout(static_cast<int>(x.dim()), x.sizes().data(), x.strides().data(), l);
  TORCH_CHECK_VALUE(ok, "hookstats: tensor has more than ", kMaxDims,
                    " non-mergeable dimensions; reshape it or pass .contiguous()");
  return l;
}

// The (values, counts) outputs of hookstats::stats (Note [stats row layout]).
inline std::tuple<at::Tensor, at::Tensor> stats_outputs(const at::Tensor& x) {
  return {at::empty({kNumValueFields}, x.options().dtype(result_dtype(x.scalar_type()))),
          at::empty({kNumCountFields}, x.options().dtype(at::kLong))};
}

inline HistSpec checked_hist_spec(const at::Tensor& x, int64_t mode, int64_t bins, double lo, double hi) {
  TORCH_CHECK_VALUE(mode == kHistRange || mode == kHistExp, "hookstats: histogram mode must be 1 (range) or 2 "
                    "(exponent), got ", mode);
  if (mode == kHistRange) {
    TORCH_CHECK_VALUE(bins >= 1 && bins <= kMaxHistBins, "hookstats.histogram needs 1 <= bins <= ", kMaxHistBins,
                      ", got bins=", bins);
    TORCH_CHECK_VALUE(std::isfinite(lo) && std::isfinite(hi) && std::isfinite(hi - lo),
                      "hookstats.histogram needs a finite range, got (", lo, ", ", hi, ")");
    TORCH_CHECK_VALUE(lo < hi, "hookstats.histogram needs lo < hi, got range (", lo, ", ", hi, ")");
    TORCH_CHECK_VALUE(std::isfinite((hi - lo) * static_cast<double>(bins)),
                      "hookstats.histogram: (hi - lo) * bins overflows float64 for range (", lo, ", ", hi,
                      ") and ", bins, " bins; use a narrower range");
  }
  return make_hist_spec(static_cast<int>(mode), mode == kHistRange ? bins : 0, lo, hi);
}

// Counts in a histogram of x's dtype (Note [histogram layouts]).
inline int64_t hist_length(at::ScalarType t, const HistSpec& h) {
  if (h.mode == kHistRange) return static_cast<int64_t>(h.bins) + 3;
  switch (t) {
    case at::kDouble: return exp_hist_length<11>();
    case at::kHalf: return exp_hist_length<5>();
    default: return exp_hist_length<8>();
  }
}

inline void check_hist_buffer(const at::Tensor& x, const at::Tensor& hist, int64_t slot, int64_t len) {
  TORCH_CHECK_TYPE(hist.layout() == at::kStrided && hist.scalar_type() == at::kLong,
                   "hookstats: a histogram buffer must be int64 (see hookstats.histogram_buffer), got ",
                   hist.scalar_type());
  TORCH_CHECK_VALUE(hist.dim() == 2 && hist.size(1) == len && hist.stride(1) == 1,
                    "hookstats: this histogram needs a buffer of shape [slots, ", len,
                    "] with unit-stride rows (see hookstats.histogram_buffer), got ", hist.sizes());
  TORCH_CHECK_VALUE(hist.device() == x.device(), "hookstats: the histogram buffer is on ", hist.device(),
                    " but the tensor is on ", x.device());
  TORCH_CHECK_VALUE(slot >= 0 && slot < hist.size(0), "hookstats: histogram slot ", slot,
                    " is out of range for a buffer of ", hist.size(0), " slots");
}

// Data pointer of the first element. For a flat tensor that is the lowest address, since
// dense tensors have no negative strides.
inline const void* first_element(const at::Tensor& x) { return x.const_data_ptr(); }

}  // namespace hookstats
