// The Monitor's recording core: Note [monitor sites] in recorder.h.
#include "recorder.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "../core/checks.h"
#include "../core/hist_ops.h"
#include "../core/stats_ops.h"
#include "capture.h"
#include "op_calls.h"

namespace hookstats {

void stats_cpu_runner(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
                      bool accumulate);  // cpu/stats_cpu.cpp

namespace monitor {

void stats_into(const at::Tensor& x, const at::Tensor& out, int64_t slot, const std::optional<at::Tensor>& hist,
                int64_t hist_slot, const HistConfig& h, const std::optional<at::Tensor>& loc,
                const std::optional<at::Tensor>& ring) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookstats::stats_into", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&,
                                   int64_t, int64_t, int64_t, double, double, bool, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, int64_t)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.call(x, out, slot, hist, hist_slot, hist.has_value() ? h.mode : 0, h.bins, h.lo, h.hi, /*hist_accumulate=*/false,
          ring, loc, slot);
}

void ring_advance(const at::Tensor& state, const at::Tensor& steps, const at::Tensor& step) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookstats::_ring_advance", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.call(state, steps, step);
}

void keep_forever(std::vector<at::Tensor> ts) {
  static std::mutex mu;
  static auto* kept = new std::vector<at::Tensor>();
  std::lock_guard<std::mutex> g(mu);
  for (auto& t : ts) {
    if (t.defined()) kept->push_back(std::move(t));
  }
}

namespace {

// A meta tensor (a shape-inference forward) has no data to take statistics of: skipped, as a non-floating one.
bool is_recordable(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || t.is_meta()) return false;
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}

void check_backend(const at::Tensor& x) {
  if (!x.is_cuda()) return;
  static const bool has_cuda = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("hookstats::stats_into", "")
                                   .hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  TORCH_CHECK(has_cuda,
              "hookstats.Monitor recorded a CUDA tensor, but this build of hookstats has no CUDA kernels. Rebuild "
              "with a CUDA build of torch and a CUDA toolkit: `HOOKSTATS_CUDA=1 CUDA_HOME=/usr/local/cuda pip install "
              "--no-build-isolation -e .` (a build where no GPU is visible skips them unless asked; "
              "docs/development.md).");
}

int64_t hist_len_of(at::ScalarType t, const HistConfig& h) {
  return hist_length(t, make_hist_spec(static_cast<int>(h.mode), h.mode == kHistRange ? h.bins : 0, h.lo, h.hi));
}

}  // namespace

Recorder::Recorder(int64_t slots, HistConfig hist, int64_t init_rows, bool locations)
    : slots_(slots),
      init_rows_(init_rows),
      hist_(hist),
      hist_spec_(make_hist_spec(static_cast<int>(hist.mode), hist.mode == kHistRange ? hist.bins : 0, hist.lo,
                                hist.hi)),
      no_hist_(make_hist_spec(kHistNone, 0, 0.0, 0.0)),
      locations_(locations) {
  TORCH_CHECK_VALUE(slots >= 1, "hookstats.Monitor: slots must be >= 1, got ", slots);
  TORCH_CHECK_VALUE(init_rows >= 1, "hookstats.Monitor: rows must be >= 1, got ", init_rows);
}

int32_t Recorder::add_hook() {
  std::lock_guard<std::mutex> g(mu_);
  hooks_.emplace_back();
  return static_cast<int32_t>(hooks_.size() - 1);
}

void Recorder::begin_step(int64_t step, bool active, bool hist_on) {
  std::lock_guard<std::mutex> g(mu_);
  ++epoch_;
  step_ = step;
  hist_on_ = hist_on;
  active_.store(active && !closed_);
  // The step a replay enqueued from now on is numbered by (Note [monitor graph replays]): one fill per CUDA device
  // buffer, on its current stream; none inside a capture (it would be replayed).
  for (auto& b : devs_) {
    if (b.device.is_cuda()) {
      const CaptureIdFn fn = capture_id_fn();
      if (fn != nullptr && fn(b.device.index()) != 0) continue;
    } else if (!test_rings_ || test_capture_ != 0) {  // CPU rings exist only in tests (set_test_capture)
      continue;
    }
    b.graph_state.narrow(0, 0, 1).fill_(step);
  }
}

