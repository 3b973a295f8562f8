// The entry points of hookstats.detect_nonfinite's observer (observer.cpp), registered as the
// torch.ops.hookstats._nf_* ops in csrc/hookstats.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace hookstats {
namespace anomaly {

// Installs the global callback; the states are the devices' (Note [nonfinite guard state]); the outputs of the
// ops named in ignore_ops ("aten::masked_fill") are not checked.
void start(const at::Tensor& cpu_state, const std::vector<at::Tensor>& cuda_states,
           const std::vector<std::string>& ignore_ops);
void stop();
// Turns the installed callback off or on (every=N: nothing runs per op between sampled steps).
void enable(bool on);
// Advances every device's step counter on the device (no sync).
void step();
// The module the calling thread is in (-1: none), set by the guard's module hooks.
void set_module(int64_t id);
// The name table that the records' kOp and kNode index.
std::vector<std::string> names();
// The device states: the CPU one first.
std::vector<at::Tensor> states();
// (outputs checked, outputs left unchecked, op order counter, slots per state).
std::vector<int64_t> counters();

}  // namespace anomaly
}  // namespace hookstats
