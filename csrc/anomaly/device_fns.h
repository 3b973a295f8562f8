// What the guard's observer (observer.cpp) needs from CUDA, without CUDA headers: check_cuda.cu sets
// these when the extension loads; a build without CUDA kernels leaves them null, and a CUDA output is
// then counted as unchecked (guard.unchecked()).
#pragma once

#include <cstdint>

#include "nonfinite_ops.h"

namespace hookstats {
namespace anomaly {

struct CudaFns {
  // Launches the check of one output on the current stream of c.meta's device (no sync).
  void (*check)(const CheckLaunch& c, int device) = nullptr;
  // state[kStep] += 1 on the current stream of `device` (one thread; captured like any kernel).
  void (*step)(int64_t* state, int device) = nullptr;
  // Whether the current stream of `device` is being captured into a CUDA graph.
  bool (*capturing)(int device) = nullptr;
};

inline CudaFns& cuda_fns() {
  static CudaFns fns;
  return fns;
}

// CPU: scans the output of c in place, and commits a hit into c.state under `mu` (Note [nonfinite guard
// state]); check_cpu.cpp.
void check_cpu(const CheckLaunch& c);

}  // namespace anomaly
}  // namespace hookstats
