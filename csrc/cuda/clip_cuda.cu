// CUDA implementation of the multi-tensor norm and clipping ops: hookstats::norms,
// hookstats::scale_by_norm_, hookstats::clamp_count_ and hookstats::clip_norm_: the ATen side (checks, the list
// tables, the fused path's plan) here, the kernels in kernels/clip_{norms,scale,fused}.cu (kernels/clip_launch.h).
//
// Note [cuda tensor lists]
// Every tensor of the list is cut into chunks of chunk_len elements (>= 64K, and large enough
// that a list has at most about 4 chunks per SM beyond one per tensor); one block of 256
// threads handles one chunk, so one launch covers every tensor, whatever their number, sizes
// and dtypes (the block switches on its tensor's dtype). A list of more than one tensor is
// described in device memory (TensorDesc, StridedLayout and each tensor's first chunk: the
// list's table, Note [capture-safe tables]); a block finds its tensor by binary search. A
// single flat tensor travels in the kernel arguments instead, and needs no table.
//   norms: each thread reduces its share of a chunk (at most kMaxFastPiece values) on the fast
//     path of core/norm_ops.h, re-reading it in acc_t only to flag NaN/Inf or with a power-of-two
//     scale (Note [norm piece]; general p takes the careful path), the block merges
//     in a fixed order into a per-chunk partial, and the last block to finish (atomic ticket)
//     merges every tensor's chunks, then all tensors: per-tensor norms and the total, in the
//     same launch (Note [last-block merge]). No float atomics: results are bitwise reproducible.
//   scale_by_norm_: reads the total norm on the device; blocks exit at once when the
//     coefficient, rounded to their tensor's acc_t, is 1 (Note [coefficient one]).
//   clamp_count_: counts with integer atomics, one per block.
//
// Tables: Note [capture-safe tables] (cuda/device_tables.cuh). The fused clip_norm_ path is not used under
// capture (Note [clip_norm_ paths]).
// Flat 16-byte-aligned chunks use 16-byte loads and stores; other layouts go element by element
// (Note [layouts]).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "../core/checks.h"
#include "../core/layout.h"
#include "../core/norm_ops.h"
#include "../core/tensor_list.h"
#include "cuda_util.cuh"
#include "device_tables.cuh"
#include "kernels/clip_launch.h"

