// The ATen side of hookstats::stats, stats_into, stats_hist, stats_loc and stats_multi_into on CUDA: outputs, workspaces and
// threshold tables, on the current stream under a device guard, no host sync. The kernels are in
// kernels/stats_kernel.cuh (what they compute: Notes [cuda block histograms], [single-block rows],
// [cuda shift guess], [cuda cold paths], [thresholds in shared memory]), compiled per dtype and variant
// in kernels/stats_*.cu and reached through kernels/stats_launch.h.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../core/bindings.h"
#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/hist_ops.h"
#include "../core/layout.h"
#include "../core/loc_ops.h"
#include "../core/multi_bindings.h"
#include "../core/stats_ops.h"
#include "cuda_util.cuh"
#include "device_tables.cuh"
#include "kernels/stats_launch.h"

namespace hookstats {
namespace {

using namespace stats_cuda;

// The shared memory a block may have on a device (opt-in), less the stats block's static part.
size_t max_dynamic_smem(int device) {
  static int optin[64] = {0};
  const int d = device >= 0 && device < 64 ? device : 0;
  if (optin[d] == 0) {
    int v = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    optin[d] = v > 0 ? v : 48 * 1024;
  }
  return static_cast<size_t>(optin[d]) - kStaticSmemBytes;
}

// The exact bin thresholds of a launch over scalar_t (Note [exact bin thresholds], Note [thresholds in shared
// memory]): by value in thr for float32-accumulated inputs and range histograms of up to kMaxArgThresholds - 1
// bins; else, for float64 inputs (float64 thresholds) and more bins, a device table, cached per stream and range
// and uploaded afresh under capture (Note [capture-safe tables]), returned to be kept until the launch is
// enqueued. thr.n = 0 where no thresholds apply, or where the block's shared memory (smem_before of
// sub-histograms, then the thresholds) would exceed what the device gives a block: the kernel keeps fixed_slot.
// Returns the launch's dynamic shared memory through smem.
template <typename scalar_t>
at::Tensor exact_thresholds(const HistSpec& hs, int64_t hist_len, size_t smem_before, BinThresholds& thr,
                            size_t& smem, const at::Tensor& like, cudaStream_t stream) {
  using F = typename AccOf<scalar_t>::type;
  thr.n = 0;
  thr.table = nullptr;
  smem = smem_before;
  if (hist_len == 0 || hs.mode != kHistRange) return at::Tensor();
  const size_t with_thr = smem_before + (static_cast<size_t>(hs.bins) + 1) * sizeof(F);
  if (with_thr > 48 * 1024 && with_thr > max_dynamic_smem(like.device().index())) return at::Tensor();
  const F* T = cached_thresholds<F>(hs);
  if (T == nullptr) return at::Tensor();
  smem = with_thr;
  if (sizeof(F) == 4 && hs.bins < kMaxArgThresholds) {
    thr.n = hs.bins + 1;
    std::memcpy(thr.T, T, static_cast<size_t>(thr.n) * sizeof(float));
    return at::Tensor();
  }
  struct Key {  // 32 bytes: two table words
    int32_t width, bins;
    double lo, hi;
    int64_t zero;
  } key{static_cast<int32_t>(sizeof(F)), hs.bins, hs.lo, hs.hi, 0};
  static_assert(sizeof(Key) == 2 * sizeof(uint4), "the key is two 16-byte words");
  uint4 kw[2];
  std::memcpy(kw, &key, sizeof kw);
  const size_t bytes = (static_cast<size_t>(hs.bins) + 1) * sizeof(F);
  at::Tensor table = device_table(kw, 2, like.device(), stream, [&](std::vector<uint4>& w) {
    w.assign((bytes + 15) / 16, uint4{0u, 0u, 0u, 0u});
    std::memcpy(w.data(), T, bytes);
  });
  thr.n = hs.bins + 1;
  thr.table = table.data_ptr();
  return table;
}

// The blocks of a stats launch over n values: one per kThreads * kUnroll packs, at most two per SM.
template <typename scalar_t>
int launch_blocks(int64_t n, int device) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * (16 / sizeof(scalar_t)) * kUnroll;
  const int64_t wanted = (n + per_block - 1) / per_block;
  const int64_t cap = 2 * static_cast<int64_t>(sm_count(device));
  return static_cast<int>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

// Note [cuda block histograms]: a sub-histogram per warp when they fit, else one per block
// (<= 8192 + 3 bins or 4098 exponent slots: at most 32 KB).
int hist_copies_of(int64_t hist_len) {
  return hist_len == 0 ? 0 : (hist_len * kWarps * 4 <= kHistSmemBytes ? kWarps : 1);
}

int64_t head_of(const void* x, int64_t n, size_t elem) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
  const int64_t head = static_cast<int64_t>(((16 - addr % 16) % 16) / elem);
  return head < n ? head : n;
}

// Zeroes the histogram row of the ring slot read on the device (Note [ring rows]): what
// cudaMemsetAsync does for a row whose address is known at launch.
__global__ void zero_ring_row_kernel(unsigned long long* __restrict__ hist, int64_t len, StatsOut out) {
  unsigned long long* row = hist + ring_slot(out) * out.ring_hist_elems;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < len;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    row[i] = 0ull;
  }
}

