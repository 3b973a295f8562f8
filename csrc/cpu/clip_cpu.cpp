// CPU implementation of the multi-tensor norm and clipping ops: hookstats::norms,
// hookstats::scale_by_norm_, hookstats::clamp_count_ and hookstats::clip_norm_: the pieces of a tensor list, the
// tasks over them and the merges; a chunk's norm, scaling and clamping are the level's entry points (cpu/clip_chunk.h,
// one table per ISA, chosen by simd::isa() as the statistics kernel's: Note [cpu dispatch]).
//
// Note [cpu tensor lists]
// A list of tensors is treated as one concatenated sequence of elements, cut into at most
// kMaxTasks tasks of equal length; that number depends only on the total number of elements,
// so the pieces of every tensor, their reduction order, and every bit of the results do not
// depend on the number of threads. A task's pieces are its parts of the tensors it overlaps:
// a piece strictly between a task's first and last is a whole tensor that no other task
// touches; the first and last pieces are merged into their tensors after the parallel region,
// in task order. Thousands of small tensors cost one parallel region, not one per tensor.
// scale_by_norm_ and clamp_count_ walk the same pieces, so with the same thread count a
// tensor's elements are scaled by the thread that just read them for the norm (in its cache
// when its share fits).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/layout.h"
#include "../core/norm_ops.h"
#include "../core/tensor_list.h"
#include "clip_chunk.h"
#include "cpu_common.h"

namespace hookstats {
namespace {

using namespace clip_cpu;

constexpr int64_t kMaxTasks = 64;
constexpr int64_t kMinTaskElems = 32768;

// The chunk entry points of the level that runs now (Note [cpu dispatch]), picked once per op call.
const ClipTable& level_table() {
  const simd::Isa isa = simd::isa();
  return isa == simd::kIsaAvx512 ? kClipAvx512 : (isa == simd::kIsaAvx2 ? kClipAvx2 : kClipDefault);
}

// The pieces of a tensor list (Note [cpu tensor lists]). Cached per calling thread: no
// allocation once warm.
struct ListPlan {
  std::vector<TensorDesc> descs;
  std::vector<StridedLayout> layouts;
  std::vector<int64_t> starts;  // n + 1 prefix sums of numel
  int64_t total = 0;
  int64_t ntasks = 1;
  int64_t task_len = 0;
};

ListPlan& plan_for(at::TensorList xs) {
  static thread_local ListPlan pl;
  describe(xs, pl.descs, pl.layouts);
  pl.starts.resize(xs.size() + 1);
  pl.starts[0] = 0;
  for (size_t i = 0; i < xs.size(); ++i) pl.starts[i + 1] = pl.starts[i] + pl.descs[i].numel;
  pl.total = pl.starts.back();
  pl.ntasks = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, pl.total / kMinTaskElems));
  pl.task_len = (pl.total + pl.ntasks - 1) / pl.ntasks;
  return pl;
}

// Calls f(i, begin, len, k, last) for the pieces of task t: tensor i's elements
// [begin, begin + len), the k-th piece of the task, `last` when it is the task's last one.
template <typename F>
void for_pieces(const ListPlan& pl, int64_t t, F&& f) {
  int64_t pos = t * pl.task_len;
  const int64_t end = std::min(pl.total, pos + pl.task_len);
  int64_t i = std::upper_bound(pl.starts.begin(), pl.starts.end(), pos) - pl.starts.begin() - 1;
  int k = 0;
  while (pos < end) {
    const int64_t stop = std::min(end, pl.starts[i + 1]);
    if (stop > pos) {
      f(i, pos - pl.starts[i], stop - pos, k, stop == end);
      ++k;
      pos = stop;
    }
    ++i;
  }
}

template <typename F>
void run_tasks(const ListPlan& pl, F&& task) {
  if (pl.ntasks == 1) {
    task(0);
    return;
  }
  at::parallel_for(0, pl.ntasks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) task(t);
  });
}

// Flush-to-zero for a task's float pieces (as in stats_cpu.cpp), switched only where the accumulation type changes
// from one piece to the next: two MXCSR writes a piece were ~10% of the norms of 1,000 small tensors.
class TaskFtz {
 public:
  void want(bool on) {
    if (on == ftz_.has_value()) return;
    if (on) ftz_.emplace(true);
    else ftz_.reset();
  }

 private:
  std::optional<simd::FlushToZero> ftz_;
};

