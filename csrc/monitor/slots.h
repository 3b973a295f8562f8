// grad_output per output slot: Note [grad_output per output slot] in slots.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "py_tensors.h"
#include "recorder.h"

namespace hookstats {
namespace monitor {

// A call's start (the autograd sequence number before its forward ran, plus one), per thread, keyed by the forward
// hook that takes it back: forward_start at the forward pre-hook, take_start at the forward hook (0: unknown).
void forward_start(const void* key);
uint64_t take_start(const void* key);

// The start of a call whose module computes every output it returns (a Linear, a norm, an activation: hooks.py
// decides which, Note [grad_output per output slot]): any node of an output was made by the call.
constexpr uint64_t kFreshOutputs = ~uint64_t{0};

// grad_output of each output of ts that requires grad: a tensor hook where that is exact, else an alias (Note
// [grad_output per output slot]). Returns the aliases as (flat index, alias) pairs, an undefined alias where none
// could be made (a subclass refusing detach()); empty when every output kept its tensor hook.
std::vector<std::pair<int32_t, at::Tensor>> hook_outputs(const std::shared_ptr<Recorder>& r, int32_t hook,
                                                         const Tensors& ts, uint64_t start);

}  // namespace monitor
}  // namespace hookstats