// hist: int64 counts on x's device (nullptr: no histogram); written, or added to with accumulate (Note [single-block rows]).
void run_cuda(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
              bool accumulate) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const bool want_loc = out.loc != nullptr;
  const int64_t n = x.numel();
  if (hist == nullptr) hist_len = 0;
  HOOKSTATS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hookstats_stats_cuda", [&] {
    StatsLaunch a;
    std::memset(&a, 0, sizeof(a));
    a.x = first_element(x);
    a.n = n;
    a.layout = layout_of(x, want_loc);  // Note [element locations]
    a.head = head_of(a.x, n, sizeof(scalar_t));
    a.blocks = launch_blocks<scalar_t>(n, x.device().index());
    // Note [single-block rows]: one block writes its histogram row and results itself.
    a.row_mode = a.blocks > 1 ? kRowAtomic : (accumulate ? kRowAdd : kRowStore);
    if (hist_len > 0 && !accumulate && a.blocks > 1) {
      if (out.ring != nullptr) {
        const int zb = static_cast<int>(hist_len < 4 * 256 ? (hist_len + 255) / 256 : 4);
        zero_ring_row_kernel<<<zb, 256, 0, stream>>>(reinterpret_cast<unsigned long long*>(hist), hist_len, out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      } else {
        C10_CUDA_CHECK(cudaMemsetAsync(hist, 0, hist_len * sizeof(int64_t), stream));
      }
    }
    // Workspace (several blocks only): one partial per block and the ticket, from the caching allocator
    // (stream ordered, no cudaMalloc once warm). With locations, one LocPartial per block follows the partials.
    at::Tensor ws;
    if (a.blocks > 1) {
      const int64_t loc_bytes = want_loc ? static_cast<int64_t>(a.blocks) * sizeof(LocPartial) : 0;
      const int64_t ws_bytes = static_cast<int64_t>(a.blocks) * sizeof(StatsPartial) + loc_bytes + 16;
      ws = at::empty({ws_bytes}, x.options().dtype(at::kByte));
      char* base = static_cast<char*>(ws.data_ptr());
      a.partials = reinterpret_cast<StatsPartial*>(base);
      a.locs = want_loc ? reinterpret_cast<LocPartial*>(base + static_cast<int64_t>(a.blocks) * sizeof(StatsPartial))
                        : nullptr;
      a.ticket = reinterpret_cast<unsigned int*>(base + ws_bytes - 16);
      C10_CUDA_CHECK(cudaMemsetAsync(a.ticket, 0, sizeof(unsigned int), stream));
    }
    a.out = out;
    a.hs = hs;
    a.hist_len = hist_len;
    a.hist_copies = hist_copies_of(hist_len);
    a.hist = reinterpret_cast<unsigned long long*>(hist);
    BinThresholds thr;
    const at::Tensor table = exact_thresholds<scalar_t>(hs, hist_len, hist_smem_bytes(hist_len, a.hist_copies), thr,
                                                        a.smem, x, stream);
    const cudaError_t err = want_loc ? launch_stats<scalar_t, true>(a, thr, stream)
                                     : launch_stats<scalar_t, false>(a, thr, stream);
    C10_CUDA_CHECK(err);
  });
}