namespace hookstats {
namespace {

using namespace clip_cuda;

// The chunks of a list (Note [cuda tensor lists]).
struct DeviceList {
  ListArgs args;
  int64_t nchunks;
  at::Tensor meta;  // the device table; cached, or freed by the caching allocator in stream order
};

DeviceList prepare(at::TensorList xs) {
  static thread_local std::vector<TensorDesc> descs;
  static thread_local std::vector<StridedLayout> layouts;
  static thread_local std::vector<uint4> words;
  describe(xs, descs, layouts);
  const int64_t n = static_cast<int64_t>(xs.size());
  int64_t total = 0;
  for (const TensorDesc& d : descs) total += d.numel;
  const int64_t sms = sm_count(xs[0].device().index());
  int64_t chunk = (total + 4 * sms - 1) / (4 * sms);
  chunk = (chunk + 4095) / 4096 * 4096;
  chunk = std::min(kMaxChunk, std::max(kMinChunk, chunk));
  DeviceList dl;
  std::memset(&dl.args, 0, sizeof(dl.args));
  dl.args.ntensors = n;
  dl.args.chunk_len = chunk;
  std::vector<int64_t> starts(static_cast<size_t>(n + 1));
  starts[0] = 0;
  for (int64_t t = 0; t < n; ++t) starts[t + 1] = starts[t] + (descs[t].numel + chunk - 1) / chunk;
  dl.nchunks = starts[n];
  TORCH_CHECK(dl.nchunks < (int64_t(1) << 31), "hookstats: too many chunks for one launch");
  if (n == 1 && descs[0].layout < 0) {
    dl.args.single = true;
    dl.args.one = descs[0];
    return dl;
  }
  if (dl.nchunks == 0) return dl;  // nothing to launch
  const size_t b_desc = descs.size() * sizeof(TensorDesc);
  const size_t b_lay = layouts.size() * sizeof(StridedLayout);
  const size_t off_lay = (b_desc + 15) / 16 * 16;
  const size_t off_cs = off_lay + (b_lay + 15) / 16 * 16;
  const size_t bytes = off_cs + starts.size() * sizeof(int64_t);
  const int64_t nwords = static_cast<int64_t>((bytes + 15) / 16);
  words.assign(static_cast<size_t>(nwords), uint4{0u, 0u, 0u, 0u});  // padding bytes zeroed: they are hashed
  char* h = reinterpret_cast<char*>(words.data());
  std::memcpy(h, descs.data(), b_desc);
  for (size_t i = 0; i < layouts.size(); ++i) {  // field by field: padding and unused dims stay zero
    StridedLayout z;
    std::memset(&z, 0, sizeof(z));
    z.ndim = layouts[i].ndim;
    for (int k = 0; k < z.ndim; ++k) {
      z.sizes[k] = layouts[i].sizes[k];
      z.strides[k] = layouts[i].strides[k];
    }
    std::memcpy(h + off_lay + i * sizeof(StridedLayout), &z, sizeof(z));
  }
  std::memcpy(h + off_cs, starts.data(), starts.size() * sizeof(int64_t));
  const c10::Device device = xs[0].device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  dl.meta = device_table(words.data(), nwords, device, stream, [&](std::vector<uint4>& w) { w = words; });
  char* d = static_cast<char*>(dl.meta.data_ptr());
  dl.args.descs = reinterpret_cast<const TensorDesc*>(d);
  dl.args.layouts = reinterpret_cast<const StridedLayout*>(d + off_lay);
  dl.args.chunk_start = reinterpret_cast<const int64_t*>(d + off_cs);
  return dl;
}

std::tuple<at::Tensor, at::Tensor> norms_cuda(at::TensorList xs, double p) {
  check_tensor_list(xs, "norms", false);
  check_norm_type(p, "norms");
  TORCH_CHECK_VALUE(!xs.empty(), "hookstats.norms needs at least one tensor");
  const c10::cuda::CUDAGuard guard(xs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs[0].device().index());
  const auto opts = xs[0].options().dtype(at::kDouble);
  DeviceList dl = prepare(xs);
  if (dl.nchunks == 0) {
    return {at::zeros({static_cast<int64_t>(xs.size())}, opts), at::zeros({}, opts)};
  }
  at::Tensor per = at::empty({static_cast<int64_t>(xs.size())}, opts);
  at::Tensor total = at::empty({}, opts);
  const int64_t ws_bytes = dl.nchunks * static_cast<int64_t>(sizeof(NormPartial)) + 16;
  at::Tensor ws = at::empty({ws_bytes}, xs[0].options().dtype(at::kByte));
  auto* partials = reinterpret_cast<NormPartial*>(ws.data_ptr());
  auto* ticket = reinterpret_cast<unsigned int*>(static_cast<char*>(ws.data_ptr()) + ws_bytes - 16);
  C10_CUDA_CHECK(cudaMemsetAsync(ticket, 0, sizeof(unsigned int), stream));
  C10_CUDA_CHECK(launch_norms(dl.args, make_norm_spec(p), partials, ticket, per.data_ptr<double>(),
                              total.data_ptr<double>(), dl.nchunks, stream));
  return {per, total};
}

void scale_by_norm_cuda(at::TensorList xs, const at::Tensor& total, double max_norm, double eps, int64_t policy) {
  check_tensor_list(xs, "scale_by_norm_", true);
  check_total(xs, total);
  check_clip_args(max_norm, eps, policy);
  if (xs.empty()) return;
  const c10::cuda::CUDAGuard guard(xs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs[0].device().index());
  DeviceList dl = prepare(xs);
  if (dl.nchunks == 0) return;
  C10_CUDA_CHECK(launch_scale(dl.args, total.data_ptr<double>(), max_norm, eps, static_cast<int>(policy), dl.nchunks,
                              stream));
}

at::Tensor clamp_count_cuda(at::TensorList xs, double lo, double hi) {
  check_tensor_list(xs, "clamp_count_", true);
  check_bounds(lo, hi);
  TORCH_CHECK_VALUE(!xs.empty(), "hookstats.clamp_count_ needs at least one tensor");
  const c10::cuda::CUDAGuard guard(xs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs[0].device().index());
  at::Tensor count = at::zeros({}, xs[0].options().dtype(at::kLong));
  DeviceList dl = prepare(xs);
  if (dl.nchunks == 0) return count;
  Bounds b;
  b.lo[kF32] = static_cast<float>(lo); b.hi[kF32] = static_cast<float>(hi);
  b.lo[kF64] = lo; b.hi[kF64] = hi;
  b.lo[kF16] = static_cast<float>(static_cast<c10::Half>(lo)); b.hi[kF16] = static_cast<float>(static_cast<c10::Half>(hi));
  b.lo[kBF16] = static_cast<float>(static_cast<c10::BFloat16>(lo));
  b.hi[kBF16] = static_cast<float>(static_cast<c10::BFloat16>(hi));
  C10_CUDA_CHECK(launch_clamp(dl.args, b, reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()),
                              dl.nchunks, stream));
  return count;
}


// The launch of the fused path (Note [fused clip_norm_]) for x, if x qualifies on this device.
struct FusedPlan {
  int grid;
  int64_t per_block;  // elements per block, a multiple of 16 bytes
  size_t smem;
};

// Whether x qualifies for the fused path on its device; if not, why.
template <typename scalar_t>
bool plan_fused(const at::Tensor& x, FusedPlan& plan, std::string& why) {
  const int dev = x.device().index();
  int coop = 0, optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (!coop) {
    why = "the device has no cooperative launch";
    return false;
  }
  if (layout_of(x).ndim != 0 || reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) {
    why = "it needs a flat (dense), 16-byte-aligned tensor";
    return false;
  }
  const int64_t sms = sm_count(dev);
  const int64_t elem = sizeof(scalar_t);
  const int64_t max_tile = (static_cast<int64_t>(optin) - 1024) / 16 * 16;  // room for the static shared memory
  const int64_t bytes = x.numel() * elem;
  if (max_tile <= 0 || bytes > sms * max_tile) {
    why = "the tensor (" + std::to_string(bytes) + " bytes) does not fit in the shared memory of one grid (" +
          std::to_string(max_tile > 0 ? sms * max_tile : 0) + " bytes on this device)";
    return false;
  }
  static bool attr_set[64] = {false};
  if (dev >= 0 && dev < 64 && !attr_set[dev]) {
    const cudaError_t err = fused_clip_allow_smem<scalar_t>(static_cast<int>(max_tile));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the two-launch path must not see it
      why = std::string("cudaFuncSetAttribute failed (") + cudaGetErrorString(err) + ")";
      return false;
    }
    attr_set[dev] = true;
  }
  // Small tensors use fewer blocks (at least 4 KB each): fewer partials to merge.
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(sms, (bytes + 4095) / 4096));
  const int64_t vec = 16 / elem;
  int64_t per_block = (x.numel() + grid - 1) / grid;
  per_block = (per_block + vec - 1) / vec * vec;
  const size_t smem = static_cast<size_t>(per_block * elem);
  int resident = 0;
  const cudaError_t err = fused_clip_occupancy<scalar_t>(&resident, smem);
  if (err != cudaSuccess) (void)cudaGetLastError();
  if (static_cast<int64_t>(smem) > max_tile || err != cudaSuccess || resident < 1 || grid > resident * sms) {
    why = "one block per multiprocessor does not fit its slice in shared memory";
    return false;
  }
  plan = FusedPlan{static_cast<int>(grid), per_block, smem};
  // Tests only: one block more than can be co-resident, so that the driver refuses the launch
  // (cudaErrorCooperativeLaunchTooLarge) and the fall-back runs (tests/test_clip.py).
  const char* over = std::getenv("HOOKSTATS_TEST_OVERSUBSCRIBE_FUSED");
  if (over != nullptr && over[0] == '1') plan.grid = static_cast<int>(resident * sms + 1);
  return true;
}

