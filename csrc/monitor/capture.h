// How the recorder asks whether a CUDA stream is being captured into a graph (Note [monitor graph
// replays] in recorder.h) without CUDA headers: cuda/ring_cuda.cu sets the query when the
// extension loads; a build without CUDA kernels leaves it null (nothing is ever captured). CPU
// tests pretend a capture through the recorder's _set_test_capture instead.
#pragma once

#include <cstdint>

namespace hookstats {
namespace monitor {

using CaptureIdFn = uint64_t (*)(int8_t device_index);

inline CaptureIdFn& capture_id_fn() {
  static CaptureIdFn fn = nullptr;
  return fn;
}

}  // namespace monitor
}  // namespace hookstats