// The first scale exponent of a piece, from its first few finite values.
template <typename scalar_t>
int32_t initial_norm_exponent(const scalar_t* p, int64_t n) {
  double amax = 0.0;
  for (int64_t i = 0; i < n && i < 8; ++i) {
    const double a = fabs(static_cast<double>(p[i]));
    if (a - a == 0.0 && a > amax) amax = a;
  }
  return norm_scale_exponent<acc_of<scalar_t>>(amax);
}

// The partial of tensor d's elements [begin, begin + len), chunk by chunk.
template <typename scalar_t>
NormPartial norm_piece(const ClipTable& tab, const TensorDesc& d, const ListPlan& pl, int64_t begin, int64_t len,
                       const NormSpec& ns, TaskFtz& ftz) {
  const auto chunk = table_entry<scalar_t>(tab).norm;
  const scalar_t* base = static_cast<const scalar_t*>(d.data);
  NormPartial acc = empty_norm();
  alignas(64) scalar_t buf[kChunk];
  ftz.want(std::is_same<acc_of<scalar_t>, float>::value);
  int32_t e = 0;
  for (int64_t c = 0; c < len; c += kChunk) {
    const int64_t n = std::min(kChunk, len - c);
    const scalar_t* p = base + begin + c;
    if (d.layout >= 0) {
      gather(base, pl.layouts[d.layout], begin + c, n, buf);
      p = buf;
    }
    if (c == 0) e = initial_norm_exponent(p, n);
    norm_merge(acc, chunk(p, n, ns, e, acc.flags), ns);
    if (acc.flags & kNormHasNan) break;  // the norm is NaN whatever follows (Note [norm scaling])
  }
  return acc;
}

#define HS_DISPATCH_CODE(code, ...)                                      \
  switch (code) {                                                        \
    case kF64: { using scalar_t = double; __VA_ARGS__(); break; }        \
    case kF16: { using scalar_t = c10::Half; __VA_ARGS__(); break; }     \
    case kBF16: { using scalar_t = c10::BFloat16; __VA_ARGS__(); break; } \
    default: { using scalar_t = float; __VA_ARGS__(); break; }           \
  }

std::tuple<at::Tensor, at::Tensor> norms_cpu(at::TensorList xs, double p) {
  check_tensor_list(xs, "norms", false);
  check_norm_type(p, "norms");
  const NormSpec ns = make_norm_spec(p);
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(at::kCPU);
  at::Tensor per = at::empty({static_cast<int64_t>(xs.size())}, opts);
  at::Tensor total = at::empty({}, opts);
  const ListPlan& pl = plan_for(xs);
  const ClipTable& tab = level_table();
  static thread_local std::vector<NormPartial> parts;
  parts.assign(xs.size(), empty_norm());
  NormPartial* tp = parts.data();
  struct Edge { int64_t i; NormPartial p; };
  Edge head[kMaxTasks], tail[kMaxTasks];
  run_tasks(pl, [&](int64_t t) {
    head[t].i = tail[t].i = -1;
    TaskFtz ftz;
    for_pieces(pl, t, [&](int64_t i, int64_t begin, int64_t len, int k, bool last) {
      NormPartial q = empty_norm();
      HS_DISPATCH_CODE(pl.descs[i].dtype, [&] { q = norm_piece<scalar_t>(tab, pl.descs[i], pl, begin, len, ns, ftz); });
      if (k == 0) head[t] = Edge{i, q};
      else if (last) tail[t] = Edge{i, q};
      else tp[i] = q;
    });
  });
  for (int64_t t = 0; t < pl.ntasks; ++t) {
    if (head[t].i >= 0) norm_merge(tp[head[t].i], head[t].p, ns);
    if (tail[t].i >= 0) norm_merge(tp[tail[t].i], tail[t].p, ns);
  }
  NormPartial all = empty_norm();
  double* out = per.data_ptr<double>();
  for (size_t i = 0; i < xs.size(); ++i) {
    out[i] = norm_finalize(tp[i], ns);
    norm_merge(all, tp[i], ns);
  }
  *total.data_ptr<double>() = norm_finalize(all, ns);
  return {per, total};
}

template <typename scalar_t>
void scale_piece(const ClipTable& tab, const TensorDesc& d, const ListPlan& pl, int64_t begin, int64_t len, double coef,
                 bool zero) {
  using acc_t = acc_of<scalar_t>;
  if (scale_is_identity<acc_t>(coef, zero)) return;  // Note [coefficient one]
  scalar_t* base = static_cast<scalar_t*>(d.data);
  const acc_t c = static_cast<acc_t>(coef);
  if (d.layout < 0) {
    table_entry<scalar_t>(tab).scale(base + begin, len, c, zero);
    return;
  }
  for_each_run(base, pl.layouts[d.layout], begin, len, [&](scalar_t* q, int64_t st, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      q[j * st] = static_cast<scalar_t>(scale_value<acc_t>(static_cast<acc_t>(q[j * st]), c, zero));
    }
  });
}