void Recorder::close() {
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
  active_.store(false);
  keep_rings();  // graphs may replay on: what they write stays allocated
  devs_.clear();
  hists_.clear();
  slot_steps_.clear();
  slot_hist_.clear();
  order_slots_.clear();
  order_sites_.clear();
  shape_ndim_.clear();
  shape_dims_.clear();
  cur_slot_ = -1;
  slot_epoch_ = -1;
}

// hook's counters, reset at the first use in a new step.
Recorder::HookState& Recorder::hook_state(int32_t hook) {
  HookState& h = hooks_.at(hook);
  if (h.epoch != epoch_) {
    h.epoch = epoch_;
    h.calls = 0;
    std::fill(h.tensor_calls.begin(), h.tensor_calls.end(), 0);
  }
  return h;
}

int32_t Recorder::next_call(int32_t hook) {
  std::lock_guard<std::mutex> g(mu_);
  return hook_state(hook).calls++;
}

int32_t Recorder::next_tensor_call(int32_t hook, int32_t index) {
  std::lock_guard<std::mutex> g(mu_);
  HookState& h = hook_state(hook);
  if (static_cast<int64_t>(h.tensor_calls.size()) <= index) h.tensor_calls.resize(index + 1, 0);
  return h.tensor_calls[index]++;
}

int32_t Recorder::site_for(int32_t hook, int32_t index, int32_t call, const at::Tensor& t, bool captured) {
  HookState& h = hooks_.at(hook);
  const int64_t key = (static_cast<int64_t>(call) << 32) | static_cast<uint32_t>(index);
  const c10::Device dev = t.device();
  const at::ScalarType dt = t.scalar_type();
  int32_t head = h.first;
  if (key != 0) {
    auto it = h.sites.find(key);
    head = it == h.sites.end() ? -1 : it->second;
  }
  int32_t prev = -1;
  for (int32_t s = head; s >= 0; s = sites_[s].next) {
    const Site& site = sites_[s];
    if (site.dtype == dt && devs_[site.dev].device == dev) return s;
    prev = s;
  }
  Site s{hook, index, call, 0, 0, -1, -1, -1, dt};
  s.dev = device_index(dev);
  DeviceBuffer& b = devs_[s.dev];
  // Inside a capture no buffer may grow or be created (Note [monitor graph replays]): its copy would be captured.
  static const char* warm_up =
      " inside CUDA graph capture. Run the monitored step once outside capture first (the usual warm-up), or give "
      "the Monitor more rows (rows=) so that the captured step's tensors fit the buffers it has.";
  if (b.rows == b.cap) {
    TORCH_CHECK(!captured, "hookstats.Monitor: a new tensor on ", dev, " needs more rows than the buffer has (",
                b.cap, ")", warm_up);
    grow_rows(b);
  }
  s.row = static_cast<int32_t>(b.rows++);
  if (hist_.mode != 0) {
    const int64_t len = hist_len_of(dt, hist_);
    if (captured) {
      bool found = false;
      for (const auto& h : hists_) found = found || (h.dev == s.dev && h.len == len);
      TORCH_CHECK(found, "hookstats.Monitor: the first ", dt, " histogram on ", dev, " is recorded", warm_up);
    }
    s.hgroup = hist_group(s.dev, len);
    HistBuffer& hb = hists_[s.hgroup];
    if (hb.rows == hb.cap) {
      TORCH_CHECK(!captured, "hookstats.Monitor: a new histogram on ", dev, " needs more rows than the buffer has (",
                  hb.cap, ")", warm_up);
      grow_hist_rows(hb);
    }
    s.hrow = static_cast<int32_t>(hb.rows++);
  }
  const int32_t id = static_cast<int32_t>(sites_.size());
  sites_.push_back(s);
  if (prev >= 0) {
    sites_[prev].next = id;
  } else if (key == 0) {
    h.first = id;
  } else {
    h.sites.emplace(key, id);
  }
  return id;
}

