// CUDA implementation of hookstats::stats_multi_into (csrc/core/multi_bindings.h): one call from
// Python, the flat tensors of a dtype in one launch per 24 (Note [multi-tensor stats launches] in
// cuda/stats_cuda.cu), on the current stream, no host sync.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../core/multi_bindings.h"

namespace hookstats {

void stats_multi_cuda(const std::vector<MultiItem>& items, const HistSpec& hs, int64_t hist_len,
                      bool accumulate);  // cuda/stats_cuda.cu, Note [multi-tensor stats launches]

namespace {

void stats_multi_into_cuda(at::TensorList xs, const at::Tensor& out, at::IntArrayRef rows,
                           const std::optional<at::Tensor>& hist, at::IntArrayRef hist_rows, int64_t mode,
                           int64_t bins, double lo, double hi, bool accumulate, const std::optional<at::Tensor>& ring) {
  stats_multi_into_op_impl(xs, out, rows, hist, hist_rows, mode, bins, lo, hi, accumulate, ring, &stats_multi_cuda);
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("stats_multi_into", &stats_multi_into_cuda);
}

}  // namespace hookstats
