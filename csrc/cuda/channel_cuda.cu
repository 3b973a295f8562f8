// CUDA implementation of hookstats::channel_stats and hookstats::channel_stats_into
// (Note [channel stats], Note [channel layouts]).
//
// Three launches on the current stream, no host sync, no float atomics (deterministic):
//   rows order (channels innermost): blocks of 32 channels x 8 row lanes; a warp reads 32
//     consecutive channels of one row (coalesced), each thread strides over rows;
//   runs order (channel outer): one block per (channel, row group); threads stride over the
//     channel's elements;
// each thread accumulates in double (channel_add: exact for every input, no careful path needed),
// the block merges its threads in a fixed order into one partial per (group, channel) in a workspace
// (from the caching allocator), and a last kernel merges the groups in order and writes the output
// (or combines it into the buffer).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../core/channel_bindings.h"
#include "../core/channel_ops.h"
#include "../core/dispatch.h"
#include "../core/layout.h"
#include "cuda_util.cuh"

namespace hookstats {
namespace {

constexpr int kRowsX = 32;    // channels per rows-order block
constexpr int kRowsY = 8;     // row lanes per rows-order block
constexpr int kRunThreads = 256;

struct Geometry {
  const void* data;
  int64_t channels, cstride, rows;
  StridedLayout rest;
  int64_t rows_per_group;
};

template <typename scalar_t>
__device__ __forceinline__ double load_value(const scalar_t* p) {
  return static_cast<double>(static_cast<float>(*p));
}
template <>
__device__ __forceinline__ double load_value<double>(const double* p) {
  return *p;
}

template <typename scalar_t>
__global__ void channel_rows_kernel(Geometry g, ChannelPartial* partials) {
  __shared__ ChannelPartial sh[kRowsY][kRowsX];
  const scalar_t* x = static_cast<const scalar_t*>(g.data);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kRowsX + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * g.rows_per_group;
  const int64_t r1 = r0 + g.rows_per_group < g.rows ? r0 + g.rows_per_group : g.rows;
  ChannelPartial p = channel_empty();
  if (c < g.channels) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowsY) {
      channel_add(p, load_value(x + element_offset(g.rest, r) + c * g.cstride));
    }
  }
  sh[threadIdx.y][threadIdx.x] = p;
  __syncthreads();
  if (threadIdx.y == 0 && c < g.channels) {
    ChannelPartial q = sh[0][threadIdx.x];
    for (int y = 1; y < kRowsY; ++y) channel_merge(q, sh[y][threadIdx.x]);
    q.count = r1 > r0 ? r1 - r0 : 0;
    partials[static_cast<int64_t>(blockIdx.y) * g.channels + c] = q;
  }
}

template <typename scalar_t>
__global__ void channel_runs_kernel(Geometry g, ChannelPartial* partials) {
  __shared__ ChannelPartial sh[kRunThreads];
  const scalar_t* x = static_cast<const scalar_t*>(g.data) + static_cast<int64_t>(blockIdx.x) * g.cstride;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * g.rows_per_group;
  const int64_t r1 = r0 + g.rows_per_group < g.rows ? r0 + g.rows_per_group : g.rows;
  ChannelPartial p = channel_empty();
  if (g.rest.ndim == 0) {
    for (int64_t r = r0 + threadIdx.x; r < r1; r += kRunThreads) channel_add(p, load_value(x + r));
  } else {
    for (int64_t r = r0 + threadIdx.x; r < r1; r += kRunThreads) {
      channel_add(p, load_value(x + element_offset(g.rest, r)));
    }
  }
  sh[threadIdx.x] = p;
  __syncthreads();
  for (int s = kRunThreads / 2; s > 0; s >>= 1) {  // fixed tree: deterministic
    if (threadIdx.x < s) channel_merge(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    ChannelPartial q = sh[0];
    q.count = r1 > r0 ? r1 - r0 : 0;
    partials[static_cast<int64_t>(blockIdx.y) * g.channels + blockIdx.x] = q;
  }
}

__global__ void channel_finish_kernel(const ChannelPartial* partials, int64_t groups, ChannelOut out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= out.channels) return;
  ChannelPartial p = channel_empty();
  for (int64_t gi = 0; gi < groups; ++gi) channel_merge(p, partials[gi * out.channels + c]);
  channel_store(p, out, c);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void channel_run_cuda(const at::Tensor& x, const ChannelView& v, const ChannelOut& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const int64_t C = v.channels, M = v.rows;
  const int64_t want_blocks = 4 * static_cast<int64_t>(sm_count(x.device().index()));
  Geometry g{v.data, C, v.cstride, M, v.rest, 0};
  int64_t groups = 0;
  at::Tensor ws;
  ChannelPartial* partials = nullptr;
  if (M > 0) {
    if (v.rows_order) {
      const int64_t bx = ceil_div(C, kRowsX);
      groups = std::min<int64_t>({65535, std::max<int64_t>(1, ceil_div(want_blocks, bx)), ceil_div(M, 4 * kRowsY)});
    } else {
      groups = std::min<int64_t>({65535, std::max<int64_t>(1, ceil_div(want_blocks, C)), ceil_div(M, 8 * kRunThreads)});
    }
    groups = std::max<int64_t>(1, groups);
    g.rows_per_group = ceil_div(M, groups);
    groups = ceil_div(M, g.rows_per_group);
    ws = at::empty({static_cast<int64_t>(groups * C * sizeof(ChannelPartial))}, x.options().dtype(at::kByte));
    partials = reinterpret_cast<ChannelPartial*>(ws.data_ptr());
    HOOKSTATS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hookstats_channel_stats_cuda", [&] {
      if (v.rows_order) {
        const dim3 grid(static_cast<unsigned>(ceil_div(C, kRowsX)), static_cast<unsigned>(groups));
        channel_rows_kernel<scalar_t><<<grid, dim3(kRowsX, kRowsY), 0, stream>>>(g, partials);
      } else {
        TORCH_CHECK_VALUE(C <= 2147483647LL, "hookstats.channel_stats: more than 2^31 - 1 channels");
        const dim3 grid(static_cast<unsigned>(C), static_cast<unsigned>(groups));
        channel_runs_kernel<scalar_t><<<grid, kRunThreads, 0, stream>>>(g, partials);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  const int threads = 256;
  channel_finish_kernel<<<static_cast<unsigned>(ceil_div(C, threads)), threads, 0, stream>>>(partials, groups, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("channel_stats", &channel_stats_op<channel_run_cuda>);
  m.impl("channel_stats_into", &channel_stats_into_op<channel_run_cuda>);
}

}  // namespace hookstats
