// The Monitor's step blocks: each device's stats (and location) block, the histogram blocks, their growth, and
// the flush's take() and reset() (Note [monitor sites] in recorder.h). Split from recorder.cpp, which keeps the
// record path.
#include "recorder.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cmath>

#include "../core/stats_ops.h"

namespace hookstats {
namespace monitor {

int32_t Recorder::device_index(const c10::Device& d) {
  for (size_t i = 0; i < devs_.size(); ++i) {
    if (devs_[i].device == d) return static_cast<int32_t>(i);
  }
  DeviceBuffer b{d, at::Tensor(), 0, 0};
  b.cap = init_rows_;
  b.stats = at::full({slots_ * b.cap, static_cast<int64_t>(kNumStatFields)}, std::nan(""),
                     at::TensorOptions().dtype(at::kDouble).device(d));
  b.graph_state = at::zeros({2 + 2 * kMaxRings}, at::TensorOptions().dtype(at::kLong).device(d));
  b.graph_state.narrow(0, 0, 1).fill_(step_);
  if (locations_) b.loc = at::full({slots_ * b.cap, 2}, -1, at::TensorOptions().dtype(at::kLong).device(d));
  devs_.push_back(std::move(b));
  return static_cast<int32_t>(devs_.size() - 1);
}

int32_t Recorder::hist_group(int32_t dev, int64_t len) {
  for (size_t i = 0; i < hists_.size(); ++i) {
    if (hists_[i].dev == dev && hists_[i].len == len) return static_cast<int32_t>(i);
  }
  HistBuffer h{dev, len, at::Tensor(), 0, 0};
  h.cap = init_rows_;
  h.counts = at::zeros({slots_ * h.cap, len}, at::TensorOptions().dtype(at::kLong).device(devs_[dev].device));
  hists_.push_back(std::move(h));
  return static_cast<int32_t>(hists_.size() - 1);
}

// New rows: the same slots, twice the rows per slot; the old block copied on the device.
void Recorder::grow_rows(DeviceBuffer& b) {
  const int64_t F = kNumStatFields;
  at::Tensor n = at::full({slots_ * 2 * b.cap, F}, std::nan(""), b.stats.options());
  n.view({slots_, 2 * b.cap, F}).narrow(1, 0, b.cap).copy_(b.stats.view({slots_, b.cap, F}));
  b.stats = n;
  if (locations_) {
    at::Tensor nl = at::full({slots_ * 2 * b.cap, 2}, -1, b.loc.options());
    nl.view({slots_, 2 * b.cap, 2}).narrow(1, 0, b.cap).copy_(b.loc.view({slots_, b.cap, 2}));
    b.loc = nl;
  }
  b.cap *= 2;
}

void Recorder::grow_hist_rows(HistBuffer& h) {
  at::Tensor n = at::zeros({slots_ * 2 * h.cap, h.len}, h.counts.options());
  n.view({slots_, 2 * h.cap, h.len}).narrow(1, 0, h.cap).copy_(h.counts.view({slots_, h.cap, h.len}));
  h.counts = n;
  h.cap *= 2;
}

// More slots (steps between flushes than expected): every buffer doubles its slots.
void Recorder::grow_slots(int64_t need) {
  int64_t s = slots_;
  while (s < need) s *= 2;
  const int64_t F = kNumStatFields;
  for (auto& b : devs_) {
    at::Tensor n = at::full({s * b.cap, F}, std::nan(""), b.stats.options());
    n.narrow(0, 0, slots_ * b.cap).copy_(b.stats);
    b.stats = n;
    if (locations_) {
      at::Tensor nl = at::full({s * b.cap, 2}, -1, b.loc.options());
      nl.narrow(0, 0, slots_ * b.cap).copy_(b.loc);
      b.loc = nl;
    }
  }
  for (auto& h : hists_) {
    at::Tensor n = at::zeros({s * h.cap, h.len}, h.counts.options());
    n.narrow(0, 0, slots_ * h.cap).copy_(h.counts);
    h.counts = n;
  }
  slots_ = s;
}

int64_t Recorder::ensure_slot() {
  if (slot_epoch_ != epoch_) {
    slot_epoch_ = epoch_;
    cur_slot_ = static_cast<int64_t>(slot_steps_.size());
    slot_steps_.push_back(step_);
    slot_hist_.push_back(hist_on_ ? 1 : 0);
    if (cur_slot_ >= slots_) grow_slots(cur_slot_ + 1);
  }
  return cur_slot_;
}

Recorder::Taken Recorder::take() {
  std::lock_guard<std::mutex> g(mu_);
  // Note [flush across streams] (hookstats/monitor/buffers.py): rows written on any stream, graph replays' ring
  // counts and rows included, are complete before append_rings reads and copies them and the host copies them.
  for (const auto& b : devs_) {
    if (!b.device.is_cpu()) c10::impl::getDeviceGuardImpl(b.device.type())->synchronizeDevice(b.device.index());
  }
  Taken out;
  const int64_t used = static_cast<int64_t>(slot_steps_.size());
  const int64_t F = kNumStatFields;
  for (const auto& b : devs_) {
    out.stats.emplace_back(b.device, b.stats.view({slots_, b.cap, F}).narrow(0, 0, used).narrow(1, 0, b.rows));
  }
  for (const auto& h : hists_) {
    out.hists.emplace_back(h.dev, h.len, h.counts.view({slots_, h.cap, h.len}).narrow(0, 0, used).narrow(1, 0, h.rows));
  }
  out.steps = slot_steps_;
  out.hist_on = slot_hist_;
  out.order_slots = order_slots_;
  out.order_sites = order_sites_;
  if (locations_) {
    for (const auto& b : devs_) out.locs.push_back(b.loc.view({slots_, b.cap, 2}).narrow(0, 0, used).narrow(1, 0, b.rows));
    out.shape_ndim = shape_ndim_;
    out.shape_dims = shape_dims_;
  }
  if (!rings_.empty()) append_rings(out);
  return out;
}

void Recorder::reset() {
  std::lock_guard<std::mutex> g(mu_);
  const int64_t used = static_cast<int64_t>(slot_steps_.size());
  // Histogram rows need no reset: stats_into writes them (Note [histogram rows]), and only rows written in a
  // slot are read from it.
  if (used) {
    for (auto& b : devs_) b.stats.narrow(0, 0, used * b.cap).fill_(std::nan(""));
    if (locations_) {
      for (auto& b : devs_) b.loc.narrow(0, 0, used * b.cap).fill_(-1);
    }
    // Note [flush across streams] (hookstats/monitor/buffers.py): the fills are done before any later record, on
    // whatever stream, is enqueued.
    for (const auto& b : devs_) {
      if (b.device.is_cpu()) continue;
      const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(b.device.type());
      impl->synchronizeStream(impl->getStream(b.device));
    }
  }
  shape_ndim_.clear();
  shape_dims_.clear();
  slot_steps_.clear();
  slot_hist_.clear();
  order_slots_.clear();
  order_sites_.clear();
  for (auto& r : rings_) {  // the replays read by take(): handed over; older ones overwritten are counted
    const int64_t lost = std::max<int64_t>(0, r.taken - r.emitted - r.slots);
    if (lost) dropped_replays_.fetch_add(lost);
    r.emitted = std::max(r.emitted, r.taken);
  }
  slot_epoch_ = -1;  // the step in progress takes a new slot at its next record
  cur_slot_ = -1;
}

int64_t Recorder::num_sites() {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>(sites_.size());
}

std::vector<Site> Recorder::sites_from(int64_t from) {
  std::lock_guard<std::mutex> g(mu_);
  if (from >= static_cast<int64_t>(sites_.size())) return {};
  return std::vector<Site>(sites_.begin() + from, sites_.end());
}

std::vector<c10::Device> Recorder::devices() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<c10::Device> out;
  for (const auto& b : devs_) out.push_back(b.device);
  return out;
}

int64_t Recorder::pending_slots() {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>(slot_steps_.size());
}

}  // namespace monitor
}  // namespace hookstats
