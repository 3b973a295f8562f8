// CPU implementation of hookstats::_ring_advance (Note [monitor graph replays] in
// csrc/monitor/recorder.h): the same three stores the CUDA kernel makes, for CPU tests of the
// ring bookkeeping.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../core/ring_ops.h"

namespace hookstats {
namespace {

void ring_advance_cpu(const at::Tensor& state, const at::Tensor& steps, const at::Tensor& step) {
  check_ring_advance(state, steps, step);
  ring_advance(state.data_ptr<int64_t>(), steps.data_ptr<int64_t>(), steps.numel(), step.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CPU, m) {
  m.impl("_ring_advance", &ring_advance_cpu);
}

}  // namespace hookstats
