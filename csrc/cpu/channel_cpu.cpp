// CPU implementation of hookstats::channel_stats and hookstats::channel_stats_into
// (Note [channel stats], Note [channel layouts]): the split into tasks, the level's task entry points
// (cpu/channel_chunk.h, one table per ISA, chosen by simd::isa() as the statistics kernel's: Note [cpu dispatch])
// and the fixed-order merge of the tasks' partials.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../core/channel_bindings.h"
#include "../core/channel_ops.h"
#include "../core/dispatch.h"
#include "channel_chunk.h"

namespace hookstats {
namespace {

using namespace channel_cpu;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The number of tasks to aim for: one per kMinTaskElems values, at most kMaxTasks.
inline int64_t target_tasks(int64_t numel) {
  return std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, numel / kMinTaskElems));
}

template <typename scalar_t>
void channel_cpu_typed(const ChannelView& v, const ChannelOut& out) {
  const int64_t C = v.channels, M = v.rows;
  const simd::Isa isa = simd::isa();
  const ChannelFns<scalar_t> fns = table_entry<scalar_t>(
      isa == simd::kIsaAvx512 ? kChannelAvx512 : (isa == simd::kIsaAvx2 ? kChannelAvx2 : kChannelDefault));
  // Partials of every (group, channel), cached per calling thread: no allocation (or page faults) once warm.
  static thread_local std::vector<ChannelPartial> partials;
  int64_t groups = 1;
  if (M == 0) {
    partials.assign(static_cast<size_t>(C), channel_empty());
  } else if (v.rows_order) {
    const int64_t tile_w = v.cstride == 1 ? kChanTile<acc_of<scalar_t>> : kGatherTile;
    const int64_t tiles = ceil_div(C, tile_w);
    groups = std::max<int64_t>(1, std::min(ceil_div(target_tasks(C * M), tiles), ceil_div(M, kRowBlock)));
    const int64_t rows_per = ceil_div(ceil_div(M, groups), kRowBlock) * kRowBlock;
    groups = ceil_div(M, rows_per);
    partials.resize(static_cast<size_t>(groups * C));
    // The lambda runs on workers: it reaches the cache through a copied pointer, never through the thread_local's
    // name (which names each worker's own, empty, vector; GCC re-reads even a const local initialised from it).
    ChannelPartial* pp = partials.data();
    const auto fn = fns.rows;
    at::parallel_for(0, tiles * groups, 1, [&, pp](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        const int64_t g = k / tiles, tile = k % tiles;  // row-group major: a thread's tiles share rows (L2)
        const int64_t c0 = tile * tile_w;
        const RowsTask t{c0, std::min(tile_w, C - c0), g * rows_per, std::min(M, (g + 1) * rows_per)};
        fn(v, t, pp + g * C + c0);
      }
    });
  } else {
    groups = std::max<int64_t>(1, std::min(ceil_div(target_tasks(C * M), C), ceil_div(M, kGather)));
    const int64_t rows_per = ceil_div(M, groups);
    groups = ceil_div(M, rows_per);
    partials.resize(static_cast<size_t>(groups * C));
    ChannelPartial* pp = partials.data();
    const auto fn = fns.runs;
    const int64_t grain = std::max<int64_t>(1, kMinTaskElems / std::max<int64_t>(1, rows_per));
    at::parallel_for(0, C * groups, grain, [&, pp](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        const int64_t c = k / groups, g = k % groups;
        const RunsTask t{c, g * rows_per, std::min(M, (g + 1) * rows_per)};
        fn(v, t, pp + g * C + c);
      }
    });
  }
  for (int64_t c = 0; c < C; ++c) {
    ChannelPartial p = partials[static_cast<size_t>(c)];
    for (int64_t g = 1; g < groups; ++g) channel_merge(p, partials[static_cast<size_t>(g * C + c)]);
    channel_store(p, out, c);
  }
}

void channel_run_cpu(const at::Tensor& x, const ChannelView& v, const ChannelOut& out) {
  HOOKSTATS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hookstats_channel_stats_cpu", [&] {
    channel_cpu_typed<scalar_t>(v, out);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CPU, m) {
  m.impl("channel_stats", &channel_stats_op<channel_run_cpu>);
  m.impl("channel_stats_into", &channel_stats_into_op<channel_run_cpu>);
}

}  // namespace hookstats
