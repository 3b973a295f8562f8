// CPU implementation of hookstats::stats and hookstats::stats_into.
//
// The input is cut into chunks of kChunk elements (a strided input is gathered chunk by
// chunk into a stack buffer, Note [layouts]). Each chunk is reduced in SIMD on the fast
// path and, only when needs_careful() says so, re-read from L1 on the careful path
// (Note [stats partials]). Chunks are grouped into at most kMaxTasks tasks whose number
// depends only on numel, so the merge order, and hence every bit of the result, does not
// depend on the number of threads.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../core/checks.h"
#include "../core/dispatch.h"
#include "../core/layout.h"
#include "../core/stats_ops.h"
#include "simd.h"

namespace hookstats {
namespace {

constexpr int64_t kChunk = 4096;
constexpr int64_t kMaxTasks = 64;
constexpr int64_t kMinTaskElems = 32768;

template <typename scalar_t> struct BitsOf { using type = scalar_t; };
template <> struct BitsOf<c10::Half> { using type = simd::HalfBits; };
template <> struct BitsOf<c10::BFloat16> { using type = simd::BF16Bits; };

template <typename scalar_t>
using acc_of = typename simd::Lanes<typename BitsOf<scalar_t>::type, 16>::acc_t;

// The fast path over one contiguous chunk (Note [cpu dispatch]): the SIMD version of
// fast_add() in core/stats_ops.h, in two interleaved sets of lanes (to hide the add and
// fma latencies). The lanes restart every kBlock elements and their sums are added into f,
// so no float lane adds more than kBlock / (2 W) values: a constant tensor's l1 stays
// within ~1e-6 of the truth (a single lane over the whole chunk drifted to ~5e-6).
constexpr int64_t kBlock = 512;

template <int B, typename scalar_t>
HS_INLINE FastAcc<acc_of<scalar_t>> fast_chunk_simd(const scalar_t* p, int64_t n, acc_of<scalar_t> k) {
  using L = simd::Lanes<typename BitsOf<scalar_t>::type, B>;
  using acc_t = typename L::acc_t;
  using V = typename L::V;
  using M = typename L::M;
  constexpr int W = L::W;
  struct Lanes {
    V sd, ssd, l1, mn, mx;
    M z;
  };
  const V vk = V{} + k;
  auto init = [](Lanes& a) {
    a.sd = V{}; a.ssd = V{}; a.l1 = V{}; a.z = M{};
    a.mn = V{} + static_cast<acc_t>(INFINITY);
    a.mx = V{} - static_cast<acc_t>(INFINITY);
  };
  auto step = [&](Lanes& a, const V& v) {
    const V d = v - vk;
    a.sd += d;
    a.ssd += d * d;
    a.l1 += simd::abs_bits<V, M>(v);
    a.mn = v < a.mn ? v : a.mn;
    a.mx = v > a.mx ? v : a.mx;
    a.z -= (v == 0);
  };
  FastAcc<acc_t> f;
  fast_init<acc_t>(f, k);
  int64_t i = 0;
  const int64_t n_vec = n - n % W;
  while (i < n_vec) {
    Lanes a, b;
    init(a);
    init(b);
    const int64_t end = std::min(n_vec, i + kBlock);
    for (; i + 2 * W <= end; i += 2 * W) {
      step(a, L::load(p + i));
      step(b, L::load(p + i + W));
    }
    if (i + W <= end) {
      step(a, L::load(p + i));
      i += W;
    }
    acc_t sd = 0, ssd = 0, l1 = 0;
    for (int j = 0; j < W; ++j) {
      sd += a.sd[j] + b.sd[j];
      ssd += a.ssd[j] + b.ssd[j];
      l1 += a.l1[j] + b.l1[j];
      const acc_t mn = a.mn[j] < b.mn[j] ? a.mn[j] : b.mn[j];
      const acc_t mx = a.mx[j] > b.mx[j] ? a.mx[j] : b.mx[j];
      f.mn = mn < f.mn ? mn : f.mn;
      f.mx = mx > f.mx ? mx : f.mx;
      f.zero += a.z[j] + b.z[j];
    }
    f.sd += sd;
    f.ssd += ssd;
    f.l1 += l1;
  }
  f.n = i;
  for (; i < n; ++i) fast_add<acc_t>(f, static_cast<acc_t>(p[i]));
  return f;
}

// A shift representable in the input dtype: then x - k is exact for x near k, and sums of
// such differences of fp16/bf16 inputs do not pile up k's rounding error.
template <typename scalar_t>
HS_INLINE acc_of<scalar_t> input_shift(double mean) {
  const auto k = static_cast<acc_of<scalar_t>>(static_cast<scalar_t>(mean));
  return k - k == 0 ? k : 0;
}

// A whole chunk: fast path shifted by k, again with a better shift when k was poor, the
// careful path when the fast result cannot be trusted. `k` is updated to this chunk's mean.
template <int B, typename scalar_t>
HS_INLINE StatsPartial fast_chunk_body(const scalar_t* p, int64_t n, acc_of<scalar_t>& k) {
  using acc_t = acc_of<scalar_t>;
  FastAcc<acc_t> f = fast_chunk_simd<B, scalar_t>(p, n, k);
  if (!needs_careful<acc_t>(f)) {
    if (shift_is_poor<acc_t>(f)) f = fast_chunk_simd<B, scalar_t>(p, n, input_shift<scalar_t>(fast_mean<acc_t>(f)));
    k = input_shift<scalar_t>(fast_mean<acc_t>(f));
    return fast_to_partial<acc_t>(f);
  }
  StatsPartial c = empty_partial();
  double amax = 0.0;
  for (int64_t j = 0; j < n; ++j) careful_count(c, amax, static_cast<double>(p[j]));
  const int64_t e = careful_scale_exponent(amax);
  CarefulMoments m = careful_moments_init();
  for (int64_t j = 0; j < n; ++j) careful_moments(m, static_cast<double>(p[j]), e);
  careful_finish(c, m, e);
  if (c.mean - c.mean == 0.0 && fabs(c.mean) < FastLimits<acc_t>::hi) k = input_shift<scalar_t>(c.mean);
  return c;
}

template <typename scalar_t>
StatsPartial chunk_default(const scalar_t* p, int64_t n, acc_of<scalar_t>& k) { return fast_chunk_body<16>(p, n, k); }

template <typename scalar_t>
HS_TARGET_AVX2 StatsPartial chunk_avx2(const scalar_t* p, int64_t n, acc_of<scalar_t>& k) {
  return fast_chunk_body<32>(p, n, k);
}

// The first shift of a task: the mean of its first few values (finite ones; 0 if none).
template <typename scalar_t>
acc_of<scalar_t> initial_shift(const scalar_t* p, int64_t n) {
  double s = 0.0;
  int64_t m = 0;
  for (int64_t i = 0; i < n && i < 8; ++i) {
    const double v = static_cast<double>(p[i]);
    if (v - v == 0.0 && fabs(v) < FastLimits<acc_of<scalar_t>>::hi) { s += v; ++m; }
  }
  return input_shift<scalar_t>(m ? s / m : 0.0);
}

// Copies logical elements [start, start + len) of a strided tensor into buf.
template <typename scalar_t>
void gather(const scalar_t* base, const StridedLayout& l, int64_t start, int64_t len, scalar_t* buf) {
  int64_t idx[kMaxDims];
  int64_t rem = start, off = 0;
  const int last = l.ndim - 1;
  for (int d = last; d >= 0; --d) {
    idx[d] = rem % l.sizes[d];
    rem /= l.sizes[d];
    off += idx[d] * l.strides[d];
  }
  int64_t i = 0;
  const int64_t st = l.strides[last];
  while (i < len) {
    const int64_t inner = std::min(l.sizes[last] - idx[last], len - i);
    const scalar_t* q = base + off;
    for (int64_t j = 0; j < inner; ++j) buf[i + j] = q[j * st];
    i += inner;
    off += inner * st;
    idx[last] += inner;
    for (int d = last; d > 0 && idx[d] == l.sizes[d]; --d) {
      off -= l.sizes[d] * l.strides[d];
      idx[d] = 0;
      idx[d - 1] += 1;
      off += l.strides[d - 1];
    }
  }
}

template <typename scalar_t>
StatsPartial stats_partial_cpu(const scalar_t* base, int64_t numel, const StridedLayout& layout) {
  using chunk_fn = StatsPartial (*)(const scalar_t*, int64_t, acc_of<scalar_t>&);
  const chunk_fn chunk = simd::use_avx2() ? &chunk_avx2<scalar_t> : &chunk_default<scalar_t>;
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  const int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>({kMaxTasks, nchunks, numel / kMinTaskElems}));
  const int64_t chunks_per_task = (nchunks + ntasks - 1) / ntasks;
  StatsPartial task_partials[kMaxTasks];
  auto run_task = [&](int64_t t) {
    StatsPartial acc = empty_partial();
    alignas(64) scalar_t buf[kChunk];
    acc_of<scalar_t> k = 0;
    const int64_t c_end = std::min(nchunks, (t + 1) * chunks_per_task);
    for (int64_t c = t * chunks_per_task; c < c_end; ++c) {
      const int64_t start = c * kChunk;
      const int64_t len = std::min(kChunk, numel - start);
      const scalar_t* p = base + start;
      if (layout.ndim != 0) {
        gather(base, layout, start, len, buf);
        p = buf;
      }
      if (c == t * chunks_per_task) k = initial_shift(p, len);
      merge(acc, chunk(p, len, k));
    }
    task_partials[t] = acc;
  };
  if (ntasks == 1) {
    run_task(0);
  } else {
    at::parallel_for(0, ntasks, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) run_task(t);
    });
  }
  StatsPartial total = empty_partial();
  for (int64_t t = 0; t < ntasks; ++t) merge(total, task_partials[t]);
  return total;
}

