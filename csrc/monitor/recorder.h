// The Monitor's recording core (Note [monitor sites]): the site table, the per-device step-block
// buffers, and the record path that hook callables (monitor_py.cpp) and tensor hooks call
// without Python. Torch-facing C++ only; Python sees it through pybind11.
//
// Note [monitor sites]
// A site is one (hook, tensor index, call number within the step, device, dtype): "the 2nd call
// of block 3's forward, output 0". Site ids are small integers, assigned when a site is first
// recorded, in that order, and never reused; new sites may appear at any step. Each device has a
// stats buffer of [slots, cap] rows of 13 float64 (one row per (step slot, site)), and each
// (device, histogram length) a histogram buffer of [slots, hcap] int64 rows; a site owns one row
// index in its device's block (and one in its histogram group's). A step that records anything
// takes the next slot. A row is written by one stats_into call; every row starts (and is reset
// after each flush to) NaN. The host keeps the site table, one step number per slot, and the
// order in which rows were written (two int32 per record: records come back in hook-call order,
// whatever the site numbering). A flush
// copies each buffer's used block to the host in one copy (Python: hookstats/monitor/buffers.py).
// A buffer grows (doubles, slots or cap) by a device-to-device copy: no host sync, nothing dropped.
// Call numbers count per hook and step for forward-side hooks, and per (hook, tensor index) and
// step for tensor hooks, at the time the hook runs: gradient accumulation and retain_graph give
// one site per backward call, as they give one PyTorch hook call each.
// With locations (Recorder(..., locations=true)), each device also has a location block of
// [slots * cap, 2] int64 rows beside its stats block (same row index, grown and reset with it, -1
// until written): the flat indices of each record's first largest |x| and first NaN/Inf (Note
// [element locations] in csrc/core/loc_ops.h), written by the same stats_into call; and the host
// keeps each record's shape (the shape of a site's tensor may change between steps), so a flush
// can turn indices into coordinates. Without locations none of this exists.
// Tensor hooks run on autograd threads without the GIL: every state change is under one mutex.
//
// Note [successor prefetch]
// A step records its sites in the order the step before did, thousands of them on a large model, each touching its
// hook's state, its site and its row of the step block: all cold again when the next step comes to them (the
// model's weights and activations went through the caches in between), a few misses a record, ~0.5 µs of the
// 1,001-module MLP's per-module cost by perf. So each site keeps the site written after it the last time (with
// that site's hook and row, so that no cold load is needed to find them), and writing a site prefetches its
// successor's hook state, site and CPU row, which the next hook then finds in cache, a module's compute later. A
// wrong guess (the order changed) costs a prefetch, never a result.
//
// Note [monitor graph replays]
// A record made while its CUDA stream is being captured into a graph (the recorder asks
// capture.h's query before each write) does not take a host slot: kernels that run only at replay
// cannot fill rows the host has already accounted for. Each capture (by the id CUDA gives it) and
// device gets a Ring: a [slots, cap, 13] stats block (and [slots, hcap, len] histogram blocks)
// allocated at its first record, cap that of the device's block then, and (k, p) in the
// device's graph_state, an int64 tensor allocated with the device's block (so zeroed outside any
// capture). The ring's first record also captures hookstats::_ring_advance: every replay first
// sets p = k mod slots, steps[p] = the current step, k += 1, and then each captured stats call
// writes its site's row of ring slot p (Note [ring rows] in csrc/core/stats_ops.h). The current
// step lives in graph_state[0], set by begin_step() (a fill on the device's current stream,
// outside capture), so a replay is numbered by the mon.step() calls enqueued before it. The host
// keeps the ring's write order (the sites of one replay); a flush reads k, gathers the replays
// since the last flush in order, and appends them as slots after the eager ones (ordered by
// step). A ring holds `slots` replays: replays beyond it before a flush overwrite the oldest,
// which are counted in dropped_replays(). Rules: a captured step must have been recorded eagerly
// once (warm-up), so that its device's buffers exist and no buffer grows inside the capture
// (growing would copy rows inside the graph); one capture holds one monitored step (a site
// twice is an error: call mon.step() outside the graph); `every`/histogram_every are decided at
// capture. Ring memory comes from outside the capture's pool (Note [ring memory] in
// cuda/ring_cuda.cu). Ring memory and graph_state are kept for the life of the process once
// captured: a graph may replay after the Monitor is gone. The ring code is in rings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "../core/hist_ops.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace hookstats {
namespace monitor {

struct HistConfig {
  int64_t mode = 0;  // 0: none, 1: range, 2: exponent (csrc/core/hist_ops.h)
  int64_t bins = 0;
  double lo = 0.0, hi = 0.0;
};

struct Site {
  int32_t hook, index, call;
  int32_t dev;     // index into Recorder::devs_
  int32_t row;     // row within the device's step block
  int32_t hgroup;  // index into Recorder::hists_, -1 without a histogram
  int32_t hrow;
  int32_t next;    // another site with the same (hook, index, call) but another device or dtype, or -1
  at::ScalarType dtype;
  // The site written after this one the last time, with its hook and row, or -1 (Note [successor prefetch]).
  int32_t succ = -1, succ_hook = -1, succ_row = -1;
};

constexpr int32_t kMaxRings = 64;  // captured graphs per device and Monitor

struct DeviceBuffer {
  c10::Device device;
  at::Tensor stats;  // [slots * cap, 13] float64: row (slot, r) at slot * cap + r
  int64_t cap = 0, rows = 0;
  at::Tensor graph_state;  // int64 [2 + 2 * kMaxRings]: the current step, unused, then (k, p) per ring
  int32_t num_rings = 0;
  at::Tensor loc;    // [slots * cap, 2] int64, the same rows; only with locations
};

// A captured step's rows on one device (Note [monitor graph replays]).
struct Ring {
  uint64_t capture;
  int32_t dev, index;  // device buffer; (k, p) at graph_state[2 + 2 * index]
  int64_t cap, slots;
  at::Tensor stats;                // [slots, cap, 13] float64
  std::vector<at::Tensor> hists;   // per histogram group: [slots, hcap, len] int64, or undefined
  std::vector<int64_t> hcaps;
  at::Tensor steps;                // [slots] int64
  bool hist_on;
  bool advanced = false;           // test replays: the prologue of this pass ran
  std::vector<int32_t> order;      // the sites of one replay, in write order
  std::vector<uint8_t> has_site;   // by site id
  int64_t emitted = 0, taken = 0;  // replays handed to flushes; read by the last take()
};

struct HistBuffer {
  int32_t dev;
  int64_t len;
  at::Tensor counts;  // [slots * cap, len] int64
  int64_t cap = 0, rows = 0;
};

class Recorder {
 public:
  Recorder(int64_t slots, HistConfig hist, int64_t init_rows, bool locations = false);
  // Keeps captured rings alive, as close() does (a graph may replay after the Monitor is gone).
  ~Recorder();
  bool locations() const { return locations_; }

