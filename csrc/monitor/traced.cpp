// What a compiled graph runs where a traced Monitor hook was (Note [monitor under torch.compile] in
// hookstats/monitor/compile.py): hookstats::_monitor_record, which reaches its recorder by id, with no Python.
#include <torch/library.h>

#include <iterator>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "recorder.h"
#include "traced.h"

namespace hookstats {
namespace monitor {
namespace {

std::mutex& registry_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::unordered_map<int64_t, std::weak_ptr<Recorder>>& registry() {
  static auto* r = new std::unordered_map<int64_t, std::weak_ptr<Recorder>>();
  return *r;
}

void monitor_record(const c10::List<std::optional<at::Tensor>>& xs, int64_t monitor, int64_t hook, int64_t index) {
  std::shared_ptr<Recorder> rec;
  {
    std::lock_guard<std::mutex> g(registry_mutex());
    auto it = registry().find(monitor);
    if (it != registry().end()) rec = it->second.lock();
  }
  if (!rec || !rec->active()) return;
  const int32_t h = static_cast<int32_t>(hook);
  if (index >= 0) {
    const std::optional<at::Tensor> g = xs.size() ? xs.get(0) : std::nullopt;
    if (!g.has_value() || !g->defined()) return;
    rec->record_tensor(h, static_cast<int32_t>(index), *g);
    return;
  }
  std::vector<std::pair<int32_t, at::Tensor>> ts;
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::optional<at::Tensor> t = xs.get(i);
    if (t.has_value() && t->defined()) ts.emplace_back(static_cast<int32_t>(i), *t);
  }
  if (ts.empty()) return;
  rec->record_call(h, ts);
}

}  // namespace

void register_recorder(int64_t id, const std::shared_ptr<Recorder>& r) {
  std::lock_guard<std::mutex> g(registry_mutex());
  auto& reg = registry();
  for (auto it = reg.begin(); it != reg.end();) {  // forget dropped recorders
    it = it->second.expired() ? reg.erase(it) : std::next(it);
  }
  reg[id] = r;
}

}  // namespace monitor
}  // namespace hookstats

TORCH_LIBRARY_IMPL(hookstats, CompositeExplicitAutograd, m) {
  m.impl("_monitor_record", &hookstats::monitor::monitor_record);
}
