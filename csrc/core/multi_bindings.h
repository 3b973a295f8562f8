// hookstats::stats_multi_into: the statistics (and histogram) of many tensors of one device, one
// row each, in one call (the Monitor's "grad" kind records every parameter grad this way). A
// backend supplies the single-tensor runner of bindings.h and a `for_each` that runs
// body(i) for every tensor index i: the CPU one spreads small tensors over threads (each tensor
// reduced by one thread, big tensors by all of them, so every row equals what stats_into gives,
// bit for bit, whatever the thread count); the CUDA one launches them one after another on the
// current stream from C++.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>

#include "bindings.h"
#include "checks.h"

namespace hookstats {

template <StatsRunner run, typename ForEach>
void stats_multi_into_op_impl(at::TensorList xs, const at::Tensor& out, at::IntArrayRef rows,
                              const std::optional<at::Tensor>& hist, at::IntArrayRef hist_rows, int64_t mode,
                              int64_t bins, double lo, double hi, bool accumulate, ForEach for_each) {
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
  for_each(static_cast<int64_t>(xs.size()), [&](int64_t i) {
    run(xs[i], StatsOut{base + rows[i] * row_bytes, nullptr, dbl}, spec,
        hbase ? hbase + hist_rows[i] * hstride : nullptr, hlen, accumulate);
  });
}

}  // namespace hookstats
