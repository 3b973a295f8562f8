// Small helpers shared by the CUDA kernels.
#pragma once

#include <c10/cuda/CUDAException.h>

namespace hookstats {

// Multiprocessors of a device, queried once per device.
inline int sm_count(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) device = 0;
  if (counts[device] == 0) {
    int c = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device));
    counts[device] = c > 0 ? c : 1;
  }
  return counts[device];
}

}  // namespace hookstats