// Note [successor prefetch]: the last site written learns that `site` follows it; `site`'s own successor is fetched.
void Recorder::prefetch_successor(Site& s, int32_t site, int64_t slot) {
  if (last_site_ >= 0 && last_site_ < static_cast<int32_t>(sites_.size()) && last_site_ != site) {
    Site& last = sites_[last_site_];  // in cache: written a hook ago
    last.succ = site;
    last.succ_hook = s.hook;
    last.succ_row = s.dev == last.dev ? s.row : -1;
  }
  last_site_ = site;
  if (s.succ < 0 || s.succ >= static_cast<int32_t>(sites_.size()) || s.succ_hook < 0 ||
      s.succ_hook >= static_cast<int32_t>(hooks_.size())) {
    return;
  }
  const auto* h = reinterpret_cast<const char*>(&hooks_[s.succ_hook]);
  __builtin_prefetch(h);
  __builtin_prefetch(h + sizeof(HookState) - 1);
  __builtin_prefetch(&sites_[s.succ]);
  const DeviceBuffer& b = devs_[s.dev];
  if (s.succ_row >= 0 && b.device.is_cpu() && s.succ_row < b.cap) {
    const auto* row = reinterpret_cast<const char*>(b.stats.data_ptr<double>() +
                                                    (slot * b.cap + s.succ_row) * static_cast<int64_t>(kNumStatFields));
    __builtin_prefetch(row, 1);
    __builtin_prefetch(row + kNumStatFields * sizeof(double) - 1, 1);
  }
}

void Recorder::write(int32_t site, const at::Tensor& x, int64_t slot, bool hist) {
  Site& s = sites_[site];
  prefetch_successor(s, site, slot);
  const DeviceBuffer& b = devs_[s.dev];
  order_slots_.push_back(static_cast<int32_t>(slot));
  order_sites_.push_back(site);
  if (locations_) {  // the record's shape, for its coordinates (Note [monitor sites])
    shape_ndim_.push_back(static_cast<int32_t>(x.dim()));
    for (const int64_t d : x.sizes()) shape_dims_.push_back(d);
  }
  if (x.is_cpu() && !x.unsafeGetTensorImpl()->is_python_dispatch()) {  // the CPU runner directly: the buffers are ours, their checks done once, when allocated
    RECORD_FUNCTION("hookstats::stats_into", c10::ArrayRef<const c10::IValue>{});  // the profiler still sees it
    double* row = b.stats.data_ptr<double>() + (slot * b.cap + s.row) * static_cast<int64_t>(kNumStatFields);
    StatsOut o{row, nullptr, true};
    if (locations_) o.loc = b.loc.data_ptr<int64_t>() + (slot * b.cap + s.row) * 2;
    if (hist && s.hgroup >= 0) {
      const HistBuffer& hb = hists_[s.hgroup];
      stats_cpu_runner(x, o, hist_spec_, hb.counts.data_ptr<int64_t>() + (slot * hb.cap + s.hrow) * hb.len, hb.len,
                       /*accumulate=*/false);
    } else {
      stats_cpu_runner(x, o, no_hist_, nullptr, 0, false);
    }
    return;
  }
  const std::optional<at::Tensor> loc = locations_ ? std::optional<at::Tensor>(b.loc) : std::nullopt;
  if (hist && s.hgroup >= 0) {
    const HistBuffer& hb = hists_[s.hgroup];
    stats_into(x, b.stats, slot * b.cap + s.row, hb.counts, slot * hb.cap + s.hrow, hist_, loc);
  } else {
    stats_into(x, b.stats, slot * b.cap + s.row, std::nullopt, 0, hist_, loc);
  }
}

