// The Monitor's captured steps: Note [monitor graph replays] in recorder.h. Split from recorder.cpp
// (the eager recording core); the CUDA pieces it needs come through capture.h.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "../core/stats_ops.h"
#include "capture.h"
#include "op_calls.h"
#include "recorder.h"

namespace hookstats {
namespace monitor {
namespace {

// A ring's memory (Note [ring memory] in cuda/ring_cuda.cu): on CUDA from memory no capture reuses.
at::Tensor ring_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (options.device().is_cuda() && ring_empty_fn() != nullptr) return ring_empty_fn()(sizes, options);
  return at::empty(sizes, options);
}

}  // namespace

Recorder::~Recorder() { keep_rings(); }

void Recorder::keep_rings() {
  if (rings_.empty()) return;
  std::vector<at::Tensor> keep;
  for (auto& r : rings_) {
    keep.push_back(r.stats);
    keep.push_back(r.steps);
    for (auto& h : r.hists) keep.push_back(h);
  }
  for (auto& b : devs_) {
    if (b.num_rings) keep.push_back(b.graph_state);
  }
  keep_forever(std::move(keep));
  rings_.clear();
}

uint64_t Recorder::capture_of(const at::Tensor& t) const {
  if (t.is_cuda()) {
    const CaptureIdFn fn = capture_id_fn();
    return fn != nullptr ? fn(t.device().index()) : 0;
  }
  return t.is_cpu() ? test_capture_ : 0;
}

void Recorder::set_test_capture(uint64_t id, bool replay) {
  std::lock_guard<std::mutex> g(mu_);
  if (test_capture_ != 0 && !test_replay_) {
    // The test capture ran its kernels (CPU); a real capture runs none: its rows count from the first replay.
    for (auto& r : rings_) {
      if (r.capture == test_capture_) devs_[r.dev].graph_state.narrow(0, 2 + 2 * r.index, 1).fill_(0);
    }
  }
  test_capture_ = id;
  test_replay_ = id != 0 && replay;
  test_rings_ = true;
  for (auto& r : rings_) r.advanced = false;
}

at::Tensor Recorder::ring_pos(const Ring& r) const {
  return devs_[r.dev].graph_state.narrow(0, 3 + 2 * r.index, 1);
}

Ring& Recorder::ring_for(uint64_t capture, const at::Tensor& t) {
  const c10::Device d = t.device();
  for (auto& r : rings_) {
    if (r.capture != capture || devs_[r.dev].device != d) continue;
    if (test_replay_ && !r.advanced) {  // a test replay: the prologue a real replay runs first
      const at::Tensor& st = devs_[r.dev].graph_state;
      ring_advance(st.narrow(0, 2 + 2 * r.index, 2), r.steps, st.narrow(0, 0, 1));
      r.advanced = true;
    }
    return r;
  }
  TORCH_CHECK(!test_replay_, "hookstats.Monitor: a test replay of capture ", capture, " that was never captured");
  TORCH_CHECK(!locations_, "hookstats.Monitor(locations=True) does not record inside CUDA graph capture yet (a "
              "record's shape and location rows are host-side per record); use a Monitor without locations for the "
              "captured step, or record that step eagerly");
  int32_t dev = -1;
  for (size_t i = 0; i < devs_.size(); ++i) {
    if (devs_[i].device == d) dev = static_cast<int32_t>(i);
  }
  TORCH_CHECK(dev >= 0, "hookstats.Monitor: the first record on ", d,
              " happened inside CUDA graph capture. Run the monitored step once outside capture first (CUDA graphs "
              "need that warm-up anyway), so that the Monitor's buffers on ", d, " exist before the capture.");
  DeviceBuffer& b = devs_[dev];
  TORCH_CHECK(b.num_rings < kMaxRings, "hookstats.Monitor: more than ", kMaxRings, " CUDA graphs captured on ", d,
              " with one Monitor; use a new Monitor");
  Ring r;
  r.capture = capture;
  r.dev = dev;
  r.index = b.num_rings++;
  r.cap = b.cap;
  r.slots = slots_;
  const auto opts = b.stats.options();
  // Allocated during the capture but outside its pool (Note [ring memory]), and never initialised: every replay
  // writes every row of its slot that a flush reads.
  r.stats = ring_empty({r.slots, b.cap, static_cast<int64_t>(kNumStatFields)}, opts);
  r.steps = ring_empty({r.slots}, opts.dtype(at::kLong));
  r.hist_on = hist_on_;
  const at::Tensor& st = b.graph_state;
  ring_advance(st.narrow(0, 2 + 2 * r.index, 2), r.steps, st.narrow(0, 0, 1));  // captured: each replay's prologue
  r.advanced = true;
  rings_.push_back(std::move(r));
  return rings_.back();
}

void Recorder::note_ring_site(Ring& r, int32_t site) {
  if (static_cast<int64_t>(r.has_site.size()) <= site) r.has_site.resize(site + 1, 0);
  if (test_replay_) {
    TORCH_CHECK(r.has_site[site], "hookstats.Monitor: a test replay recorded a site its capture did not");
    return;
  }
  TORCH_CHECK(!r.has_site[site], "hookstats.Monitor: one CUDA graph capture recorded the same hook call twice: a "
              "captured graph holds one monitored step. Call mon.step() outside the graph, after each replay (not "
              "inside the captured region).");
  r.has_site[site] = 1;
  r.order.push_back(site);
}

const at::Tensor& Recorder::ring_hist(Ring& r, int32_t hgroup) {
  if (static_cast<int32_t>(r.hists.size()) <= hgroup) {
    r.hists.resize(hgroup + 1);
    r.hcaps.resize(hgroup + 1, 0);
  }
  if (!r.hists[hgroup].defined()) {
    const HistBuffer& h = hists_[hgroup];
    r.hists[hgroup] = ring_empty({r.slots, h.cap, h.len}, h.counts.options());
    r.hcaps[hgroup] = h.cap;
  }
  return r.hists[hgroup];
}

void Recorder::write_ring(Ring& r, int32_t site, const at::Tensor& x) {
  note_ring_site(r, site);
  const Site& s = sites_[site];
  const at::Tensor pos = ring_pos(r);
  if (r.hist_on && s.hgroup >= 0) {
    stats_into(x, r.stats, s.row, ring_hist(r, s.hgroup), s.hrow, hist_, std::nullopt, pos);
  } else {
    stats_into(x, r.stats, s.row, std::nullopt, 0, hist_, std::nullopt, pos);
  }
}

int64_t Recorder::num_rings() {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>(rings_.size());
}

// The replays since the last flush, as slots after the eager ones: every device block (and histogram block) is
// re-laid into [eager + replayed slots, rows, ...] on its device, and the records are ordered by step (eager first
// within a step). Reads each ring's k: a flush waits for the device anyway.
void Recorder::append_rings(Taken& out) {
  const int64_t used = static_cast<int64_t>(out.steps.size());
  struct Emit {
    int32_t ring;
    int64_t first, n;
    std::vector<int64_t> steps;
  };
  std::vector<Emit> emits;
  int64_t total = 0;
  std::vector<at::Tensor> states(devs_.size());  // each device's (k, p) pairs, one copy per device with rings
  for (size_t i = 0; i < rings_.size(); ++i) {
    Ring& r = rings_[i];
    const int64_t S = r.slots;
    at::Tensor& st = states[r.dev];
    if (!st.defined()) st = devs_[r.dev].graph_state.to(at::kCPU);
    const int64_t k = st.data_ptr<int64_t>()[2 + 2 * r.index];
    r.taken = k;
    const int64_t first = std::max(r.emitted, k - S);
    if (k <= first) continue;
    at::Tensor steps = r.steps.to(at::kCPU);
    Emit e{static_cast<int32_t>(i), first, k - first, {}};
    for (int64_t j = first; j < k; ++j) e.steps.push_back(steps.data_ptr<int64_t>()[j % S]);
    total += e.n;
    emits.push_back(std::move(e));
  }
  if (total == 0) return;
  const int64_t F = kNumStatFields;
  for (size_t d = 0; d < out.stats.size(); ++d) {
    at::Tensor& blk = out.stats[d].second;
    at::Tensor n = at::full({used + total, blk.size(1), F}, std::nan(""), blk.options());
    n.narrow(0, 0, used).copy_(blk);
    blk = n;
  }
  for (auto& [dev, len, blk] : out.hists) {
    at::Tensor n = at::zeros({used + total, blk.size(1), len}, blk.options());
    n.narrow(0, 0, used).copy_(blk);
    blk = n;
  }
  int64_t off = used;
  for (const Emit& e : emits) {
    const Ring& r = rings_[e.ring];
    // The replays' slots first .. first + n (mod slots, n <= slots): at most two contiguous runs of the ring.
    const int64_t p0 = e.first % r.slots, n1 = std::min(e.n, r.slots - p0);
    auto copy_slots = [&](at::Tensor&& dst, const at::Tensor& ring, int64_t width) {
      dst.narrow(0, 0, n1).copy_(ring.narrow(0, p0, n1).narrow(1, 0, width));
      if (n1 < e.n) dst.narrow(0, n1, e.n - n1).copy_(ring.narrow(0, 0, e.n - n1).narrow(1, 0, width));
    };
    at::Tensor& blk = out.stats[r.dev].second;
    const int64_t m = std::min(r.cap, blk.size(1));
    copy_slots(blk.narrow(0, off, e.n).narrow(1, 0, m), r.stats, m);
    for (size_t g = 0; g < r.hists.size(); ++g) {
      if (!r.hists[g].defined()) continue;
      at::Tensor& hb = std::get<2>(out.hists[g]);
      const int64_t hm = std::min(r.hcaps[g], hb.size(1));
      copy_slots(hb.narrow(0, off, e.n).narrow(1, 0, hm), r.hists[g], hm);
    }
    for (int64_t i = 0; i < e.n; ++i) {
      out.steps.push_back(e.steps[i]);
      out.hist_on.push_back(r.hist_on ? 1 : 0);
      for (int32_t site : r.order) {
        out.order_slots.push_back(static_cast<int32_t>(off + i));
        out.order_sites.push_back(site);
      }
    }
    off += e.n;
  }
  // Records by step, eager ones first within a step (a stable sort of the write order).
  std::vector<size_t> perm(out.order_slots.size());
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = i;
  std::stable_sort(perm.begin(), perm.end(), [&](size_t a, size_t b) {
    return out.steps[out.order_slots[a]] < out.steps[out.order_slots[b]];
  });
  std::vector<int32_t> sl(perm.size()), si(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    sl[i] = out.order_slots[perm[i]];
    si[i] = out.order_sites[perm[i]];
  }
  out.order_slots.swap(sl);
  out.order_sites.swap(si);
}

}  // namespace monitor
}  // namespace hookstats