  // A new hook id (hooks are numbered from 0; Python keeps their names and kinds).
  int32_t add_hook();

  // Starts step `step`: records go under it while `active`; histograms only when `hist_on`.
  void begin_step(int64_t step, bool active, bool hist_on);
  bool active() const { return active_.load(std::memory_order_relaxed); }
  // Closed recorders record nothing (a graph built before detach() still runs its hooks).
  void close();

  // The next call number of hook (forward-side hooks: one per call, for all its tensors).
  int32_t next_call(int32_t hook);
  // The next call number of (hook, index) (tensor hooks).
  int32_t next_tensor_call(int32_t hook, int32_t index);
  // Records t at site (hook, index, call) of the current step. Non-floating and meta tensors are
  // counted in skipped() and not recorded.
  void record(int32_t hook, int32_t index, int32_t call, const at::Tensor& t);
  // Records many tensors of one hook call under one lock.
  void record_many(int32_t hook, int32_t call, const std::vector<std::pair<int32_t, at::Tensor>>& ts);
  // One lock for a hook run: next_call(hook) then record_many (a forward-side hook), or next_tensor_call(hook,
  // index) then record (a tensor hook). The call is counted even when nothing of it is recorded.
  void record_call(int32_t hook, const std::vector<std::pair<int32_t, at::Tensor>>& ts);
  void record_tensor(int32_t hook, int32_t index, const at::Tensor& t);

  // Records tensor 0 of many hook calls (hook, call, tensor) under one lock, into one step slot.
  void record_calls(const std::vector<std::tuple<int32_t, int32_t, at::Tensor>>& calls);

