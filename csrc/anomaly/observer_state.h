// What the observer's callbacks (observer.cpp) and its controls (control.cpp) share: the one Observer of the
// process. Internal to csrc/anomaly/.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace hookstats {
namespace anomaly {

constexpr int kMaxCudaDevices = 64;
constexpr size_t kMaxSeqEntries = size_t(1) << 22;  // the sequence map is cleared at each step, or past this

struct Observer {
  std::mutex mu;  // start/stop, the name table, lazy states
  at::CallbackHandle handle = 0;
  bool installed = false;
  bool enabled = false;
  std::atomic<uint64_t> generation{1};
  std::atomic<int64_t> order{0};
  std::atomic<int64_t> unchecked{0};  // CUDA outputs that could not be checked (no kernels, no state)
  std::atomic<int64_t> checked{0};
  at::Tensor cpu_state;
  int64_t* cpu_ptr = nullptr;
  at::Tensor cuda_states[kMaxCudaDevices];
  std::atomic<int64_t*> cuda_ptrs[kMaxCudaDevices];
  std::vector<std::string> names;
  std::unordered_map<std::string, int64_t> name_ids;
  std::unordered_set<std::string> ignored;  // op names whose outputs are not checked (ignore_ops=)
  std::mutex seq_mu;
  std::unordered_map<int64_t, int64_t> seq_module;
};


// The process's observer (never destroyed: a callback may run during static destruction); control.cpp.
Observer& obs();

// The index of a name in the name table (op and node names), added when new; control.cpp.
int64_t name_id(const std::string& name);

// The callbacks (observer.cpp).
std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn);
void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx);

}  // namespace anomaly
}  // namespace hookstats
