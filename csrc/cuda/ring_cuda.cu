// CUDA side of a Monitor's captured steps (Note [monitor graph replays] in csrc/monitor/recorder.h):
// hookstats::_ring_advance as a one-thread kernel, and the capture query the recorder asks before
// it writes a row (registered at load time, so that recorder.cpp needs no CUDA headers).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../core/ring_ops.h"
#include "../monitor/capture.h"

namespace hookstats {
namespace {

__global__ void ring_advance_kernel(int64_t* state, int64_t* steps, int64_t slots, const int64_t* step) {
  ring_advance(state, steps, slots, step);
}

void ring_advance_cuda(const at::Tensor& state, const at::Tensor& steps, const at::Tensor& step) {
  check_ring_advance(state, steps, step);
  const c10::cuda::CUDAGuard guard(state.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(state.device().index());
  ring_advance_kernel<<<1, 1, 0, stream>>>(state.data_ptr<int64_t>(), steps.data_ptr<int64_t>(), steps.numel(),
                                          step.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The id of the capture the current stream of `device` is in, 0 when it is not capturing.
uint64_t current_capture_id(int8_t device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id));
  return status == cudaStreamCaptureStatusActive ? static_cast<uint64_t>(id) : 0u;
}

const bool registered = [] {
  monitor::capture_id_fn() = &current_capture_id;
  return true;
}();

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("_ring_advance", &ring_advance_cuda);
}

}  // namespace hookstats