void scale_by_norm_cpu(at::TensorList xs, const at::Tensor& total, double max_norm, double eps, int64_t policy) {
  check_tensor_list(xs, "scale_by_norm_", true);
  check_total(xs, total);
  check_clip_args(max_norm, eps, policy);
  const double norm = *total.data_ptr<double>();
  const double coef = clip_coef(norm, max_norm, eps, static_cast<int>(policy));
  if (coef_is_identity(coef)) return;
  const bool zero = policy == kZero && !(norm - norm == 0.0);
  const ListPlan& pl = plan_for(xs);
  const ClipTable& tab = level_table();
  run_tasks(pl, [&](int64_t t) {
    for_pieces(pl, t, [&](int64_t i, int64_t begin, int64_t len, int, bool) {
      HS_DISPATCH_CODE(pl.descs[i].dtype,
                       [&] { scale_piece<scalar_t>(tab, pl.descs[i], pl, begin, len, coef, zero); });
    });
  });
}

template <typename scalar_t>
int64_t clamp_piece(const ClipTable& tab, const TensorDesc& d, const ListPlan& pl, int64_t begin, int64_t len,
                    double lo, double hi) {
  using acc_t = acc_of<scalar_t>;
  scalar_t* base = static_cast<scalar_t*>(d.data);
  const scalar_t lo_t = static_cast<scalar_t>(lo), hi_t = static_cast<scalar_t>(hi);
  if (d.layout < 0) {
    const auto chunk = table_entry<scalar_t>(tab).clamp;
    int64_t count = 0;
    for (int64_t c = 0; c < len; c += kChunk) count += chunk(base + begin + c, std::min(kChunk, len - c), lo_t, hi_t);
    return count;
  }
  const acc_t lo_a = static_cast<acc_t>(lo_t), hi_a = static_cast<acc_t>(hi_t);
  int64_t count = 0;
  for_each_run(base, pl.layouts[d.layout], begin, len, [&](scalar_t* q, int64_t st, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const acc_t v = static_cast<acc_t>(q[j * st]);
      if (is_clipped(v, lo_a, hi_a)) {
        q[j * st] = v < lo_a ? lo_t : hi_t;
        ++count;
      }
    }
  });
  return count;
}

at::Tensor clamp_count_cpu(at::TensorList xs, double lo, double hi) {
  check_tensor_list(xs, "clamp_count_", true);
  check_bounds(lo, hi);
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
  const ListPlan& pl = plan_for(xs);
  const ClipTable& tab = level_table();
  int64_t counts[kMaxTasks];
  run_tasks(pl, [&](int64_t t) {
    int64_t c = 0;
    for_pieces(pl, t, [&](int64_t i, int64_t begin, int64_t len, int, bool) {
      HS_DISPATCH_CODE(pl.descs[i].dtype,
                       [&] { c += clamp_piece<scalar_t>(tab, pl.descs[i], pl, begin, len, lo, hi); });
    });
    counts[t] = c;
  });
  int64_t total = 0;
  for (int64_t t = 0; t < pl.ntasks; ++t) total += counts[t];
  *out.data_ptr<int64_t>() = total;
  return out;
}

// The CPU has no fused path: the norm pass and the scale pass walk the same pieces on the same
// threads (Note [cpu tensor lists]), so the second finds in cache what fits there.
at::Tensor clip_norm_cpu(const at::Tensor& x, double p, double max_norm, double eps, int64_t policy, int64_t path) {
  const at::Tensor xs[1] = {x};
  check_tensor_list(xs, "clip_norm_", true);
  check_norm_type(p, "clip_norm_");
  check_clip_args(max_norm, eps, policy);
  check_clip_path(path);  // Note [clip_norm_ paths]
  if (wants_fused(path, x.numel() * static_cast<int64_t>(x.element_size()))) {
    fused_unavailable(path, "the CPU has only the two-pass path (0 auto, 1 two passes, 3 falls back to it)");
  }
  auto [per, total] = norms_cpu(xs, p);
  scale_by_norm_cpu(xs, total, max_norm, eps, policy);
  return total;
}

}  // namespace

TORCH_LIBRARY_IMPL(hookstats, CPU, m) {
  m.impl("norms", &norms_cpu);
  m.impl("scale_by_norm_", &scale_by_norm_cpu);
  m.impl("clamp_count_", &clamp_count_cpu);
  m.impl("clip_norm_", &clip_norm_cpu);
}

}  // namespace hookstats
