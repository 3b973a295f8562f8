// The norms kernel (hookstats::norms, and clip_norm_'s two-launch path): every tensor of a list in one launch,
// per-tensor norms and the total merged by the last block (Note [last-block merge]).
#include "clip_device.cuh"

namespace hookstats {
namespace clip_cuda {
namespace {

__global__ void __launch_bounds__(kThreads)
norms_kernel(ListArgs a, NormSpec ns, NormPartial* __restrict__ partials, unsigned int* __restrict__ ticket,
             double* __restrict__ per, double* __restrict__ total) {
  __shared__ NormPartial smem[kWarps];
  __shared__ bool is_last;
  const Piece piece = locate(a, blockIdx.x);
  NormPartial p = empty_norm();
  switch (piece.d.dtype) {
    case kF64: p = piece_norm<double>(piece, ns); break;
    case kF16: p = piece_norm<c10::Half>(piece, ns); break;
    case kBF16: p = piece_norm<c10::BFloat16>(piece, ns); break;
    default: p = piece_norm<float>(piece, ns); break;
  }
  p = block_merge(p, ns, smem);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = p;
    __threadfence();
    is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Note [last-block merge]
  // The last block merges every tensor's chunk partials, tile by tile of kThreads tensors. A
  // tensor of at most kThreadMerge chunks is merged by its own thread, in chunk order; the
  // larger ones (one big tensor has up to ~4 chunks per SM: 528 on an H200) are listed in tensor
  // order and shared out to the warps (the k-th to warp k % kWarps), whose lane l merges chunks
  // l, l + 32, ... in order before warp_merge's fixed shuffle tree. Each thread's tensors then
  // merge into its total, and block_merge merges the threads. Which thread or warp merges what
  // depends only on the chunk counts, never on timing: results are bitwise reproducible, and no
  // thread merges more than ~kThreadMerge + a few partials serially.
  __shared__ int64_t big[kThreads];
  __shared__ int warp_big[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  NormPartial acc = empty_norm();
  for (int64_t base = 0; base < a.ntensors; base += kThreads) {
    const int64_t t = base + threadIdx.x;
    int64_t c0 = 0, c1 = 0;
    if (t < a.ntensors) {
      c0 = a.single ? 0 : a.chunk_start[t];
      c1 = a.single ? gridDim.x : a.chunk_start[t + 1];
    }
    const bool is_big = c1 - c0 > kThreadMerge;
    if (t < a.ntensors && !is_big) {
      NormPartial q = empty_norm();
      for (int64_t c = c0; c < c1; ++c) norm_merge(q, load_partial(partials + c), ns);
      per[t] = norm_finalize(q, ns);
      norm_merge(acc, q, ns);
    }
    const unsigned int mask = __ballot_sync(0xffffffffu, is_big);
    if (lane == 0) warp_big[warp] = __popc(mask);
    __syncthreads();
    int first = 0, nbig = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) first += warp_big[w];
      nbig += warp_big[w];
    }
    if (is_big) big[first + __popc(mask & ((1u << lane) - 1u))] = t;
    __syncthreads();
    for (int k = warp; k < nbig; k += kWarps) {
      const int64_t tb = big[k];
      const int64_t b0 = a.single ? 0 : a.chunk_start[tb];
      const int64_t b1 = a.single ? gridDim.x : a.chunk_start[tb + 1];
      NormPartial q = empty_norm();
      for (int64_t c = b0 + lane; c < b1; c += 32) norm_merge(q, load_partial(partials + c), ns);
      q = warp_merge(q, ns);
      if (lane == 0) {
        per[tb] = norm_finalize(q, ns);
        norm_merge(acc, q, ns);
      }
    }
    __syncthreads();  // big and warp_big are rewritten by the next tile
  }
  acc = block_merge(acc, ns, smem);
  if (threadIdx.x == 0) {
    *total = norm_finalize(acc, ns);
    *ticket = 0u;
  }
}


}  // namespace

cudaError_t launch_norms(const ListArgs& a, const NormSpec& ns, NormPartial* partials, unsigned int* ticket,
                         double* per, double* total, int64_t nchunks, cudaStream_t stream) {
  norms_kernel<<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(a, ns, partials, ticket, per, total);
  return cudaGetLastError();
}

}  // namespace clip_cuda
}  // namespace hookstats
