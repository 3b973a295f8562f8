// CPU implementation of the multi-tensor norm and clipping ops: hookstats::norms,
// hookstats::scale_by_norm_ and hookstats::clamp_count_.
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
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/layout.h"
#include "../core/norm_ops.h"
#include "../core/tensor_list.h"
#include "cpu_common.h"
#include "simd.h"

namespace hookstats {
namespace {

constexpr int64_t kChunk = 4096;  // <= kMaxFastPiece
constexpr int64_t kMaxTasks = 64;
constexpr int64_t kMinTaskElems = 32768;
constexpr int64_t kNormBlock = 512;
static_assert(kChunk <= kMaxFastPiece, "a fast norm piece must stay within NormLimits");

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

// ---------------------------------------------------------------------------------------
// Norms. The fast path of core/norm_ops.h in SIMD lanes, two interleaved sets, the values scaled
// by 2^-e first when SCALED (Note [norm scaling]); max |x| is of the unscaled values.
template <int B, int KIND, typename scalar_t, bool SCALED>
HS_INLINE FastNorm<acc_of<scalar_t>> fast_norm_simd(const scalar_t* p, int64_t n, acc_of<scalar_t> sc) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  using acc_t = typename L::acc_t;
  using V = typename L::V;
  using M = typename L::M;
  constexpr int W = L::W;
  const V vsc = V{} + sc;
  V m0{}, m1{};
  auto step = [&](V& s, V& m, const V& v) {
    const V a = simd::abs_bits<V, M>(v);
    if (KIND == kNorm1) s += SCALED ? a * vsc : a;
    if (KIND == kNorm2) {
      if constexpr (SCALED) {
        const V y = v * vsc;
        s += y * y;
      } else {
        s += v * v;
      }
    }
    if (KIND == kNormInf) {
      m = ((a > m) | (a != a)) ? a : m;
      s += v - v;
    } else {
      m = a > m ? a : m;
    }
  };
  FastNorm<acc_t> f;
  fast_norm_init(f);
  // The sum lanes restart every kNormBlock values (as in stats_cpu.cpp): a constant tensor's
  // l1 then stays within ~1e-7 instead of drifting to ~3e-6 over a chunk.
  int64_t i = 0;
  const int64_t n_vec = n - n % W;
  while (i < n_vec) {
    V s0{}, s1{};
    const int64_t end = std::min(n_vec, i + kNormBlock);
    for (; i + 2 * W <= end; i += 2 * W) {
      step(s0, m0, L::load(p + i));
      step(s1, m1, L::load(p + i + W));
    }
    if (i + W <= end) {
      step(s0, m0, L::load(p + i));
      i += W;
    }
    acc_t s = 0;
    for (int j = 0; j < W; ++j) s += s0[j] + s1[j];
    f.s += s;
  }
  for (int j = 0; j < W; ++j) {
    const acc_t m = (m1[j] > m0[j] || m1[j] != m1[j]) ? m1[j] : m0[j];
    f.amax = (m > f.amax || m != m) ? m : f.amax;
  }
  for (; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(p[i]);
    if (SCALED && KIND != kNormInf) fast_norm_add_scaled<KIND, acc_t>(f, v, sc);
    else fast_norm_add<KIND, acc_t>(f, v);
  }
  return f;
}

// NaN / Inf flags of a piece by vector compares.
template <int B, typename scalar_t>
HS_INLINE int32_t nonfinite_flags_simd(const scalar_t* p, int64_t n) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  using acc_t = typename L::acc_t;
  using V = typename L::V;
  using M = typename L::M;
  constexpr int W = L::W;
  const V inf = V{} + static_cast<acc_t>(INFINITY);
  M nan{}, isinf{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const V v = L::load(p + i);
    nan |= (v != v);
    isinf |= (simd::abs_bits<V, M>(v) == inf);
  }
  int32_t flags = (simd::any_lane(nan) ? kNormHasNan : 0) | (simd::any_lane(isinf) ? kNormHasInf : 0);
  for (; i < n; ++i) flags |= nonfinite_norm_flag<acc_t>(static_cast<acc_t>(p[i]));
  return flags;
}

template <typename scalar_t>
NormPartial careful_norm_chunk(const scalar_t* p, int64_t n, const NormSpec& ns) {
  CarefulNorm c = careful_norm_init();
  for (int64_t j = 0; j < n; ++j) careful_norm_scan(c, static_cast<double>(p[j]));
  const int32_t e = careful_norm_exponent(c, ns);
  double s = 0.0;
  if (ns.kind != kNormInf && !(c.flags & kNormHasNan)) {
    for (int64_t j = 0; j < n; ++j) s += careful_norm_term(static_cast<double>(p[j]), e, ns);
  }
  return careful_norm_partial(c, s, e, ns);
}