// Counts t in skipped() and returns false when it is not recorded; checks its backend.
static bool check_recordable(const at::Tensor& t, std::atomic<int64_t>& skipped) {
  if (!is_recordable(t)) {
    if (t.defined()) skipped.fetch_add(1);
    return false;
  }
  check_backend(t);
  return true;
}

void Recorder::record(int32_t hook, int32_t index, int32_t call, const at::Tensor& t) {
  if (!check_recordable(t, skipped_)) return;
  std::lock_guard<std::mutex> g(mu_);
  record_locked(hook, index, call, t);
}

void Recorder::record_tensor(int32_t hook, int32_t index, const at::Tensor& t) {
  const bool ok = check_recordable(t, skipped_);
  std::lock_guard<std::mutex> g(mu_);
  HookState& h = hook_state(hook);  // the call is counted whether or not t is recorded (as next_tensor_call)
  if (static_cast<int64_t>(h.tensor_calls.size()) <= index) h.tensor_calls.resize(index + 1, 0);
  const int32_t call = h.tensor_calls[index]++;
  if (ok) record_locked(hook, index, call, t);
}

void Recorder::record_locked(int32_t hook, int32_t index, int32_t call, const at::Tensor& t) {
  if (!active_.load() || closed_) return;
  if (const uint64_t cap = capture_of(t)) {
    Ring& r = ring_for(cap, t);
    write_ring(r, site_for(hook, index, call, t, /*captured=*/true), t);
    return;
  }
  const int32_t s = site_for(hook, index, call, t);
  const int64_t slot = ensure_slot();
  write(s, t, slot, hist_on_);
}

// Whether any tensor of ts is recorded (the others counted in skipped()).
static bool any_recordable(const std::vector<std::pair<int32_t, at::Tensor>>& ts, std::atomic<int64_t>& skipped) {
  int64_t n = 0;
  for (const auto& p : ts) {
    if (!is_recordable(p.second)) ++n;
    else check_backend(p.second);
  }
  if (n) skipped.fetch_add(n);
  return static_cast<int64_t>(ts.size()) != n;
}

void Recorder::record_many(int32_t hook, int32_t call, const std::vector<std::pair<int32_t, at::Tensor>>& ts) {
  if (!any_recordable(ts, skipped_)) return;
  std::lock_guard<std::mutex> g(mu_);
  record_many_locked(hook, call, ts);
}

void Recorder::record_call(int32_t hook, const std::vector<std::pair<int32_t, at::Tensor>>& ts) {
  const bool any = any_recordable(ts, skipped_);
  std::lock_guard<std::mutex> g(mu_);
  const int32_t call = hook_state(hook).calls++;  // counted whether or not a tensor is recorded (as next_call)
  if (any) record_many_locked(hook, call, ts);
}

void Recorder::record_many_locked(int32_t hook, int32_t call, const std::vector<std::pair<int32_t, at::Tensor>>& ts) {
  if (!active_.load() || closed_) return;
  int64_t slot = -1;  // taken at the first eager write: captured ones take none
  for (const auto& p : ts) {
    if (!is_recordable(p.second)) continue;
    if (const uint64_t cap = capture_of(p.second)) {
      Ring& r = ring_for(cap, p.second);
      write_ring(r, site_for(hook, p.first, call, p.second, /*captured=*/true), p.second);
      continue;
    }
    const int32_t s = site_for(hook, p.first, call, p.second);
    if (slot < 0) slot = ensure_slot();
    write(s, p.second, slot, hist_on_);
  }
}

