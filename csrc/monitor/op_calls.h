// The recorder's calls of hookstats ops and the keep-alive of captured memory, shared by
// recorder.cpp (eager records) and rings.cpp (captured steps, Note [monitor graph replays]).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "recorder.h"

namespace hookstats {
namespace monitor {

// stats_into through the dispatcher (CPU or CUDA kernel), below autograd: the buffers are not part of any
// graph, and x may require grad.
void stats_into(const at::Tensor& x, const at::Tensor& out, int64_t slot, const std::optional<at::Tensor>& hist,
                int64_t hist_slot, const HistConfig& h, const std::optional<at::Tensor>& loc = std::nullopt,
                const std::optional<at::Tensor>& ring = std::nullopt);

// hookstats::_ring_advance through the dispatcher.
void ring_advance(const at::Tensor& state, const at::Tensor& steps, const at::Tensor& step);

// Tensors a replayed graph may still write: kept for the life of the process (Note [monitor graph replays]).
void keep_forever(std::vector<at::Tensor> ts);

}  // namespace monitor
}  // namespace hookstats
