// hookstats::stats_multi_into: the statistics (and histogram) of many tensors of one device, one
// row each, in one call (the Monitor's "grad" kind records every parameter grad this way). A
// backend gets every checked (tensor, row, histogram row) as a MultiItem and runs them: the CPU
// one spreads small tensors over threads (each tensor reduced by one thread, big tensors by all of
// them, so every row equals what stats_into gives, bit for bit, whatever the thread count); the
// CUDA one packs the flat tensors of a dtype into launches of up to kPackTensors tensors each
// (Note [multi-tensor stats launches] in cuda/kernels/stats_launch.h), the others launched one by one.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <vector>

#include "bindings.h"
#include "checks.h"

namespace hookstats {

struct MultiItem {
  const at::Tensor* x;
  StatsOut out;   // the row (and the ring, Note [ring rows])
  int64_t* hist;  // the histogram row, or nullptr
};

template <typename Backend>
void stats_multi_into_op_impl(at::TensorList xs, const at::Tensor& out_, at::IntArrayRef rows,
                              const std::optional<at::Tensor>& hist_, at::IntArrayRef hist_rows, int64_t mode,
                              int64_t bins, double lo, double hi, bool accumulate,
                              const std::optional<at::Tensor>& ring, Backend backend) {
  if (xs.empty()) return;
  const RingView rv = ring_view(xs[0], out_, hist_, ring, "stats_multi_into");  // Note [ring rows]
  const at::Tensor& out = rv.out2d;
  const std::optional<at::Tensor>& hist = rv.hist2d;
  TORCH_CHECK_VALUE(rows.size() == xs.size(), "hookstats.stats_multi_into: ", xs.size(), " tensors but ",
                    rows.size(), " rows");
  HistSpec spec = make_hist_spec(kHistNone, 0, 0.0, 0.0);
  int64_t hlen = 0;
  if (hist.has_value()) {
    TORCH_CHECK_VALUE(hist_rows.size() == xs.size(), "hookstats.stats_multi_into: ", xs.size(), " tensors but ",
                      hist_rows.size(), " histogram rows");
  }
  for (size_t i = 0; i < xs.size(); ++i) {  // every check first: nothing is written when one fails
    check_float_input(xs[i], "stats_multi_into");
    check_stats_buffer(xs[i], out, rows[i]);
    if (hist.has_value()) {
      spec = checked_hist_spec(xs[i], mode, bins, lo, hi);
      hlen = hist_length(xs[i].scalar_type(), spec);
      check_hist_buffer(xs[i], *hist, hist_rows[i], hlen);
    }
  }
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = out.stride(0) * out.element_size();
  const bool dbl = out.scalar_type() == at::kDouble;
  int64_t* hbase = hist.has_value() ? hist->data_ptr<int64_t>() : nullptr;
  const int64_t hstride = hist.has_value() ? hist->stride(0) : 0;
  std::vector<MultiItem> items;
  items.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    StatsOut so{base + rows[i] * row_bytes, nullptr, dbl};
    set_ring(so, rv);
    items.push_back(MultiItem{&xs[i], so, hbase ? hbase + hist_rows[i] * hstride : nullptr});
  }
  backend(items, spec, hlen, accumulate);
}

}  // namespace hookstats
