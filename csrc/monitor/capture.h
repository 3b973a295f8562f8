// What the recorder needs from CUDA for a Monitor's captured steps (Note [monitor graph replays] in
// recorder.h), without CUDA headers: cuda/ring_cuda.cu sets these when the extension loads; a build
// without CUDA kernels leaves them null (nothing is ever captured). CPU tests pretend a capture
// through the recorder's _set_test_capture instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hookstats {
namespace monitor {

// The id of the capture the current stream of a device is in, 0 when it is not capturing.
using CaptureIdFn = uint64_t (*)(int8_t device_index);

inline CaptureIdFn& capture_id_fn() {
  static CaptureIdFn fn = nullptr;
  return fn;
}

// An uninitialised CUDA tensor from memory no graph capture owns or reuses (Note [ring memory] in
// cuda/ring_cuda.cu), callable during a capture.
using RingEmptyFn = at::Tensor (*)(at::IntArrayRef sizes, const at::TensorOptions& options);

inline RingEmptyFn& ring_empty_fn() {
  static RingEmptyFn fn = nullptr;
  return fn;
}

}  // namespace monitor
}  // namespace hookstats
