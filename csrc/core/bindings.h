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
#include "layout.h"
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

// Note [ring rows] (csrc/core/stats_ops.h): with `ring`, out is [ring_slots, rows, 13] and hist
// [ring_slots, hist rows, length], and the row of slot p mod ring_slots is written, p read on the
// device when the kernel runs. Checks the ring and the buffers' leading dimension, and returns
// the StatsOut ring fields; `out2d` / `hist2d` are the buffers' slot-0 views, for the row checks.
struct RingView {
  at::Tensor out2d;
  std::optional<at::Tensor> hist2d;
  const int64_t* pos = nullptr;
  int64_t slots = 0, value_bytes = 0, hist_elems = 0;
};

inline RingView ring_view(const at::Tensor& x, const at::Tensor& out, const std::optional<at::Tensor>& hist,
                          const std::optional<at::Tensor>& ring, const char* op) {
  RingView v{out, hist};
  if (!ring.has_value()) return v;
  const at::Tensor& r = *ring;
  TORCH_CHECK_TYPE(r.scalar_type() == at::kLong, "hookstats.", op, ": ring must be an int64 tensor, got ",
                   r.scalar_type());
  TORCH_CHECK_VALUE(r.numel() >= 1 && r.device() == x.device(), "hookstats.", op,
                    ": ring must hold at least one element on the tensor's device ", x.device(), ", got ",
                    r.numel(), " on ", r.device());
  TORCH_CHECK_VALUE(out.dim() == 3 && out.size(0) >= 1, "hookstats.", op,
                    ": with ring, the buffer is [ring slots, rows, ", int(kNumStatFields), "], got ", out.sizes());
  v.out2d = out.select(0, 0);
  v.pos = static_cast<const int64_t*>(first_element(r));
  v.slots = out.size(0);
  v.value_bytes = out.stride(0) * out.element_size();
  if (hist.has_value()) {
    TORCH_CHECK_VALUE(hist->dim() == 3 && hist->size(0) == out.size(0), "hookstats.", op,
                      ": with ring, the histogram buffer is [", out.size(0), " ring slots, rows, length], got ",
                      hist->sizes());
    v.hist2d = hist->select(0, 0);
    v.hist_elems = hist->stride(0);
  }
  return v;
}

inline void set_ring(StatsOut& o, const RingView& v) {
  o.ring = v.pos;
  o.ring_slots = v.slots;
  o.ring_value_bytes = v.value_bytes;
  o.ring_hist_elems = v.hist_elems;
}

// A location buffer of stats_into(..., loc=): [rows, 2] int64, unit-stride rows, on x's device, slot in range.
inline void check_loc_buffer(const at::Tensor& x, const at::Tensor& loc, int64_t slot) {
  TORCH_CHECK_TYPE(loc.layout() == at::kStrided && loc.scalar_type() == at::kLong,
                   "hookstats.stats_into needs an int64 location buffer (see hookstats.location_buffer), got ",
                   loc.scalar_type());
  TORCH_CHECK_VALUE(loc.dim() == 2 && loc.size(1) == 2 && loc.stride(1) == 1,
                    "hookstats.stats_into needs a location buffer of shape [slots, 2] with unit-stride rows (see "
                    "hookstats.location_buffer), got ", loc.sizes());
  TORCH_CHECK_VALUE(loc.device() == x.device(), "hookstats.stats_into: the location buffer is on ", loc.device(),
                    " but the tensor is on ", x.device());
  TORCH_CHECK_VALUE(slot >= 0 && slot < loc.size(0), "hookstats.stats_into: location slot ", slot,
                    " is out of range for a buffer of ", loc.size(0), " slots");
}

// Statistics, locations (int64 [2]: argmax_abs, first_nonfinite) and, with mode != 0, the histogram
// (an empty int64 tensor without one), in one read.
template <StatsRunner run>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats_loc_op(const at::Tensor& x, int64_t mode,
                                                                        int64_t bins, double lo, double hi) {
  check_float_input(x, "stats");
  HistSpec spec = make_hist_spec(kHistNone, 0, 0.0, 0.0);
  if (mode != 0) spec = checked_hist_spec(x, mode, bins, lo, hi);
  auto [values, counts] = stats_outputs(x);
  at::Tensor loc = at::empty({2}, x.options().dtype(at::kLong));
  at::Tensor hist = at::empty({mode != 0 ? hist_length(x.scalar_type(), spec) : 0}, x.options().dtype(at::kLong));
  StatsOut o{values.data_ptr(), counts.data_ptr<int64_t>(), values.scalar_type() == at::kDouble};
  o.loc = loc.data_ptr<int64_t>();
  run(x, o, spec, mode != 0 ? hist.data_ptr<int64_t>() : nullptr, hist.numel(), false);
  return {values, counts, loc, hist};
}

// Note [histogram rows]
// stats_into writes its histogram row, as it writes its stats row: the row holds the counts of
// this call's x alone, whatever it held before, so a CUDA graph that replays the call leaves the
// same row after every replay. With hist_accumulate the counts are added to the row instead
// (histograms summed over calls or steps); the caller then owns zeroing the row. hookstats.Monitor
// gives every record its own row.
template <StatsRunner run>
void stats_into_op(const at::Tensor& x, const at::Tensor& out_, int64_t slot, const std::optional<at::Tensor>& hist_,
                   int64_t hist_slot, int64_t mode, int64_t bins, double lo, double hi, bool hist_accumulate,
                   const std::optional<at::Tensor>& ring, const std::optional<at::Tensor>& loc_,
                   int64_t loc_slot) {
  check_float_input(x, "stats_into");
  const RingView rv = ring_view(x, out_, hist_, ring, "stats_into");
  const at::Tensor& out = rv.out2d;
  const std::optional<at::Tensor>& hist = rv.hist2d;
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
  StatsOut so{row, nullptr, out.scalar_type() == at::kDouble};
  set_ring(so, rv);
  if (loc_.has_value()) {
    at::Tensor loc = *loc_;
    if (ring.has_value()) {  // Note [ring rows]: [ring slots, rows, 2]
      TORCH_CHECK_VALUE(loc.dim() == 3 && loc.size(0) == out_.size(0), "hookstats.stats_into: with ring, the "
                        "location buffer is [", out_.size(0), " ring slots, rows, 2], got ", loc.sizes());
      so.ring_loc_elems = loc.stride(0);
      loc = loc.select(0, 0);
    }
    check_loc_buffer(x, loc, loc_slot);
    so.loc = loc.data_ptr<int64_t>() + loc_slot * loc.stride(0);
  }
  run(x, so, spec, hrow, hlen, hist_accumulate);
}

}  // namespace hookstats
