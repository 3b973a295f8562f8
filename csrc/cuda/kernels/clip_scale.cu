// The scaling and clamping kernels (hookstats::scale_by_norm_, clamp_count_).
#include "clip_device.cuh"

namespace hookstats {
namespace clip_cuda {
namespace {

template <typename scalar_t>
__device__ __forceinline__ void scale_piece(const Piece& p, double coef, bool zero) {
  using acc_t = typename AccOf<scalar_t>::type;
  if (scale_is_identity<acc_t>(coef, zero)) return;  // Note [coefficient one]
  const acc_t c = static_cast<acc_t>(coef);
  update<scalar_t>(p, [&](scalar_t& v) {
    v = static_cast<scalar_t>(scale_value<acc_t>(static_cast<acc_t>(v), c, zero));
    return true;
  });
}

__global__ void __launch_bounds__(kThreads)
scale_kernel(ListArgs a, const double* __restrict__ total, double max_norm, double eps, int policy) {
  const double norm = *total;
  const double coef = clip_coef(norm, max_norm, eps, policy);
  if (coef_is_identity(coef)) return;
  const bool zero = policy == kZero && !(norm - norm == 0.0);
  const Piece piece = locate(a, blockIdx.x);
  switch (piece.d.dtype) {
    case kF64: scale_piece<double>(piece, coef, zero); break;
    case kF16: scale_piece<c10::Half>(piece, coef, zero); break;
    case kBF16: scale_piece<c10::BFloat16>(piece, coef, zero); break;
    default: scale_piece<float>(piece, coef, zero); break;
  }
}



template <typename scalar_t>
__device__ __forceinline__ unsigned long long clamp_piece(const Piece& p, const Bounds& b) {
  using acc_t = typename AccOf<scalar_t>::type;
  const int code = p.d.dtype;
  const acc_t lo = static_cast<acc_t>(b.lo[code]), hi = static_cast<acc_t>(b.hi[code]);
  const scalar_t lo_t = static_cast<scalar_t>(lo), hi_t = static_cast<scalar_t>(hi);
  unsigned long long n = 0;
  update<scalar_t>(p, [&](scalar_t& v) {
    const acc_t x = static_cast<acc_t>(v);
    if (!is_clipped(x, lo, hi)) return false;
    v = x < lo ? lo_t : hi_t;
    ++n;
    return true;
  });
  return n;
}

__global__ void __launch_bounds__(kThreads)
clamp_kernel(ListArgs a, const __grid_constant__ Bounds b, unsigned long long* __restrict__ count) {
  __shared__ unsigned long long smem[kWarps];
  const Piece piece = locate(a, blockIdx.x);
  unsigned long long n = 0;
  switch (piece.d.dtype) {
    case kF64: n = clamp_piece<double>(piece, b); break;
    case kF16: n = clamp_piece<c10::Half>(piece, b); break;
    case kBF16: n = clamp_piece<c10::BFloat16>(piece, b); break;
    default: n = clamp_piece<float>(piece, b); break;
  }
  for (int offset = 16; offset > 0; offset >>= 1) n += __shfl_down_sync(0xffffffffu, n, offset);
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long s = 0;
    for (int w = 0; w < kWarps; ++w) s += smem[w];
    if (s != 0) atomicAdd(count, s);  // integer atomics: exact, order-free
  }
}


}  // namespace

cudaError_t launch_scale(const ListArgs& a, const double* total, double max_norm, double eps, int policy,
                         int64_t nchunks, cudaStream_t stream) {
  scale_kernel<<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(a, total, max_norm, eps, policy);
  return cudaGetLastError();
}

cudaError_t launch_clamp(const ListArgs& a, const Bounds& b, unsigned long long* count, int64_t nchunks,
                         cudaStream_t stream) {
  clamp_kernel<<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(a, b, count);
  return cudaGetLastError();
}

}  // namespace clip_cuda
}  // namespace hookstats