void Recorder::record_calls(const std::vector<std::tuple<int32_t, int32_t, at::Tensor>>& calls) {
  static auto multi = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("hookstats::stats_multi_into", "")
                          .typed<void(at::TensorList, const at::Tensor&, at::IntArrayRef,
                                      const std::optional<at::Tensor>&, at::IntArrayRef, int64_t, int64_t, double,
                                      double, bool, const std::optional<at::Tensor>&)>();
  for (const auto& [hook, call, t] : calls) {
    if (!is_recordable(t)) skipped_.fetch_add(1);
    else check_backend(t);
  }
  std::lock_guard<std::mutex> g(mu_);
  if (!active_.load() || closed_) return;
  // One stats_multi_into call per (device, histogram group, ring): every grad of a device in one call; captured
  // grads into their capture's ring (Note [monitor graph replays]).
  struct Group {
    int32_t dev, hgroup, ring;
    std::vector<at::Tensor> xs;
    std::vector<int64_t> rows, hrows;
  };
  std::vector<int32_t> ids(calls.size(), -1), ring_of(calls.size(), -1);
  for (size_t i = 0; i < calls.size(); ++i) {  // every site first: a new one may grow (re-lay) a buffer
    const auto& [hook, call, t] = calls[i];
    if (!is_recordable(t)) continue;
    if (const uint64_t cap = capture_of(t)) {
      Ring& r = ring_for(cap, t);
      ring_of[i] = static_cast<int32_t>(&r - rings_.data());
    }
    ids[i] = site_for(hook, 0, call, t, /*captured=*/ring_of[i] >= 0);
  }
  if (locations_) {  // stats_multi_into has no locations: one stats_into per tensor, each with its location row
    int64_t slot = -1;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (ids[i] < 0) continue;
      if (slot < 0) slot = ensure_slot();
      write(ids[i], std::get<2>(calls[i]), slot, hist_on_);
    }
    return;
  }
  int64_t slot = -1;
  std::vector<Group> groups;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (ids[i] < 0) continue;
    const at::Tensor& t = std::get<2>(calls[i]);
    const int32_t id = ids[i];
    const Site& s = sites_[id];
    const int32_t ri = ring_of[i];
    int32_t hg = s.hgroup;
    if (ri >= 0) {
      Ring& r = rings_[ri];
      note_ring_site(r, id);
      if (!r.hist_on) hg = -1;
      if (hg >= 0) ring_hist(r, hg);
    } else {
      if (slot < 0) slot = ensure_slot();
      order_slots_.push_back(static_cast<int32_t>(slot));
      order_sites_.push_back(id);
      if (!hist_on_) hg = -1;
    }
    Group* grp = nullptr;
    for (auto& gr : groups) {
      if (gr.dev == s.dev && gr.hgroup == hg && gr.ring == ri) grp = &gr;
    }
    if (grp == nullptr) {
      groups.push_back(Group{s.dev, hg, ri, {}, {}, {}});
      grp = &groups.back();
    }
    grp->xs.push_back(t);
    grp->rows.push_back(ri >= 0 ? s.row : slot * devs_[s.dev].cap + s.row);
    if (hg >= 0) grp->hrows.push_back(ri >= 0 ? s.hrow : slot * hists_[hg].cap + s.hrow);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (const auto& gr : groups) {
    const DeviceBuffer& b = devs_[gr.dev];
    if (gr.ring >= 0) {
      const Ring& r = rings_[gr.ring];
      const at::Tensor pos = ring_pos(r);
      if (gr.hgroup >= 0) {
        multi.call(gr.xs, r.stats, gr.rows, r.hists[gr.hgroup], gr.hrows, hist_.mode, hist_.bins, hist_.lo, hist_.hi,
                   false, pos);
      } else {
        multi.call(gr.xs, r.stats, gr.rows, std::nullopt, {}, 0, 0, 0.0, 0.0, false, pos);
      }
    } else if (gr.hgroup >= 0) {
      multi.call(gr.xs, b.stats, gr.rows, hists_[gr.hgroup].counts, gr.hrows, hist_.mode, hist_.bins, hist_.lo,
                 hist_.hi, false, std::nullopt);
    } else {
      multi.call(gr.xs, b.stats, gr.rows, std::nullopt, {}, 0, 0, 0.0, 0.0, false, std::nullopt);
    }
  }
}

}  // namespace monitor
}  // namespace hookstats
