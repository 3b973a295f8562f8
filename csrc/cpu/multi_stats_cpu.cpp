// CPU implementation of hookstats::stats_multi_into (csrc/core/multi_bindings.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "../core/multi_bindings.h"

namespace hookstats {

void stats_cpu_runner(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
                      bool accumulate);  // cpu/stats_cpu.cpp

namespace {

// Tensors this small are reduced by one thread (stats_cpu.cpp would run them as one task anyway);
// larger ones run one after another, each over all threads.
constexpr int64_t kSmall = 32768;

void stats_multi_into_cpu(at::TensorList xs, const at::Tensor& out, at::IntArrayRef rows,
                          const std::optional<at::Tensor>& hist, at::IntArrayRef hist_rows, int64_t mode, int64_t bins,
                          double lo, double hi, bool accumulate, const std::optional<at::Tensor>& ring) {
  stats_multi_into_op_impl(
      xs, out, rows, hist, hist_rows, mode, bins, lo, hi, accumulate, ring,
      [](const std::vector<MultiItem>& items, const HistSpec& spec, int64_t hlen, bool acc) {
        const int64_t n = static_cast<int64_t>(items.size());
        auto body = [&](int64_t i) {
          const MultiItem& it = items[i];
          stats_cpu_runner(*it.x, it.out, spec, it.hist, hlen, acc);
        };
        std::vector<int64_t> small;
        small.reserve(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          if (items[i].x->numel() < kSmall) small.push_back(i);
          else body(i);
        }
        int64_t elems = 0;
        for (int64_t i : small) elems += items[i].x->numel();
        const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(small.size()) * kSmall / std::max<int64_t>(elems, 1));
        at::parallel_for(0, static_cast<int64_t>(small.size()), grain, [&](int64_t b, int64_t e) {
          for (int64_t j = b; j < e; ++j) body(small[j]);
        });
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CPU, m) {
  m.impl("stats_multi_into", &stats_multi_into_cpu);
}

}  // namespace hookstats
