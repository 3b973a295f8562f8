// Small tables in device memory that CUDA kernels read beside their arguments, safe under CUDA graph capture
// (Note [capture-safe tables]): the tensor-list descriptions of the norm and clip ops (cuda/clip_cuda.cu) and
// the exact bin thresholds of the stats kernels (cuda/stats_cuda.cu).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>
#include <cuda_runtime_api.h>
#include <vector_types.h>

#include <cstdint>
#include <vector>

namespace hookstats {

// Note [capture-safe tables]
// A table is built on the host and written into device memory by fill_table_kernel, whose
// arguments carry the table's bytes (kSliceWords 16-byte words a launch, under the 4 KB
// kernel-argument limit of every CUDA version): no pinned host buffer, no host copy, no event.
// Eagerly, tables are cached (TableCache: up to kCacheEntries tables, kCacheBytes in all, least
// recently used evicted), keyed by the device, the stream and a key of bytes: for a tensor list
// the table itself (the tensors' data pointers, sizes, strides, dtypes and the chunking), for bin
// thresholds the range (bins, lo, hi) and the threshold width. Calling an op again on the same
// tensors (the gradients of every training step) or the same range launches no fill at all. An
// entry is only read by kernels on the stream it was written on, so it needs no event, and its
// memory returns to the caching allocator in stream order when it is evicted.
// During CUDA graph capture the cache is neither read nor written: the table is allocated from
// the graph's pool (at::empty under capture) and the fill launches are captured with their
// arguments, so every replay rewrites the table from the graph itself before the kernel reads
// it. That is safe on every torch this package supports (it does not depend on the pinned-memory
// support of recent torch's graph pools), with or without a warm-up step, and a replay costs one
// extra tiny kernel per ~120 tensors of a list or per 3.75 KB of thresholds. Reusing an eagerly
// cached table inside a graph was rejected: the graph would have to pin it forever, and nothing
// could prove that its upload on another stream had finished before a replay without querying an
// event, which is illegal during capture.

// Whether the current stream is capturing a CUDA graph.
bool capturing();

// A device copy of words[0, n), written on `stream` by fill launches (captured ones under capture).
at::Tensor upload_table(const uint4* words, int64_t n, c10::Device device, cudaStream_t stream);

// The table whose key is key[0, n_key) on (device, stream): under capture a fresh upload, else the cached one,
// uploaded on a miss. contents(words) fills the table's words (called only when it is uploaded; it may copy the
// key itself).
at::Tensor device_table(const uint4* key, int64_t n_key, c10::Device device, cudaStream_t stream,
                        c10::function_ref<void(std::vector<uint4>&)> contents);

}  // namespace hookstats