template <int B, int KIND, typename scalar_t>
HS_INLINE FastNorm<acc_of<scalar_t>> fast_norm_scaled(const scalar_t* p, int64_t n, int32_t e) {
  using acc_t = acc_of<scalar_t>;
  if (e == 0) return fast_norm_simd<B, KIND, scalar_t, false>(p, n, acc_t(1));
  return fast_norm_simd<B, KIND, scalar_t, true>(p, n, static_cast<acc_t>(ldexp(1.0, -e)));
}

// A chunk as Note [norm piece] reads it: SIMD passes over p[0, n).
template <int B, int KIND, typename scalar_t>
struct SimdNormReader {
  const scalar_t* p;
  int64_t n;
  HS_INLINE FastNorm<acc_of<scalar_t>> fast(int32_t e) const {
    if (KIND == kNormInf) return fast_norm_simd<B, kNormInf, scalar_t, false>(p, n, acc_of<scalar_t>(1));
    return fast_norm_scaled<B, KIND, scalar_t>(p, n, e);
  }
  HS_INLINE int32_t flags() const { return nonfinite_flags_simd<B, scalar_t>(p, n); }
};

// One chunk; `e` and `flags_seen` are the state of the piece so far (Note [norm scaling]).
template <int B, typename scalar_t>
HS_INLINE NormPartial norm_chunk_body(const scalar_t* p, int64_t n, const NormSpec& ns, int32_t& e,
                                      int32_t flags_seen) {
  using acc_t = acc_of<scalar_t>;
  if (ns.kind == kNormP) return careful_norm_chunk(p, n, ns);
  if (flags_seen & kNormHasInf) {  // the norm is inf unless a NaN follows
    NormPartial r = empty_norm();
    r.flags = nonfinite_flags_simd<B, scalar_t>(p, n);
    return r;
  }
  switch (ns.kind) {
    case kNorm2: return fast_norm_piece<acc_t>(SimdNormReader<B, kNorm2, scalar_t>{p, n}, kNorm2, e);
    case kNorm1: return fast_norm_piece<acc_t>(SimdNormReader<B, kNorm1, scalar_t>{p, n}, kNorm1, e);
    default: return fast_norm_piece<acc_t>(SimdNormReader<B, kNormInf, scalar_t>{p, n}, kNormInf, e);
  }
}

template <typename scalar_t>
NormPartial norm_chunk_default(const scalar_t* p, int64_t n, const NormSpec& ns, int32_t& e, int32_t flags) {
  return norm_chunk_body<16, scalar_t>(p, n, ns, e, flags);
}

