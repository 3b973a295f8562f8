// The torch-free interface between the stats ops' ATen side (cuda/stats_cuda.cu: checks, workspaces,
// threshold tables) and their kernels (kernels/stats_kernel.cuh), which are compiled in one translation
// unit per dtype and variant (kernels/stats_*.cu) so that the build runs them side by side
// (docs/development.md has the per-file times). Plain structs, raw pointers, cudaError_t results.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../../core/hist_ops.h"
#include "../../core/layout.h"
#include "../../core/loc_ops.h"
#include "../../core/stats_ops.h"

namespace hookstats {
namespace stats_cuda {

constexpr int kThreads = 256;  // two blocks fit an SM
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;
constexpr int kPackTensors = 24;  // MultiPack ~1.2 KB + BinThresholds ~2 KB of arguments

// Note [cuda block histograms]
// Each block counts into shared-memory sub-histograms, one per warp when they fit in
// kHistSmemBytes (so warps never contend for an address), else one for the block. Before its
// shared atomic, a warp's lanes that hold the same slot are combined (__match_any_sync): the
// lowest of them adds the group's size. Data concentrated in one bin (ReLU zeros, dead units,
// saturated values) then costs one atomic per warp and value position instead of 32 serialized
// ones on one address. Integer counts: exact, order-free. With several blocks, each adds its
// sub-histograms into the int64 output row with one global atomic per nonzero slot; a single block
// stores its row (Note [single-block rows]).
constexpr int64_t kHistSmemBytes = 32 * 1024;

// Note [single-block rows]
// How a launch's blocks put their counts into the histogram row. With several blocks, each adds its nonzero
// counts with global atomics into a row the host zeroed first (unless accumulating): kRowAtomic. A launch of one
// block (every tensor of up to kThreads * kVec * kUnroll values: a Monitor's small activations) owns its row, so it
// writes every slot with a plain store (kRowStore), or adds to it (kRowAdd, accumulate): no zeroing launch, and it
// needs no workspace and no ticket either (it writes its results itself), so such a stats_into is one launch and
// no allocation, where it was a memset, an allocation, a second memset and the launch.
enum RowMode : int { kRowAtomic = 0, kRowStore = 1, kRowAdd = 2 };

template <typename scalar_t> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

// Note [thresholds in shared memory]
// The exact thresholds of a range histogram (Note [exact bin thresholds]) that a launch counts by
// ordinal: each block copies them into shared memory behind its sub-histograms before it reads, so
// that the per-value gather of threshold_ordinal is a shared load (LDS), not a generic one. They come
// by value in the kernel's arguments (T, n <= kMaxArgThresholds: float32-accumulated inputs and up to
// 512 bins; a captured graph replays them with the launch) or from a device table (table: float64
// thresholds of float64 inputs, or more bins; Note [capture-safe tables]). n = 0: no thresholds (no
// range histogram, a range the float transform cannot serve, or more shared memory than the device
// gives a block), and the kernel keeps fixed_slot, which is exact too.
struct BinThresholds {
  float T[kMaxArgThresholds];
  int32_t n;          // thresholds to stage (acc_t values), 0 for none
  const void* table;  // nullptr: they are T[0, n)
};

// What one stats launch reads and where it writes (Note [stats partials], [single-block rows]).
struct StatsLaunch {
  const void* x;
  int64_t n;
  int64_t head;  // scalar elements before the first 16-byte aligned one (flat layout)
  StridedLayout layout;  // ndim 0: flat
  StatsPartial* partials;  // one per block (several blocks only)
  LocPartial* locs;        // one per block (locations and several blocks only)
  unsigned int* ticket;
  StatsOut out;
  HistSpec hs;
  int64_t hist_len;
  int hist_copies;
  int row_mode;
  unsigned long long* hist;
  int blocks;
  size_t smem;
};

// Note [multi-tensor stats launches]
// stats_multi_into on CUDA: the flat tensors of one dtype go up to kPackTensors at a time into one
// launch whose arguments carry each tensor's pointer, length, rows and block range (MultiPack,
// ~1.2 KB, with the 2 KB of exact bin thresholds under the 4 KB kernel-argument limit of every CUDA version; float64
// inputs and more than 512 bins read a device table instead, Note [capture-safe tables]). Each tensor gets the blocks a stats_into launch would
// give it (launch_blocks), and its blocks run what that launch runs: the same grid-stride shares,
// the same block merges, and the last of its blocks to finish (a ticket per tensor) merges its
// block partials in block order. Every row therefore equals stats_into's, bit for bit. A block
// finds its tensor by binary search over the first blocks. Histogram rows are zeroed by one small
// launch per pack first (unless accumulating). Tensors that are not flat (rare for gradients) run
// one stats_into launch each. The parameter gradients of a model: two or three launches per 24.
struct PackDesc {
  const void* x;
  int64_t n;
  void* row;      // the stats row (before any ring offset)
  int64_t* hist;  // the histogram row (before any ring offset), or nullptr
  int32_t first_block, nblocks;
  int32_t head;   // scalar elements before the first 16-byte aligned one
  int32_t pad;
};

struct MultiPack {
  PackDesc d[kPackTensors];
  StatsOut out;  // out_double and the ring; values is each tensor's row
  int32_t count;
};

struct MultiLaunch {
  HistSpec hs;
  int64_t hist_len;
  int hist_copies;
  bool zero_hist;  // zero each tensor's histogram row first (not accumulating)
  StatsPartial* partials;
  unsigned int* tickets;
  unsigned int blocks;
  size_t smem;
};

// The launches, each instantiated in its own translation unit (kernels/stats_*.cu) for scalar_t in
// float, double, c10::Half, c10::BFloat16; LOC: with element locations (Note [element locations]).
template <typename scalar_t, bool LOC>
cudaError_t launch_stats(const StatsLaunch& a, const BinThresholds& thr, cudaStream_t stream);
template <typename scalar_t>
cudaError_t launch_multi(const MultiPack& pk, const MultiLaunch& a, const BinThresholds& thr, cudaStream_t stream);
// Zeroes the histogram row of the ring slot read on the device (Note [ring rows]).
cudaError_t launch_zero_ring_row(unsigned long long* hist, int64_t len, const StatsOut& out, cudaStream_t stream);

// The static shared memory of a stats block (its merges), which the dynamic part must leave room for.
constexpr size_t kStaticSmemBytes = kWarps * sizeof(StatsPartial) + 16;

// The dynamic shared memory of a launch: the sub-histograms, then (16-byte aligned) the staged thresholds.
HS_HD size_t hist_smem_bytes(int64_t hist_len, int copies) {
  return (static_cast<size_t>(hist_len) * static_cast<size_t>(copies) * sizeof(uint32_t) + 15) / 16 * 16;
}

}  // namespace stats_cuda
}  // namespace hookstats