// One cooperative launch of the fused path, if x qualifies and the driver accepts it; else
// false with the reason, and no CUDA error left behind.
template <typename scalar_t>
bool try_fused(const at::Tensor& x, double p, double max_norm, double eps, int64_t policy, const at::Tensor& total,
               cudaStream_t stream, std::string& why) {
  FusedPlan plan;
  if (!plan_fused<scalar_t>(x, plan, why)) return false;
  at::Tensor ws = at::empty({static_cast<int64_t>(plan.grid) * static_cast<int64_t>(sizeof(NormPartial))},
                            x.options().dtype(at::kByte));
  scalar_t* xp = static_cast<scalar_t*>(x.data_ptr());
  int64_t n = x.numel();
  int64_t per_block = plan.per_block;
  NormSpec ns = make_norm_spec(p);
  int pol = static_cast<int>(policy);
  NormPartial* partials = reinterpret_cast<NormPartial*>(ws.data_ptr());
  double* out = total.data_ptr<double>();
  const cudaError_t err =
      launch_fused_clip<scalar_t>(xp, n, per_block, ns, max_norm, eps, pol, partials, out, plan.grid, plan.smem, stream);
  if (err != cudaSuccess) {
    // Refused (cudaErrorCooperativeLaunchTooLarge under MPS or on a partitioned device, ...):
    // nothing ran. Clear the error state so the two-launch path starts clean.
    (void)cudaGetLastError();
    why = std::string("the driver refused the cooperative launch (") + cudaGetErrorName(err) + ": " +
          cudaGetErrorString(err) + ")";
    return false;
  }
  return true;
}

