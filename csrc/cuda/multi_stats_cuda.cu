// CUDA implementation of hookstats::stats_multi_into (csrc/core/multi_bindings.h): one call from
// Python, the tensors' stats kernels launched one after another on the current stream from C++
// (no Python per tensor, no host sync).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../core/multi_bindings.h"

namespace hookstats {

void stats_cuda_runner(const at::Tensor& x, const StatsOut& out, const HistSpec& hs, int64_t* hist, int64_t hist_len,
                       bool accumulate);  // cuda/stats_cuda.cu

namespace {

void stats_multi_into_cuda(at::TensorList xs, const at::Tensor& out, at::IntArrayRef rows,
                           const std::optional<at::Tensor>& hist, at::IntArrayRef hist_rows, int64_t mode,
                           int64_t bins, double lo, double hi, bool accumulate) {
  stats_multi_into_op_impl<stats_cuda_runner>(xs, out, rows, hist, hist_rows, mode, bins, lo, hi, accumulate,
                                              [](int64_t n, const auto& body) {
                                                for (int64_t i = 0; i < n; ++i) body(i);
                                              });
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("stats_multi_into", &stats_multi_into_cuda);
}

}  // namespace hookstats