void launch_pack(const std::vector<MultiItem>& items, const std::vector<size_t>& idx, size_t from, size_t to,
                 const HistSpec& hs, int64_t hist_len, bool accumulate, int device, cudaStream_t stream) {
  const at::Tensor& like = *items[idx[from]].x;
  HOOKSTATS_DISPATCH_FLOATING_TYPES(like.scalar_type(), "hookstats_stats_multi_cuda", [&] {
    MultiPack pk;
    std::memset(&pk, 0, sizeof(pk));
    pk.out = items[idx[from]].out;
    pk.out.values = nullptr;
    pk.count = static_cast<int32_t>(to - from);
    int64_t blocks = 0;
    for (size_t k = from; k < to; ++k) {
      const MultiItem& it = items[idx[k]];
      PackDesc& d = pk.d[k - from];
      d.x = first_element(*it.x);
      d.n = it.x->numel();
      d.row = it.out.values;
      d.hist = it.hist;
      d.head = static_cast<int32_t>(head_of(d.x, d.n, sizeof(scalar_t)));
      d.first_block = static_cast<int32_t>(blocks);
      d.nblocks = launch_blocks<scalar_t>(d.n, device);
      blocks += d.nblocks;
    }
    MultiLaunch a;
    std::memset(&a, 0, sizeof(a));
    const int64_t ws_bytes = blocks * static_cast<int64_t>(sizeof(StatsPartial)) + kPackTensors * 4;
    at::Tensor ws = at::empty({ws_bytes}, like.options().dtype(at::kByte));
    a.partials = reinterpret_cast<StatsPartial*>(ws.data_ptr());
    a.tickets = reinterpret_cast<unsigned int*>(static_cast<char*>(ws.data_ptr()) + blocks * sizeof(StatsPartial));
    C10_CUDA_CHECK(cudaMemsetAsync(a.tickets, 0, kPackTensors * 4, stream));
    a.hs = hs;
    a.hist_len = hist_len;
    a.hist_copies = hist_copies_of(hist_len);
    a.zero_hist = hist_len > 0 && !accumulate;
    a.blocks = static_cast<unsigned int>(blocks);
    BinThresholds thr;
    const at::Tensor table = exact_thresholds<scalar_t>(hs, hist_len, hist_smem_bytes(hist_len, a.hist_copies), thr,
                                                        a.smem, like, stream);
    C10_CUDA_CHECK(launch_multi<scalar_t>(pk, a, thr, stream));
  });
}

}  // namespace

// hookstats::stats_multi_into's CUDA backend (core/multi_bindings.h): Note [multi-tensor stats launches].
void stats_multi_cuda(const std::vector<MultiItem>& items, const HistSpec& hs, int64_t hist_len, bool accumulate) {
  if (items.empty()) return;
  const c10::Device device = items[0].x->device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  const int64_t hlen = items[0].hist == nullptr ? 0 : hist_len;
  // Each item once: packed (flat, no locations) by dtype, or on its own.
  std::vector<size_t> by_type[4];
  for (size_t i = 0; i < items.size(); ++i) {
    const MultiItem& it = items[i];
    const at::ScalarType st = it.x->scalar_type();
    const int k = st == at::kFloat ? 0 : st == at::kDouble ? 1 : st == at::kHalf ? 2 : 3;
    if (it.out.loc == nullptr && layout_of(*it.x).ndim == 0) by_type[k].push_back(i);
    else run_cuda(*it.x, it.out, hs, it.hist, hlen, accumulate);
  }
  for (int k = 0; k < 4; ++k) {
    const std::vector<size_t>& idx = by_type[k];
    for (size_t from = 0; from < idx.size(); from += kPackTensors) {
      const size_t to = std::min(idx.size(), from + static_cast<size_t>(kPackTensors));
      launch_pack(items, idx, from, to, hs, hlen, accumulate, device.index(), stream);
    }
  }
}

namespace {

void stats_multi_into_cuda(at::TensorList xs, const at::Tensor& out, at::IntArrayRef rows,
                           const std::optional<at::Tensor>& hist, at::IntArrayRef hist_rows, int64_t mode,
                           int64_t bins, double lo, double hi, bool accumulate, const std::optional<at::Tensor>& ring) {
  stats_multi_into_op_impl(xs, out, rows, hist, hist_rows, mode, bins, lo, hi, accumulate, ring, &stats_multi_cuda);
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("stats", &stats_op<run_cuda>);
  m.impl("stats_multi_into", &stats_multi_into_cuda);
  m.impl("stats_into", &stats_into_op<run_cuda>);
  m.impl("stats_hist", &stats_hist_op<run_cuda>);
  m.impl("stats_loc", &stats_loc_op<run_cuda>);
}

}  // namespace hookstats
