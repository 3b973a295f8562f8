// The step prologue of a captured Monitor step (Note [monitor graph replays] in
// csrc/monitor/recorder.h), shared by the CPU and the CUDA implementation of
// hookstats::_ring_advance, and its argument checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "stats_ops.h"  // HS_HD

namespace hookstats {

// state = (k, p): replays so far and the ring slot of the one running. One thread.
HS_HD void ring_advance(int64_t* state, int64_t* steps, int64_t slots, const int64_t* step) {
  const int64_t k = state[0];
  const int64_t p = k % slots;
  state[1] = p;
  steps[p] = step[0];
  state[0] = k + 1;
}

inline void check_ring_advance(const at::Tensor& state, const at::Tensor& steps, const at::Tensor& step) {
  for (const at::Tensor* t : {&state, &steps, &step}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong, "hookstats._ring_advance takes int64 tensors, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device() == state.device(),
                      "hookstats._ring_advance takes contiguous tensors on one device");
  }
  TORCH_CHECK_VALUE(state.numel() == 2 && steps.numel() >= 1 && step.numel() >= 1,
                    "hookstats._ring_advance: state is (k, p), steps one element per ring slot, step one element");
}

}  // namespace hookstats
