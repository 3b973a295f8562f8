// CUDA side of a Monitor's captured steps (Note [monitor graph replays] in csrc/monitor/recorder.h):
// hookstats::_ring_advance as a one-thread kernel, the capture query the recorder asks before it
// writes a row, and the ring allocator (Note [ring memory]); the last two registered at load time
// (monitor/capture.h), so that the recorder needs no CUDA headers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>

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

// Note [ring memory]
// A capture's ring (recorder.cpp, Note [monitor graph replays]) is allocated at the capture's first
// record, inside the capture. From the graph's private pool it could sit on a block that a
// temporary of the same capture freed earlier: PyTorch reuses such blocks for later allocations of
// the capture, so a node before the ring's first write (the temporary's) would rewrite the ring's
// memory at every replay, and the rows of earlier replays would be lost. (A static graph output
// does not mind; a ring must keep rows across replays.) So rings come from a stream of the
// recorder's own, never captured: the caching allocator serves a stream that is not capturing from
// its ordinary pools, which no capture reuses, and only rings are ever allocated on that stream, so
// no block of it has pending work of anyone else. A new segment is a cudaMalloc during the capture:
// legal with this thread's capture mode relaxed for the call (as PyTorch's allocator does for its
// own cudaMallocs under capture). Ring tensors are never freed (recorder.cpp keeps them for the life
// of the process), so no stream ever needs to be recorded on them.
at::Tensor ring_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const c10::DeviceIndex device = options.device().index();
  TORCH_CHECK(device >= 0 && device < 64, "hookstats: ring on an unexpected CUDA device ", options.device());
  const c10::cuda::CUDAGuard guard(options.device());
  c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  static std::mutex mu;
  static cudaStream_t streams[64] = {nullptr};
  cudaStream_t s;
  {
    std::lock_guard<std::mutex> g(mu);
    if (streams[device] == nullptr) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
    s = streams[device];
  }
  const c10::cuda::CUDAStreamGuard on_ring_stream(c10::cuda::getStreamFromExternal(s, device));
  return at::empty(sizes, options);
}

const bool registered = [] {
  monitor::capture_id_fn() = &current_capture_id;
  monitor::ring_empty_fn() = &ring_empty;
  return true;
}();

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("_ring_advance", &ring_advance_cuda);
}

}  // namespace hookstats