template <typename scalar_t>
HS_TARGET_AVX2 NormPartial norm_chunk_avx2(const scalar_t* p, int64_t n, const NormSpec& ns, int32_t& e,
                                           int32_t flags) {
  return norm_chunk_body<32, scalar_t>(p, n, ns, e, flags);
}

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
NormPartial norm_piece(const TensorDesc& d, const ListPlan& pl, int64_t begin, int64_t len, const NormSpec& ns) {
  const auto chunk = simd::use_avx2() ? &norm_chunk_avx2<scalar_t> : &norm_chunk_default<scalar_t>;
  const scalar_t* base = static_cast<const scalar_t*>(d.data);
  NormPartial acc = empty_norm();
  alignas(64) scalar_t buf[kChunk];
  const simd::FlushToZero ftz(std::is_same<acc_of<scalar_t>, float>::value);  // as in stats_cpu.cpp
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
  static thread_local std::vector<NormPartial> parts;
  parts.assign(xs.size(), empty_norm());
  NormPartial* tp = parts.data();
  struct Edge { int64_t i; NormPartial p; };
  Edge head[kMaxTasks], tail[kMaxTasks];
  run_tasks(pl, [&](int64_t t) {
    head[t].i = tail[t].i = -1;
    for_pieces(pl, t, [&](int64_t i, int64_t begin, int64_t len, int k, bool last) {
      NormPartial q = empty_norm();
      HS_DISPATCH_CODE(pl.descs[i].dtype, [&] { q = norm_piece<scalar_t>(pl.descs[i], pl, begin, len, ns); });
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

// ---------------------------------------------------------------------------------------
// Scaling in place by a coefficient (or to zero).
template <int B, typename scalar_t>
HS_INLINE void scale_chunk_body(scalar_t* p, int64_t n, acc_of<scalar_t> coef, bool zero) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  using acc_t = typename L::acc_t;
  using V = typename L::V;
  constexpr int W = L::W;
  int64_t i = 0;
  if (zero) {
    std::fill(p, p + n, static_cast<scalar_t>(0));
    return;
  }
  const V c = V{} + coef;
  for (; i + W <= n; i += W) L::store(p + i, L::load(p + i) * c);
  for (; i < n; ++i) p[i] = static_cast<scalar_t>(static_cast<acc_t>(p[i]) * coef);
}

template <typename scalar_t>
void scale_chunk_default(scalar_t* p, int64_t n, acc_of<scalar_t> coef, bool zero) {
  scale_chunk_body<16, scalar_t>(p, n, coef, zero);
}

template <typename scalar_t>
HS_TARGET_AVX2 void scale_chunk_avx2(scalar_t* p, int64_t n, acc_of<scalar_t> coef, bool zero) {
  scale_chunk_body<32, scalar_t>(p, n, coef, zero);
}

template <typename scalar_t>
void scale_piece(const TensorDesc& d, const ListPlan& pl, int64_t begin, int64_t len, double coef, bool zero) {
  using acc_t = acc_of<scalar_t>;
  if (scale_is_identity<acc_t>(coef, zero)) return;  // Note [coefficient one]
  scalar_t* base = static_cast<scalar_t*>(d.data);
  const acc_t c = static_cast<acc_t>(coef);
  if (d.layout < 0) {
    (simd::use_avx2() ? &scale_chunk_avx2<scalar_t> : &scale_chunk_default<scalar_t>)(base + begin, len, c, zero);
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
  run_tasks(pl, [&](int64_t t) {
    for_pieces(pl, t, [&](int64_t i, int64_t begin, int64_t len, int, bool) {
      HS_DISPATCH_CODE(pl.descs[i].dtype, [&] { scale_piece<scalar_t>(pl.descs[i], pl, begin, len, coef, zero); });
    });
  });
}

// ---------------------------------------------------------------------------------------
// Clamping in place with a count of the changed elements.
template <int B, typename scalar_t>
HS_INLINE int64_t clamp_chunk_body(scalar_t* p, int64_t n, scalar_t lo_t, scalar_t hi_t) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  using acc_t = typename L::acc_t;
  using V = typename L::V;
  using M = typename L::M;
  constexpr int W = L::W;
  const acc_t lo = static_cast<acc_t>(lo_t), hi = static_cast<acc_t>(hi_t);
  const V vlo = V{} + lo, vhi = V{} + hi;
  M cnt{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const V v = L::load(p + i);
    const M m = (M)(v < vlo) | (M)(v > vhi);
    if (simd::any_lane(m)) {
      cnt -= m;
      for (int j = 0; j < W; ++j) {
        if (m[j]) p[i + j] = v[j] < lo ? lo_t : hi_t;
      }
    }
  }
  int64_t count = 0;
  for (int j = 0; j < W; ++j) count += cnt[j];
  for (; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(p[i]);
    if (is_clipped(v, lo, hi)) {
      p[i] = v < lo ? lo_t : hi_t;
      ++count;
    }
  }
  return count;
}

template <typename scalar_t>
int64_t clamp_chunk_default(scalar_t* p, int64_t n, scalar_t lo, scalar_t hi) {
  return clamp_chunk_body<16, scalar_t>(p, n, lo, hi);
}

template <typename scalar_t>
HS_TARGET_AVX2 int64_t clamp_chunk_avx2(scalar_t* p, int64_t n, scalar_t lo, scalar_t hi) {
  return clamp_chunk_body<32, scalar_t>(p, n, lo, hi);
}

template <typename scalar_t>
int64_t clamp_piece(const TensorDesc& d, const ListPlan& pl, int64_t begin, int64_t len, double lo, double hi) {
  using acc_t = acc_of<scalar_t>;
  scalar_t* base = static_cast<scalar_t*>(d.data);
  const scalar_t lo_t = static_cast<scalar_t>(lo), hi_t = static_cast<scalar_t>(hi);
  if (d.layout < 0) {
    const auto chunk = simd::use_avx2() ? &clamp_chunk_avx2<scalar_t> : &clamp_chunk_default<scalar_t>;
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
  int64_t counts[kMaxTasks];
  run_tasks(pl, [&](int64_t t) {
    int64_t c = 0;
    for_pieces(pl, t, [&](int64_t i, int64_t begin, int64_t len, int, bool) {
      HS_DISPATCH_CODE(pl.descs[i].dtype, [&] { c += clamp_piece<scalar_t>(pl.descs[i], pl, begin, len, lo, hi); });
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
