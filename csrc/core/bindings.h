// The ATen bindings of the stats ops, shared by the CPU and CUDA implementations: argument
// checks, outputs, buffer rows. A backend supplies only
//   void run(const at::Tensor& x, const StatsOut& out, const HistSpec& hs,
//            int64_t* hist, int64_t hist_len, bool accumulate);
// which computes the statistics of x into `out` and, when hist != nullptr, the histogram into
// hist (written, or added to when accumulate).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "checks.h"
#include "hist_ops.h"
#include "stats_ops.h"

namespace hookstats {

using StatsRunner = void (*)(const at::Tensor&, const StatsOut&, const HistSpec&, int64_t*, int64_t, bool);

template <StatsRunner run>
std::tuple<at::Tensor, at::Tensor> stats_op(const at::Tensor& x) {
  check_float_input(x, "stats");
  auto [values, counts] = stats_outputs(x);
  run(x, StatsOut{values.data_ptr(), counts.data_ptr<int64_t>(), values.scalar_type() == at::kDouble},
      make_hist_spec(kHistNone, 0, 0.0, 0.0), nullptr, 0, false);
  return {values, counts};
}

template <StatsRunner run>
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_hist_op(const at::Tensor& x, int64_t mode, int64_t bins,
                                                             double lo, double hi) {
  check_float_input(x, "stats");
  const HistSpec spec = checked_hist_spec(x, mode, bins, lo, hi);
  auto [values, counts] = stats_outputs(x);
  at::Tensor hist = at::empty({hist_length(x.scalar_type(), spec)}, x.options().dtype(at::kLong));
  run(x, StatsOut{values.data_ptr(), counts.data_ptr<int64_t>(), values.scalar_type() == at::kDouble}, spec,
      hist.data_ptr<int64_t>(), hist.numel(), false);
  return {values, counts, hist};
}

// Note [histogram rows]
// stats_into writes its histogram row, as it writes its stats row: the row holds the counts of
// this call's x alone, whatever it held before, so a CUDA graph that replays the call leaves the
// same row after every replay. With hist_accumulate the counts are added to the row instead
// (histograms summed over calls or steps); the caller then owns zeroing the row. hookstats.Monitor
// gives every record its own row.
template <StatsRunner run>
void stats_into_op(const at::Tensor& x, const at::Tensor& out, int64_t slot, const std::optional<at::Tensor>& hist,
                   int64_t hist_slot, int64_t mode, int64_t bins, double lo, double hi, bool hist_accumulate) {
  check_float_input(x, "stats_into");
  check_stats_buffer(x, out, slot);
  HistSpec spec = make_hist_spec(kHistNone, 0, 0.0, 0.0);
  int64_t* hrow = nullptr;
  int64_t hlen = 0;
  if (hist.has_value()) {
    spec = checked_hist_spec(x, mode, bins, lo, hi);
    hlen = hist_length(x.scalar_type(), spec);
    check_hist_buffer(x, *hist, hist_slot, hlen);
    hrow = hist->data_ptr<int64_t>() + hist_slot * hist->stride(0);
  }
  char* row = static_cast<char*>(out.data_ptr()) + slot * out.stride(0) * out.element_size();
  run(x, StatsOut{row, nullptr, out.scalar_type() == at::kDouble}, spec, hrow, hlen, hist_accumulate);
}

}  // namespace hookstats