  // Flush support, under the lock: the used blocks (device tensors, views), the step per slot,
  // whether each slot's histograms were on, and then reset() makes the buffers empty again.
  struct Taken {
    std::vector<std::pair<c10::Device, at::Tensor>> stats;                   // [slots, rows, 13]
    std::vector<std::tuple<int32_t, int64_t, at::Tensor>> hists;             // (dev, len, [slots, rows, len])
    std::vector<int64_t> steps;
    std::vector<uint8_t> hist_on;
    std::vector<int32_t> order_slots, order_sites;  // every written (slot, site), in the order written
    // With locations: per device its [slots, rows, 2] location block, and every written record's shape
    // (shape_ndim[i] dims of record i, one after another in shape_dims), in the order written.
    std::vector<at::Tensor> locs;
    std::vector<int32_t> shape_ndim;
    std::vector<int64_t> shape_dims;
  };
  Taken take();
  void reset();  // NaN/zero the used rows and forget the slots (after the host copy is enqueued)

  int64_t skipped() const { return skipped_.load(); }
  int64_t dropped_replays() const { return dropped_replays_.load(); }
  int64_t num_rings();
  // Tests: CPU tensors recorded while id != 0 are treated as captured under that id; with replay,
  // as a replay of that capture (its prologue and rows run again, the write order is kept).
  void set_test_capture(uint64_t id, bool replay);
  int64_t num_sites();
  // Sites [from, num_sites()): (hook, index, call, dtype name, device string, dev, row, hgroup, hrow).
  std::vector<Site> sites_from(int64_t from);
  std::vector<c10::Device> devices();
  int64_t pending_slots();

 private:
  void record_locked(int32_t hook, int32_t index, int32_t call, const at::Tensor& t);
  void record_many_locked(int32_t hook, int32_t call, const std::vector<std::pair<int32_t, at::Tensor>>& ts);
  int32_t site_for(int32_t hook, int32_t index, int32_t call, const at::Tensor& t, bool captured = false);
  uint64_t capture_of(const at::Tensor& t) const;
  Ring& ring_for(uint64_t capture, const at::Tensor& t);
  void write_ring(Ring& r, int32_t site, const at::Tensor& x);
  void note_ring_site(Ring& r, int32_t site);
  const at::Tensor& ring_hist(Ring& r, int32_t hgroup);
  at::Tensor ring_pos(const Ring& r) const;
  void append_rings(Taken& out);
  void keep_rings();  // rings_ (and their devices' graph_state) kept for the life of the process, then cleared
  int32_t device_index(const c10::Device& d);
  int32_t hist_group(int32_t dev, int64_t len);
  int64_t ensure_slot();
  void grow_slots(int64_t need);
  void grow_rows(DeviceBuffer& b);
  void grow_hist_rows(HistBuffer& h);
  void write(int32_t site, const at::Tensor& x, int64_t slot, bool hist);

  std::mutex mu_;
  int64_t slots_;          // capacity of every buffer, in step slots
  int64_t init_rows_;
  HistConfig hist_;
  HistSpec hist_spec_, no_hist_;  // for the CPU runner, called directly
  std::vector<DeviceBuffer> devs_;
  std::vector<HistBuffer> hists_;
  std::vector<Site> sites_;
  int32_t last_site_ = -1;  // the site written last (Note [successor prefetch])
  void prefetch_successor(Site& s, int32_t site, int64_t slot);
  struct HookState {
    int64_t epoch = -1;
    int32_t calls = 0;
    std::vector<int32_t> tensor_calls;
    int32_t first = -1;  // first site id of (call 0, index 0), the common key, kept out of the map: a
                         // step touches every hook's state once, and the map's bucket and node are two more
                         // cache misses a record (measured: site_for was the hottest hookstats function)
    std::unordered_map<int64_t, int32_t> sites;  // (call << 32 | index) -> first site id, other keys
  };
  std::vector<HookState> hooks_;
  HookState& hook_state(int32_t hook);
  int64_t epoch_ = 0, step_ = 0;
  std::atomic<bool> active_{true};
  bool hist_on_ = true;
  bool closed_ = false;
  int64_t slot_epoch_ = -1, cur_slot_ = -1;
  std::vector<int64_t> slot_steps_;
  std::vector<uint8_t> slot_hist_;
  std::vector<int32_t> order_slots_, order_sites_;
  std::atomic<int64_t> skipped_{0};
  std::vector<Ring> rings_;
  std::atomic<int64_t> dropped_replays_{0};
  uint64_t test_capture_ = 0;
  bool test_replay_ = false, test_rings_ = false;
  bool locations_ = false;
  std::vector<int32_t> shape_ndim_;
  std::vector<int64_t> shape_dims_;
};


}  // namespace monitor
}  // namespace hookstats