// path: Note [clip_norm_ paths] (core/tensor_list.h).
at::Tensor clip_norm_cuda(const at::Tensor& x, double p, double max_norm, double eps, int64_t policy, int64_t path) {
  const at::Tensor xs[1] = {x};
  check_tensor_list(xs, "clip_norm_", true);
  check_norm_type(p, "clip_norm_");
  check_clip_args(max_norm, eps, policy);
  check_clip_path(path);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  if (x.numel() == 0) return at::zeros({}, x.options().dtype(at::kDouble));
  if (wants_fused(path, x.numel() * static_cast<int64_t>(x.element_size()))) {
    if (capturing()) {
      fused_unavailable(path, "not under CUDA graph capture (path 0 captures the two launches)");
    } else {
      at::Tensor total = at::empty({}, x.options().dtype(at::kDouble));
      bool launched = false;
      std::string why;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hookstats_clip_norm_cuda", [&] {
        launched = try_fused<scalar_t>(x, p, max_norm, eps, policy, total, stream, why);
      });
      if (launched) return total;
      fused_unavailable(path, why);
    }
  }
  auto [per, t] = norms_cuda(xs, p);
  scale_by_norm_cuda(xs, t, max_norm, eps, policy);
  return t;
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CUDA, m) {
  m.impl("norms", &norms_cuda);
  m.impl("scale_by_norm_", &scale_by_norm_cuda);
  m.impl("clamp_count_", &clamp_count_cuda);
  m.impl("clip_norm_", &clip_norm_cuda);
}

}  // namespace hookstats