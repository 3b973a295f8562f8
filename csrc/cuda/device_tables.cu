// Note [capture-safe tables] (device_tables.cuh): small device tables filled by kernel launches, cached eagerly.
#include "device_tables.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <algorithm>
#include <cstring>
#include <mutex>

namespace hookstats {
namespace {

constexpr int kSliceWords = 240;  // 3,840 bytes of table per fill launch
struct TableSlice {
  uint4 words[kSliceWords];
  int64_t first;  // the slice's first word in the table
  int32_t count;
};

__global__ void __launch_bounds__(kSliceWords)
fill_table_kernel(uint4* __restrict__ dst, const __grid_constant__ TableSlice s) {
  if (static_cast<int32_t>(threadIdx.x) < s.count) dst[s.first + threadIdx.x] = s.words[threadIdx.x];
}

uint64_t table_hash(const uint4* words, int64_t n) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(words);
  uint64_t h[2] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full};
  for (int64_t i = 0; i < 2 * n; ++i) {
    uint64_t& x = h[i & 1];
    x = (x ^ w[i]) * 0xff51afd7ed558ccdull;
    x ^= x >> 32;
  }
  return h[0] ^ (h[1] * 0x94d049bb133111ebull) ^ static_cast<uint64_t>(n);
}

constexpr size_t kCacheEntries = 64;
constexpr int64_t kCacheBytes = int64_t(16) << 20;  // device bytes of the cached tables (their keys are no larger)

struct TableEntry {
  int device;
  cudaStream_t stream;
  uint64_t hash;
  std::vector<uint4> key;
  at::Tensor table;
  uint64_t last_use;
};

struct TableCache {
  std::mutex mu;
  std::vector<TableEntry> entries;
  int64_t bytes = 0;
  uint64_t clock = 0;
};

TableCache& table_cache() {
  static TableCache* cache = new TableCache();  // never destroyed: its tensors must not outlive CUDA at exit
  return *cache;
}

at::Tensor upload(c10::Device device, cudaStream_t stream, c10::function_ref<void(std::vector<uint4>&)> contents) {
  std::vector<uint4> words;
  contents(words);
  return upload_table(words.data(), static_cast<int64_t>(words.size()), device, stream);
}

}  // namespace

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

at::Tensor upload_table(const uint4* words, int64_t n, c10::Device device, cudaStream_t stream) {
  at::Tensor t = at::empty({n * 16}, at::TensorOptions().dtype(at::kByte).device(device));
  uint4* dst = reinterpret_cast<uint4*>(t.data_ptr());
  TableSlice slice;
  for (int64_t first = 0; first < n; first += kSliceWords) {
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(kSliceWords, n - first));
    std::memcpy(slice.words, words + first, static_cast<size_t>(count) * sizeof(uint4));
    slice.first = first;
    slice.count = count;
    fill_table_kernel<<<1, kSliceWords, 0, stream>>>(dst, slice);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return t;
}

at::Tensor device_table(const uint4* key, int64_t n_key, c10::Device device, cudaStream_t stream,
                        c10::function_ref<void(std::vector<uint4>&)> contents) {
  if (capturing()) return upload(device, stream, contents);
  const uint64_t h = table_hash(key, n_key);
  const int dev = device.index();
  TableCache& c = table_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  ++c.clock;
  for (TableEntry& e : c.entries) {
    if (e.hash == h && e.device == dev && e.stream == stream && static_cast<int64_t>(e.key.size()) == n_key &&
        std::memcmp(e.key.data(), key, static_cast<size_t>(n_key) * sizeof(uint4)) == 0) {
      e.last_use = c.clock;
      return e.table;
    }
  }
  at::Tensor t = upload(device, stream, contents);
  const int64_t nbytes = t.numel();
  if (nbytes > kCacheBytes) return t;
  while (!c.entries.empty() && (c.entries.size() >= kCacheEntries || c.bytes + nbytes > kCacheBytes)) {
    auto lru = std::min_element(c.entries.begin(), c.entries.end(),
                                [](const TableEntry& a, const TableEntry& b) { return a.last_use < b.last_use; });
    c.bytes -= lru->table.numel();
    c.entries.erase(lru);  // freed in stream order: the entry was only used on its own stream
  }
  c.entries.push_back(TableEntry{dev, stream, h, std::vector<uint4>(key, key + n_key), t, c.clock});
  c.bytes += nbytes;
  return t;
}

}  // namespace hookstats
