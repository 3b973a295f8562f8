// The CUDA side of hookstats.detect_nonfinite: one launch per checked output, on the current stream,
// no sync, no allocation (so it can be captured into a CUDA graph): each block counts its share's
// NaN/Inf and finds its smallest logical index with the math of nonfinite_ops.h; a block that saw one
// claims the device's record (Note [nonfinite guard state]) and adds its counts; the block that claimed
// it also scans the op's dense inputs. A check whose device already has its first hit returns at once.
// The functions are handed to observer.cpp through device_fns.h when the extension loads.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "device_fns.h"
#include "nonfinite_ops.h"

namespace hookstats {
namespace anomaly {
namespace {

constexpr int kThreads = 256;

__device__ __noinline__ int64_t logical_index(const CheckLaunch* c, int64_t off) {
  return logical_from_offset(off, c->ndim, c->sizes, c->strides);
}

template <typename U>
__global__ void __launch_bounds__(kThreads) check_kernel(const __grid_constant__ CheckLaunch c) {
  // __grid_constant__: the helpers take the parameter's address without a per-thread copy of its ~1.3 KB.
  unsigned long long* s = reinterpret_cast<unsigned long long*>(c.state);
  __shared__ int done;
  if (threadIdx.x == 0) done = *reinterpret_cast<volatile unsigned long long*>(&s[kFound]) != 0ull;
  __syncthreads();
  if (done) return;  // the device has its first hit (read once, so the whole block leaves together)
  const U exp = static_cast<U>(c.masks.exp), man = static_cast<U>(c.masks.man);
  const U* x = static_cast<const U*>(c.data);
  NfAcc a;
  nf_init(a);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.numel; i += stride) {
    if (c.mode == kStrided) {
      nf_add(a, x[strided_offset(&c.lay, i)], exp, man, i);
    } else {
      const U b = x[i];
      if (bits_nonfinite(b, exp)) nf_add(a, b, exp, man, c.mode == kFlat ? i : logical_index(&c, i));
    }
  }
  // Block reduction: counts add, indices take the minimum (any order gives the same result).
  for (int o = 16; o > 0; o >>= 1) {
    NfAcc b;
    b.nan = __shfl_down_sync(0xffffffffu, a.nan, o);
    b.inf = __shfl_down_sync(0xffffffffu, a.inf, o);
    b.first = __shfl_down_sync(0xffffffffu, a.first, o);
    nf_merge(a, b);
  }
  __shared__ NfAcc warps[kThreads / 32];
  __shared__ int claimed;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = a;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) nf_merge(a, warps[w]);
    claimed = 0;
    if (nf_hit(a)) {
      const unsigned long long order = static_cast<unsigned long long>(c.meta.order);
      const unsigned long long old = atomicCAS(&s[kFound], 0ull, order);
      if (old == 0ull) {
        write_meta(c.state, c.meta);
        c.state[kInputs] = c.n_inputs;
        claimed = 1;
      }
      if (old == 0ull || old == order) {
        atomicAdd(&s[kNan], static_cast<unsigned long long>(a.nan));
        atomicAdd(&s[kInf], static_cast<unsigned long long>(a.inf));
        atomicMin(reinterpret_cast<long long*>(&c.state[kFirst]), static_cast<long long>(a.first));
      }
    }
  }
  __syncthreads();
  if (!claimed) return;
  // The claiming block says which of the op's inputs held a NaN/Inf (once per run: one block is enough).
  for (int k = 0; k < c.n_inputs; ++k) {
    int bad = 0;
    for (int64_t i = threadIdx.x; i < c.in_numel[k]; i += blockDim.x) {
      bad |= input_nonfinite(c.in_data[k], c.in_masks[k], i);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(&s[kBadInputs], 1ull << k);
  }
}

__global__ void step_kernel(int64_t* state) { state[kStep] += 1; }

int grid_for(int64_t numel, int device) {
  static int sms[64] = {0};
  const int d = device >= 0 && device < 64 ? device : 0;
  if (sms[d] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    sms[d] = n > 0 ? n : 1;
  }
  const int64_t want = (numel + kThreads * 8 - 1) / (kThreads * 8);  // ~8 elements a thread
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(sms[d]) * 4)));
}

void launch_check(const CheckLaunch& c, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const int grid = grid_for(c.numel, device);
  switch (c.masks.bytes) {
    case 8: check_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(c); break;
    case 4: check_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(c); break;
    default: check_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(c); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_step(int64_t* state, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  step_kernel<<<1, 1, 0, stream>>>(state);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool capturing(int device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

const bool registered = [] {
  CudaFns& f = cuda_fns();
  f.check = &launch_check;
  f.step = &launch_step;
  f.capturing = &capturing;
  return true;
}();

}  // namespace
}  // namespace anomaly
}  // namespace hookstats