StatsPartial stats_partial_cpu(const at::Tensor& x) {
  const StridedLayout layout = layout_of(x);
  StatsPartial p = empty_partial();
  if (x.numel() == 0) return p;
  HOOKSTATS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hookstats_stats_cpu", [&] {
    p = stats_partial_cpu<scalar_t>(static_cast<const scalar_t*>(first_element(x)), x.numel(), layout);
  });
  return p;
}

std::tuple<at::Tensor, at::Tensor> stats_cpu(const at::Tensor& x) {
  check_float_input(x, "stats");
  const at::ScalarType rt = result_dtype(x.scalar_type());
  at::Tensor values = at::empty({kNumValueFields}, x.options().dtype(rt));
  at::Tensor counts = at::empty({kNumCountFields}, x.options().dtype(at::kLong));
  const StatsPartial p = stats_partial_cpu(x);
  store(p, StatsOut{values.data_ptr(), counts.data_ptr<int64_t>(), rt == at::kDouble});
  return {values, counts};
}

void stats_into_cpu(const at::Tensor& x, const at::Tensor& out, int64_t slot) {
  check_float_input(x, "stats_into");
  check_stats_buffer(x, out, slot);
  const StatsPartial p = stats_partial_cpu(x);
  char* row = static_cast<char*>(out.data_ptr()) + slot * out.stride(0) * out.element_size();
  store(p, StatsOut{row, nullptr, out.scalar_type() == at::kDouble});
}

}  // namespace

// Declared in hookstats.cpp, which defines the op.
std::string cpu_isa(const std::string& mode) {
  TORCH_CHECK_VALUE(mode.empty() || mode == "avx2" || mode == "default",
                    "hookstats._cpu_isa takes '', 'avx2' or 'default', got '", mode, "'");
  if (!mode.empty()) simd::set_use_avx2(mode == "avx2");
  return simd::use_avx2() ? "avx2" : "default";
}

TORCH_LIBRARY_IMPL(hookstats, CPU, m) {
  m.impl("stats", &stats_cpu);
  m.impl("stats_into", &stats_into_cpu);
}

}  // namespace hookstats
