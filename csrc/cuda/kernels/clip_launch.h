// The torch-free interface between the norm and clipping ops' ATen side (cuda/clip_cuda.cu: checks, the
// tensor-list tables, the fused path's plan) and their kernels, compiled in their own translation units
// (kernels/clip_norms.cu, clip_scale.cu, clip_fused.cu) so that the build runs them side by side. Note [cuda
// tensor lists] in cuda/clip_cuda.cu says how a list is cut into chunks.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../../core/layout.h"
#include "../../core/norm_ops.h"
#include "../../core/tensor_desc.h"

namespace hookstats {
namespace clip_cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMinChunk = 65536;
constexpr int64_t kMaxChunk = int64_t(kThreads) * kMaxFastPiece;  // a thread's share stays a fast piece
constexpr int64_t kThreadMerge = 16;  // Note [last-block merge]

template <typename scalar_t> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

struct ListArgs {
  const TensorDesc* descs;       // device memory, unless single
  const StridedLayout* layouts;  // device memory
  const int64_t* chunk_start;    // device memory: n + 1 entries, tensor t's first chunk
  int64_t ntensors;
  int64_t chunk_len;
  bool single;  // one flat tensor, described by `one`: no device metadata
  TensorDesc one;
};

// The bounds of clamp_count_ rounded to each dtype (by the host, as torch.clamp rounds them),
// indexed by DtypeCode.
struct Bounds {
  double lo[4], hi[4];
};

// One block per chunk (nchunks of them), on stream; each returns the launch's error.
cudaError_t launch_norms(const ListArgs& a, const NormSpec& ns, NormPartial* partials, unsigned int* ticket,
                         double* per, double* total, int64_t nchunks, cudaStream_t stream);
cudaError_t launch_scale(const ListArgs& a, const double* total, double max_norm, double eps, int policy,
                         int64_t nchunks, cudaStream_t stream);
cudaError_t launch_clamp(const ListArgs& a, const Bounds& b, unsigned long long* count, int64_t nchunks,
                         cudaStream_t stream);

// The fused path (Note [fused clip_norm_]) for scalar_t in float, double, c10::Half, c10::BFloat16: allowing
// `bytes` of dynamic shared memory, the blocks of kThreads that fit an SM with smem bytes each, and the
// cooperative launch (whose error says whether the driver accepted it).
template <typename scalar_t>
cudaError_t fused_clip_allow_smem(int bytes);
template <typename scalar_t>
cudaError_t fused_clip_occupancy(int* blocks_per_sm, size_t smem);
template <typename scalar_t>
cudaError_t launch_fused_clip(scalar_t* x, int64_t n, int64_t per_block, NormSpec ns, double max_norm, double eps,
                              int policy, NormPartial* partials, double* total, int grid, size_t smem,
                              cudaStream_t stream);

}  // namespace clip_cuda
}  // namespace hookstats
