// The controls of hookstats.detect_nonfinite's observer (observer.h): installing and removing the callback,
// pausing it, the devices' step counters, and reading back the name table, the states and the counters.
#include <ATen/record_function.h>

#include <string>
#include <vector>

#include "device_fns.h"
#include "nonfinite_ops.h"
#include "observer.h"
#include "observer_state.h"

namespace hookstats {
namespace anomaly {

Observer& obs() {
  static Observer* o = new Observer();  // never destroyed: a callback may run during static destruction
  return *o;
}

int64_t name_id(const std::string& name) {
  Observer& o = obs();
  std::lock_guard<std::mutex> lock(o.mu);
  auto it = o.name_ids.find(name);
  if (it != o.name_ids.end()) return it->second;
  const int64_t id = static_cast<int64_t>(o.names.size());
  o.names.push_back(name);
  o.name_ids.emplace(name, id);
  return id;
}

void start(const at::Tensor& cpu_state, const std::vector<at::Tensor>& cuda_states,
           const std::vector<std::string>& ignore_ops) {
  Observer& o = obs();
  std::lock_guard<std::mutex> lock(o.mu);
  TORCH_CHECK(!o.installed, "hookstats.detect_nonfinite: another guard is active in this process; exit it first "
              "(one guard watches every op of the process)");
  TORCH_CHECK(cpu_state.is_cpu() && cpu_state.scalar_type() == c10::kLong && cpu_state.numel() == kNumSlots &&
                  cpu_state.is_contiguous(),
              "hookstats._nf_start: the CPU state must be a contiguous int64 CPU tensor of ", kNumSlots, " slots");
  o.cpu_state = cpu_state;
  o.cpu_ptr = cpu_state.data_ptr<int64_t>();
  for (int d = 0; d < kMaxCudaDevices; ++d) {
    o.cuda_states[d] = at::Tensor();
    o.cuda_ptrs[d].store(nullptr);
  }
  for (const at::Tensor& s : cuda_states) {
    TORCH_CHECK(s.is_cuda() && s.scalar_type() == c10::kLong && s.numel() == kNumSlots && s.is_contiguous(),
                "hookstats._nf_start: a CUDA state must be a contiguous int64 CUDA tensor of ", kNumSlots, " slots");
    const int d = s.get_device();
    TORCH_CHECK(d >= 0 && d < kMaxCudaDevices, "hookstats._nf_start: CUDA device ", d, " out of range");
    o.cuda_states[d] = s;
    o.cuda_ptrs[d].store(s.data_ptr<int64_t>());
  }
  o.names.clear();
  o.name_ids.clear();
  o.ignored = std::unordered_set<std::string>(ignore_ops.begin(), ignore_ops.end());
  {
    std::lock_guard<std::mutex> seq_lock(o.seq_mu);
    o.seq_module.clear();
  }
  o.order.store(0);
  o.unchecked.store(0);
  o.checked.store(0);
  o.generation.fetch_add(1);
  o.handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_start, &on_end)
          .needsInputs(true)
          .needsOutputs(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION, at::RecordScope::USER_SCOPE}));
  o.installed = true;
  o.enabled = true;
}

void stop() {
  Observer& o = obs();
  std::lock_guard<std::mutex> lock(o.mu);
  if (!o.installed) return;
  at::removeCallback(o.handle);
  o.installed = false;
  o.enabled = false;
  o.generation.fetch_add(1);
  std::lock_guard<std::mutex> seq_lock(o.seq_mu);
  o.seq_module.clear();
}

void enable(bool on) {
  Observer& o = obs();
  std::lock_guard<std::mutex> lock(o.mu);
  TORCH_CHECK(o.installed, "hookstats._nf_enable: no guard is active");
  if (on == o.enabled) return;
  if (on) at::reenableCallback(o.handle);
  else at::disableCallback(o.handle);
  o.enabled = on;
}

void step() {
  Observer& o = obs();
  std::lock_guard<std::mutex> lock(o.mu);
  TORCH_CHECK(o.installed, "hookstats._nf_step: no guard is active");
  o.cpu_ptr[kStep] += 1;
  for (int d = 0; d < kMaxCudaDevices; ++d) {
    int64_t* p = o.cuda_ptrs[d].load();
    if (p != nullptr && cuda_fns().step != nullptr) cuda_fns().step(p, d);
  }
  std::lock_guard<std::mutex> seq_lock(o.seq_mu);
  o.seq_module.clear();
}

std::vector<std::string> names() {
  Observer& o = obs();
  std::lock_guard<std::mutex> lock(o.mu);
  return o.names;
}

std::vector<at::Tensor> states() {
  Observer& o = obs();
  std::lock_guard<std::mutex> lock(o.mu);
  std::vector<at::Tensor> out;
  if (o.cpu_state.defined()) out.push_back(o.cpu_state);
  for (int d = 0; d < kMaxCudaDevices; ++d) {
    if (o.cuda_states[d].defined()) out.push_back(o.cuda_states[d]);
  }
  return out;
}

std::vector<int64_t> counters() {
  Observer& o = obs();
  return {o.checked.load(), o.unchecked.load(), o.order.load(), static_cast<int64_t>(kNumSlots)};
}

}  // namespace anomaly
}  // namespace hookstats
