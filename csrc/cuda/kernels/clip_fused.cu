// The fused clip_norm_ kernel (Note [fused clip_norm_]), one cooperative launch, per dtype.
#include <cooperative_groups.h>

#include "clip_device.cuh"

namespace hookstats {
namespace clip_cuda {
namespace {

// Note [fused clip_norm_]
// A flat, 16-byte-aligned tensor that fits in the shared memory of one co-resident grid (one
// block per SM, ~227 KB each on an H100/H200: ~29 MB) is clipped by one cooperative launch
// that reads and writes it once: each block copies its slice of x into shared memory and
// reduces it there (a flag or scaled pass re-reads shared memory, not x); the blocks' partials meet
// at a grid-wide barrier; every block merges them in block order (the same order in every
// block, so all compute the same coefficient, bit for bit); each block scales its slice from
// shared memory into x. Other tensors take the two-launch path (norms_kernel, scale_kernel);
// which tensors take which path, and the fall-back when the driver refuses the cooperative
// launch, are Note [clip_norm_ paths] (core/tensor_list.h).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
fused_clip_kernel(scalar_t* __restrict__ x, int64_t n, int64_t per_block, NormSpec ns, double max_norm, double eps,
                  int policy, NormPartial* __restrict__ partials, double* __restrict__ total_out) {
  extern __shared__ uint4 tile[];
  __shared__ NormPartial smem[kWarps];
  __shared__ double coef_s;
  __shared__ bool zero_s;
  using acc_t = typename AccOf<scalar_t>::type;
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t len = b0 < n ? min(per_block, n - b0) : 0;
  const int64_t full = len / kVec;  // whole 16-byte packs; only the last block can have a tail
  uint4* src = reinterpret_cast<uint4*>(x + b0);
  scalar_t* el = reinterpret_cast<scalar_t*>(tile);
#pragma unroll 4
  for (int64_t k = threadIdx.x; k < full; k += kThreads) tile[k] = src[k];  // several loads in flight
  for (int64_t i = full * kVec + threadIdx.x; i < len; i += kThreads) el[i] = x[b0 + i];
  __syncthreads();
  auto visit_tile = [&](auto&& f) {
    for (int64_t k = threadIdx.x; k < full; k += kThreads) {
      const uint4 r = tile[k];
      const scalar_t* v = reinterpret_cast<const scalar_t*>(&r);
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(v[j]);
    }
    for (int64_t i = full * kVec + threadIdx.x; i < len; i += kThreads) f(el[i]);
  };
  acc_t amax0 = acc_t(0);  // the largest finite |x| of this thread's first pack: the first pass's scale
  if (threadIdx.x < full) {
    const uint4 r = tile[threadIdx.x];
    const scalar_t* v = reinterpret_cast<const scalar_t*>(&r);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const acc_t y = static_cast<acc_t>(v[j]);
      const acc_t a = y < acc_t(0) ? -y : y;
      if (a - a == acc_t(0) && a > amax0) amax0 = a;
    }
  }
  NormPartial p = block_merge(thread_norm<scalar_t>(visit_tile, ns, static_cast<double>(amax0)), ns, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = p;
  cooperative_groups::this_grid().sync();
  if (threadIdx.x < 32) {  // warp 0 of every block: lane l merges partials l, l + 32, ..., then a fixed tree
    NormPartial acc = empty_norm();
    for (unsigned int b = threadIdx.x; b < gridDim.x; b += 32) norm_merge(acc, load_partial(partials + b), ns);
    acc = warp_merge(acc, ns);
    if (threadIdx.x == 0) {
      const double total = norm_finalize(acc, ns);
      coef_s = clip_coef(total, max_norm, eps, policy);
      zero_s = policy == kZero && !(total - total == 0.0);
      if (blockIdx.x == 0) *total_out = total;
    }
  }
  __syncthreads();
  const double coef = coef_s;
  const bool zero = zero_s;
  if (scale_is_identity<acc_t>(coef, zero)) return;  // Note [coefficient one]
  const acc_t c = static_cast<acc_t>(coef);
  for (int64_t k = threadIdx.x; k < full; k += kThreads) {
    uint4 r = tile[k];
    scalar_t* v = reinterpret_cast<scalar_t*>(&r);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = static_cast<scalar_t>(scale_value<acc_t>(static_cast<acc_t>(v[j]), c, zero));
    src[k] = r;
  }
  for (int64_t i = full * kVec + threadIdx.x; i < len; i += kThreads) {
    x[b0 + i] = static_cast<scalar_t>(scale_value<acc_t>(static_cast<acc_t>(el[i]), c, zero));
  }
}


}  // namespace

template <typename scalar_t>
cudaError_t fused_clip_allow_smem(int bytes) {
  return cudaFuncSetAttribute(fused_clip_kernel<scalar_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <typename scalar_t>
cudaError_t fused_clip_occupancy(int* blocks_per_sm, size_t smem) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, fused_clip_kernel<scalar_t>, kThreads, smem);
}

template <typename scalar_t>
cudaError_t launch_fused_clip(scalar_t* x, int64_t n, int64_t per_block, NormSpec ns, double max_norm, double eps,
                              int policy, NormPartial* partials, double* total, int grid, size_t smem,
                              cudaStream_t stream) {
  void* args[] = {&x, &n, &per_block, &ns, &max_norm, &eps, &policy, &partials, &total};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&fused_clip_kernel<scalar_t>), dim3(grid),
                                     dim3(kThreads), args, smem, stream);
}

#define HOOKSTATS_FUSED_CLIP(scalar_t)                                                                            \
  template cudaError_t fused_clip_allow_smem<scalar_t>(int);                                                     \
  template cudaError_t fused_clip_occupancy<scalar_t>(int*, size_t);                                             \
  template cudaError_t launch_fused_clip<scalar_t>(scalar_t*, int64_t, int64_t, NormSpec, double, double, int,   \
                                                   NormPartial*, double*, int, size_t, cudaStream_t);
HOOKSTATS_FUSED_CLIP(float)
HOOKSTATS_FUSED_CLIP(double)
HOOKSTATS_FUSED_CLIP(c10::Half)
HOOKSTATS_FUSED_CLIP(c10::BFloat16)

}  // namespace clip_cuda
}  // namespace hookstats
