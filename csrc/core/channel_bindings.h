// The ATen bindings of the channel ops, shared by the CPU and CUDA implementations: argument
// checks, the channel view of the input (Note [channel layouts]), outputs, the buffer. A backend
// supplies only
//   void run(const at::Tensor& x, const ChannelView& v, const ChannelOut& out);
// which reduces every channel of v into out (written, or combined with a buffer's contents).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

#include "channel_ops.h"
#include "checks.h"
#include "layout.h"

namespace hookstats {

struct ChannelView {
  const void* data;  // element (0, 0)
  int64_t channels;
  int64_t cstride;
  int64_t rows;      // elements per channel
  StridedLayout rest;
  bool rows_order;   // Note [channel layouts]
};

inline int64_t wrap_channel_dim(const at::Tensor& x, int64_t dim, const char* op) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "hookstats.", op, " needs a tensor with at least one dimension, got a 0-d tensor");
  TORCH_CHECK_VALUE(dim >= -x.dim() && dim < x.dim(), "hookstats.", op, ": dim ", dim,
                    " is out of range for a tensor of ", x.dim(), " dimensions");
  return dim < 0 ? dim + x.dim() : dim;
}

inline ChannelView channel_view(const at::Tensor& x, int64_t dim, const char* op) {
  const int64_t d = wrap_channel_dim(x, dim, op);
  ChannelView v;
  v.data = x.numel() == 0 ? nullptr : x.const_data_ptr();
  v.channels = x.size(d);
  v.cstride = x.stride(d);
  v.rows = 1;
  // The other dims, outermost (largest stride) first: the order rows are read in does not change
  // the statistics, and this one walks memory forward.
  std::vector<int64_t> order;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != d) { order.push_back(i); v.rows *= x.size(i); }
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  std::vector<int64_t> sizes, strides;
  for (int64_t i : order) { sizes.push_back(x.size(i)); strides.push_back(x.stride(i)); }
  const bool ok = make_layout(static_cast<int>(sizes.size()), sizes.data(), strides.data(), v.rest);
  TORCH_CHECK_VALUE(ok, "hookstats.", op, ": the tensor has more than ", kMaxDims,
                    " non-mergeable dimensions; reshape it or pass .contiguous()");
  const int64_t inner = v.rest.ndim == 0 ? 1 : v.rest.strides[v.rest.ndim - 1];
  if (v.channels <= 1) v.rows_order = false;
  else if (v.cstride == 1) v.rows_order = true;
  else if (inner == 1) v.rows_order = false;
  else v.rows_order = v.cstride < inner;
  return v;
}

inline std::tuple<at::Tensor, at::Tensor> channel_outputs(const at::Tensor& x, int64_t channels) {
  return {at::empty({kNumChannelValues, channels}, x.options().dtype(result_dtype(x.scalar_type()))),
          at::empty({kNumChannelCounts, channels}, x.options().dtype(at::kLong))};
}

inline void check_channel_buffer(const at::Tensor& x, const at::Tensor& out, int64_t channels) {
  TORCH_CHECK_TYPE(out.layout() == at::kStrided && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble),
                   "hookstats.channel_stats_into needs a float32 or float64 buffer (see "
                   "hookstats.channel_stats_buffer), got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == kNumChannelFields && out.size(1) == channels,
                    "hookstats.channel_stats_into needs a buffer of shape [", int(kNumChannelFields), ", ", channels,
                    "] for a tensor of ", channels, " channels (see hookstats.channel_stats_buffer), got ",
                    out.sizes());
  TORCH_CHECK_VALUE(out.device() == x.device(), "hookstats.channel_stats_into: the buffer is on ", out.device(),
                    " but the tensor is on ", x.device(), "; allocate the buffer on the tensor's device");
}

using ChannelRunner = void (*)(const at::Tensor&, const ChannelView&, const ChannelOut&);

template <ChannelRunner run>
std::tuple<at::Tensor, at::Tensor> channel_stats_op(const at::Tensor& x, int64_t dim) {
  check_float_input(x, "channel_stats");
  const ChannelView v = channel_view(x, dim, "channel_stats");
  auto [values, counts] = channel_outputs(x, v.channels);
  if (v.channels > 0) {
    run(x, v, ChannelOut{values.data_ptr(), counts.data_ptr<int64_t>(), v.channels, 0, 0,
                         values.scalar_type() == at::kDouble});
  }
  return {values, counts};
}

template <ChannelRunner run>
void channel_stats_into_op(const at::Tensor& x, const at::Tensor& out, int64_t dim) {
  check_float_input(x, "channel_stats_into");
  const ChannelView v = channel_view(x, dim, "channel_stats_into");
  check_channel_buffer(x, out, v.channels);
  if (v.channels > 0) {
    run(x, v, ChannelOut{out.data_ptr(), nullptr, v.channels, out.stride(0), out.stride(1),
                         out.scalar_type() == at::kDouble});
  }
}

}  // namespace hookstats
