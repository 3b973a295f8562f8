// Torch-free statistics math shared by the CPU and the CUDA kernels.
//
// Note [stats partials]
// A kernel reads its input in pieces (a CPU chunk, a CUDA thread's grid-stride share).
// Each piece is accumulated on the fast path in the input's accumulation type
// (float for fp16/bf16/fp32, double for fp64) into a FastAcc, then turned into a
// StatsPartial (doubles and int64 counts), which merges associatively:
//   * mean / m2 merge with Chan's parallel formula, so var and std stay accurate when
//     |mean| >> std (no sum-of-squares cancellation);
//   * the sum of squares and m2 carry a common power-of-two scale exponent `e`
//     (true value = stored * 4^e), so l2 and std never overflow or underflow when the
//     true value fits the result dtype; e is non-zero only for pieces of extreme magnitudes;
//   * NaN never reaches min/max/m2: counts decide NaN propagation in finalize().
// Every piece is read on that SIMD fast path: a piece of vanishing or huge magnitudes is
// scaled by a power of two first (Note [stats scaling]), a piece that holds NaN/Inf is only
// counted (Note [stats nonfinite]). No piece is re-read element by element in double.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define HS_HD __host__ __device__ __forceinline__
#else
#define HS_HD inline __attribute__((always_inline))
#endif

namespace hookstats {

// Note [stats row layout]: the order of the fields of hookstats.Stats and of a row of a
// stats_into buffer. hookstats/_fields.py (the record's field specification) lists them in
// this order; tests/test_fields.py checks it against kStatFieldNames (hookstats._C.STAT_FIELD_NAMES).
enum StatField : int {
  kNumel = 0, kSum, kMean, kVar, kStd, kL1, kL2, kLinf, kMin, kMax,
  kNanCount, kInfCount, kZeroCount, kNumStatFields
};
inline constexpr const char* kStatFieldNames[] = {
    "numel", "sum", "mean", "var", "std", "l1", "l2", "linf", "min", "max",
    "nan_count", "inf_count", "zero_count"};
static_assert(sizeof(kStatFieldNames) / sizeof(kStatFieldNames[0]) == kNumStatFields,
              "kStatFieldNames needs one name per StatField");
// hookstats::stats returns (values, counts): values are fields kSum..kMax (9, result
// dtype), counts are numel, nan, inf, zero (int64).
constexpr int kNumValueFields = kMax - kSum + 1;  // 9
constexpr int kNumCountFields = 4;

struct StatsPartial {
  int64_t n;
  int64_t nan;
  int64_t inf;
  int64_t zero;
  double sum;
  double l1;
  double mn;    // over non-NaN values (+inf when none)
  double mx;    // over non-NaN values (-inf when none)
  double ssq;   // sum of squares * 4^-e
  double mean;  // of the finite values (exact meaning only matters when all are finite)
  double m2;    // sum of squared deviations from mean * 4^-e
  int64_t e;    // power-of-two scale exponent of ssq and m2
};

HS_HD StatsPartial empty_partial() {
  StatsPartial p;
  p.n = 0; p.nan = 0; p.inf = 0; p.zero = 0;
  p.sum = 0.0; p.l1 = 0.0;
  p.mn = INFINITY; p.mx = -INFINITY;
  p.ssq = 0.0; p.mean = 0.0; p.m2 = 0.0; p.e = 0;
  return p;
}

// ldexp, without the library call for e == 0 (almost every piece: Note [stats scaling]); the CPU
// kernel calls it a few times per 4096-value chunk.
HS_HD double hs_ldexp(double x, int e) { return e == 0 ? x : ldexp(x, e); }

HS_HD double hs_fmin(double a, double b) { return b < a ? b : a; }
HS_HD double hs_fmax(double a, double b) { return b > a ? b : a; }

// Merges b into a. Associative up to rounding; callers merge in a fixed order so
// results are deterministic.
HS_HD void merge(StatsPartial& a, const StatsPartial& b) {
  if (b.n == 0) return;
  if (a.n == 0) { a = b; return; }
  // Align the scaled quantities to the larger exponent; a side whose scaled values are
  // both zero carries no information about its exponent.
  int64_t ea = (a.ssq == 0.0 && a.m2 == 0.0) ? b.e : a.e;
  int64_t eb = (b.ssq == 0.0 && b.m2 == 0.0) ? ea : b.e;
  const double na = static_cast<double>(a.n);
  const double nb = static_cast<double>(b.n);
  const double n = na + nb;
  const double delta = b.mean - a.mean;
  if (ea == 0 && eb == 0) {  // the common case: nothing scaled
    a.m2 = a.m2 + b.m2 + delta * delta * (na * nb / n);
    a.ssq = a.ssq + b.ssq;
    a.e = 0;
  } else {
    const int64_t e = ea > eb ? ea : eb;
    const int sa = static_cast<int>(2 * (ea - e) < -2200 ? -2200 : 2 * (ea - e));
    const int sb = static_cast<int>(2 * (eb - e) < -2200 ? -2200 : 2 * (eb - e));
    const double delta_s = ldexp(delta, static_cast<int>(-e < -1100 ? -1100 : (-e > 1100 ? 1100 : -e)));
    a.m2 = ldexp(a.m2, sa) + ldexp(b.m2, sb) + delta_s * delta_s * (na * nb / n);
    a.ssq = ldexp(a.ssq, sa) + ldexp(b.ssq, sb);
    a.e = e;
  }
  a.mean = a.mean + delta * (nb / n);
  a.n += b.n; a.nan += b.nan; a.inf += b.inf; a.zero += b.zero;
  a.sum += b.sum; a.l1 += b.l1;
  a.mn = hs_fmin(a.mn, b.mn);
  a.mx = hs_fmax(a.mx, b.mx);
}

// ---------------------------------------------------------------------------------------
// Fast path: what a piece accumulates in its accumulation type acc_t (see Note [stats partials]).
// Values are first scaled by s = 2^-e (e = 0 for almost every tensor; Note [stats scaling]) and
// then shifted by k, a guess of the piece's scaled mean (the CPU kernel uses the previous chunk's
// mean): with y = x * s and d = y - k, sum = n*k + sum(d), sum(y^2) = sum(d^2) + 2k*sum(d) + n*k^2
// and m2 = sum(d^2) - sum(d)^2/n, all without cancellation when k is near the mean, and with
// 9 vector operations per element group instead of 12 for separate sum/ssq accumulators.
// min, max and the zero count are always taken from the unscaled x, so they stay exact.
// sum_t: what the piece's sums are kept in. The CUDA kernel keeps acc_t; the CPU kernel sums short runs
// in acc_t lanes and those runs in double (so that one value that dominates a piece is not rounded at
// its own magnitude once per run).
template <typename acc_t, typename sum_t = acc_t>
struct FastAcc {
  acc_t k;         // shift, in scaled units
  acc_t s;         // the scale 2^-e
  int32_t e;
  sum_t sd, ssd;   // sum of (y - k), sum of (y - k)^2
  sum_t l1;        // sum |x| when e == 0, sum |y| otherwise
  acc_t mn, mx;    // of x, NaN ignored
  int64_t zero;
  int64_t n;
};

template <typename acc_t> struct FastLimits;
// Squares of magnitudes in [lo, hi] neither overflow nor lose relative precision when
// summed in acc_t over up to 2^40 values. emin/emax bound a scale exponent e so that 2^-e is a
// normal acc_t.
template <> struct FastLimits<float> {
  static constexpr float hi = 1.099511627776e12f;  // 2^40
  static constexpr float lo = 9.094947017729282e-13f;  // 2^-40
  static constexpr int emin = -127, emax = 126;
};
template <> struct FastLimits<double> {
  static constexpr double hi = 2.5822498780869086e120;  // 2^400
  static constexpr double lo = 3.872591914849318e-121;  // 2^-400
  static constexpr int emin = -1023, emax = 1022;
};

// Note [stats scaling]
// A piece whose largest magnitude amax lies outside FastLimits (vanishing gradients ~1e-20,
// activations ~1e20, fp32 values near its max) is summed on the same SIMD fast path after
// scaling every value by the power of two s = 2^-e with 2^e >= amax > 2^(e-1): scaled
// magnitudes are then below 1 (below 4 at the clamped ends of the exponent range), squares
// cannot overflow, and squares that underflow are below 2^-126 of the largest one, so they
// are negligible. Scaling by a power of two is exact (unless the scaled value underflows, the
// same negligible case), so the results are those of the unscaled computation with an exact
// exponent: the partial stores ssq and m2 with that exponent (true = stored * 4^e).
// scale_exponent() keeps e = 0 whenever amax is inside FastLimits, so healthy tensors get
// exactly the results they always had.
template <typename acc_t>
HS_HD int32_t scale_exponent(double amax) {
  if (!(amax > 0.0) || (amax <= static_cast<double>(FastLimits<acc_t>::hi) &&
                        amax >= static_cast<double>(FastLimits<acc_t>::lo))) {
    return 0;  // zero, or NaN (no finite value: nothing to scale)
  }
  if (amax == static_cast<double>(INFINITY)) return 0;
  int ex;
  frexp(amax, &ex);  // amax = f * 2^ex with f in [0.5, 1)
  if (ex < FastLimits<acc_t>::emin) ex = FastLimits<acc_t>::emin;
  if (ex > FastLimits<acc_t>::emax) ex = FastLimits<acc_t>::emax;
  return ex;
}

// Whether the values of a piece whose largest finite magnitude is amax may be summed with
// scale exponent e (amax * 2^-e inside FastLimits; an all-zero piece with any e).
template <typename acc_t>
HS_HD bool scale_fits(double amax, int32_t e) {
  if (amax == 0.0) return true;
  const double a = hs_ldexp(amax, -e);
  return a <= static_cast<double>(FastLimits<acc_t>::hi) && a >= static_cast<double>(FastLimits<acc_t>::lo);
}

template <typename acc_t, typename sum_t>
HS_HD void fast_init(FastAcc<acc_t, sum_t>& f, acc_t k, int32_t e = 0) {
  f.k = k;
  f.e = e;
  f.s = static_cast<acc_t>(hs_ldexp(1.0, -e));
  f.sd = f.ssd = f.l1 = sum_t(0);
  f.mn = INFINITY; f.mx = -INFINITY;
  f.zero = 0; f.n = 0;
}

// One element on the fast path. The CPU kernel does the same in SIMD lanes.
template <typename acc_t, typename sum_t>
HS_HD void fast_add(FastAcc<acc_t, sum_t>& f, acc_t v) {
  const acc_t y = v * f.s;  // exact (a power of two); v itself when e == 0
  const acc_t d = y - f.k;
  f.sd += d;
  f.ssd += d * d;
  f.l1 += y < acc_t(0) ? -y : y;
  f.mn = v < f.mn ? v : f.mn;
  f.mx = v > f.mx ? v : f.mx;
  f.zero += (v == acc_t(0));
  f.n += 1;
}

// Whether a fast result holds a NaN or Inf, or its l1 overflowed: then the piece's counts are
// taken by a NonfiniteAcc pass (and, when it finds no NaN/Inf, its sums again with a scale).
template <typename acc_t, typename sum_t>
HS_HD bool fast_nonfinite(const FastAcc<acc_t, sum_t>& f) {
  return !(f.l1 - f.l1 == sum_t(0));
}

// The largest magnitude of a piece whose fast result is finite (min and max are exact).
template <typename acc_t, typename sum_t>
HS_HD double fast_amax(const FastAcc<acc_t, sum_t>& f) {
  if (f.n == 0) return 0.0;
  const double mn = static_cast<double>(f.mn), mx = static_cast<double>(f.mx);
  return -mn > mx ? -mn : mx;
}

// True when the shift k was so far from the piece's mean (by more than about 1.7 standard
// deviations) that sum(d^2) cancels badly in m2 and sum(x^2); the piece is then summed again
// with k = its mean. Rare: the CPU kernel shifts by the previous chunk's mean.
template <typename acc_t, typename sum_t>
HS_HD bool shift_is_poor(const FastAcc<acc_t, sum_t>& f) {
  const double n = static_cast<double>(f.n);
  const double sd = static_cast<double>(f.sd);
  const double ssd = static_cast<double>(f.ssd);
  const double between = sd * sd / n;  // n * (mean - k)^2
  if (!(ssd - ssd == 0.0)) return true;  // (x - k)^2 overflowed: k was far off
  return between > 0.0 && between > 0.75 * ssd;  // i.e. n*(mean-k)^2 > 3 * m2
}

// The piece's mean in scaled units: the shift for a re-run after shift_is_poor.
template <typename acc_t, typename sum_t>
HS_HD acc_t fast_mean(const FastAcc<acc_t, sum_t>& f) {
  return static_cast<acc_t>(static_cast<double>(f.k) + static_cast<double>(f.sd) / static_cast<double>(f.n));
}

// Turns a trusted fast result (no NaN/Inf, scaled magnitudes in FastLimits) into a partial.
template <typename acc_t, typename sum_t>
HS_HD StatsPartial fast_to_partial(const FastAcc<acc_t, sum_t>& f) {
  StatsPartial p = empty_partial();
  if (f.n == 0) return p;
  const double n = static_cast<double>(f.n);
  const double k = static_cast<double>(f.k);
  const double sd = static_cast<double>(f.sd);
  const double ssd = static_cast<double>(f.ssd);
  const int e = f.e;
  p.n = f.n;
  p.zero = f.zero;
  p.sum = hs_ldexp(n * k + sd, e);
  p.l1 = hs_ldexp(static_cast<double>(f.l1), e);
  const double ssq = ssd + 2.0 * k * sd + n * k * k;
  p.ssq = ssq > 0.0 ? ssq : 0.0;
  p.mean = hs_ldexp(k + sd / n, e);
  const double m2 = ssd - sd * sd / n;
  p.m2 = m2 > 0.0 ? m2 : 0.0;
  p.mn = static_cast<double>(f.mn);
  p.mx = static_cast<double>(f.mx);
  p.e = e;
  return p;
}

// ---------------------------------------------------------------------------------------
// Pieces with NaN or Inf (Note [stats nonfinite]).
//
// Note [stats nonfinite]
// Once a tensor holds a NaN or an Inf, finalize() reads nothing of its partials but the counts,
// min and max, and the sign of its infinities: sum and mean are NaN (NaN seen) or what IEEE
// addition of the infinities gives, l1 and l2 are NaN or inf, var and std NaN. So a piece that
// holds NaN/Inf, and every later piece of the same CPU task, is read by a counting pass alone
// (vector compares: NaN, Inf and zero counts, NaN-free min and max), and its partial carries
// sum = the IEEE sum of its infinities, l1 = inf when it has one, and no moments. A finite
// piece counted that way (it follows a NaN/Inf in its task) gets sum = l1 = 0: harmless, since
// the tensor's result is decided by the NaN/Inf already seen.
template <typename acc_t>
struct NonfiniteAcc {
  int64_t n, nan, inf, zero;
  acc_t mn, mx;  // NaN ignored
};

template <typename acc_t>
HS_HD void nonfinite_init(NonfiniteAcc<acc_t>& c) {
  c.n = c.nan = c.inf = c.zero = 0;
  c.mn = INFINITY; c.mx = -INFINITY;
}

template <typename acc_t>
HS_HD void nonfinite_add(NonfiniteAcc<acc_t>& c, acc_t v) {
  c.n += 1;
  c.nan += (v != v);
  c.inf += ((v < acc_t(0) ? -v : v) == static_cast<acc_t>(INFINITY));
  c.zero += (v == acc_t(0));
  c.mn = v < c.mn ? v : c.mn;
  c.mx = v > c.mx ? v : c.mx;
}

template <typename acc_t>
HS_HD StatsPartial nonfinite_to_partial(const NonfiniteAcc<acc_t>& c) {
  StatsPartial p = empty_partial();
  p.n = c.n; p.nan = c.nan; p.inf = c.inf; p.zero = c.zero;
  p.mn = static_cast<double>(c.mn);
  p.mx = static_cast<double>(c.mx);
  const double pinf = p.mx == static_cast<double>(INFINITY) ? static_cast<double>(INFINITY) : 0.0;
  const double ninf = p.mn == -static_cast<double>(INFINITY) ? -static_cast<double>(INFINITY) : 0.0;
  p.sum = pinf + ninf;  // +inf + -inf = NaN, as IEEE addition of the whole piece gives
  p.l1 = c.inf > 0 ? static_cast<double>(INFINITY) : 0.0;
  return p;
}

// ---------------------------------------------------------------------------------------
// Final values. out is in Note [stats row layout] order. Semantics (tested against
// torch): NaN anywhere makes sum, mean, var, std, l1, l2, linf, min and max NaN; an Inf
// (and no NaN) makes l1/l2/linf inf, min/max +-inf, var/std NaN, and sum/mean what IEEE
// addition gives (+inf + -inf = NaN). var uses correction=1: NaN for n < 2.
// Empty input: numel 0, sum/l1/l2/linf 0, mean/var/std/min/max NaN, counts 0.
HS_HD void finalize(const StatsPartial& p, double* out) {
  const double nan = NAN;
  const bool has_nan = p.nan > 0;
  const bool has_inf = p.inf > 0;
  const double n = static_cast<double>(p.n);
  out[kNumel] = n;
  out[kNanCount] = static_cast<double>(p.nan);
  out[kInfCount] = static_cast<double>(p.inf);
  out[kZeroCount] = static_cast<double>(p.zero);
  out[kSum] = has_nan ? nan : p.sum;
  out[kMean] = (p.n == 0 || has_nan) ? nan : p.sum / n;
  // |e| <= 1023 (scale_exponent clamps it); ldexp handles that range.
  const int s = static_cast<int>(p.e > 4000 ? 4000 : (p.e < -4000 ? -4000 : p.e));
  if (p.n < 2 || has_nan || has_inf) {
    out[kVar] = nan;
    out[kStd] = nan;
  } else {
    const double v = p.m2 / (n - 1.0);  // scaled by 4^-e
    out[kStd] = hs_ldexp(sqrt(v), s);
    out[kVar] = hs_ldexp(v, 2 * s);
  }
  out[kL1] = has_nan ? nan : p.l1;
  out[kL2] = has_nan ? nan : (has_inf ? static_cast<double>(INFINITY) : hs_ldexp(sqrt(p.ssq), s));
  if (has_nan || p.n == 0) {
    out[kMin] = out[kMax] = nan;
    out[kLinf] = has_nan ? nan : 0.0;
  } else {
    out[kMin] = p.mn;
    out[kMax] = p.mx;
    out[kLinf] = hs_fmax(fabs(p.mn), fabs(p.mx));
  }
}

// Where a finished kernel writes its results: either (values[9] of OutT, counts[4] int64)
// or one stats_into row of OutT in Note [stats row layout] order.
// Note [ring rows]
// A stats_into call can take its row from device memory: with `ring` (an int64 position p,
// read when the kernel runs, not when it is launched) the row written is slot p mod
// ring_slots of a [ring_slots, rows, 13] buffer, and the histogram row that of a
// [ring_slots, hist rows, length] one. A call captured in a CUDA graph then writes the row of
// whichever step the replay belongs to: something else (the Monitor's captured prologue,
// csrc/monitor/recorder.cpp, Note [monitor graph replays]) advances p on the device between
// replays. Without ring, values/hist point at the row itself.
struct StatsOut {
  void* values;    // kSum..kMax, or the whole row when counts == nullptr
  int64_t* counts; // numel, nan, inf, zero; nullptr for a row
  bool out_double; // OutT is double (else float)
  const int64_t* ring = nullptr;  // the ring position p, or nullptr
  int64_t ring_slots = 0;         // rows one slot apart: values + slot * ring_value_bytes,
  int64_t ring_value_bytes = 0;   //   hist + slot * ring_hist_elems
  int64_t ring_hist_elems = 0;
  int64_t ring_loc_elems = 0;     //   loc + slot * ring_loc_elems
  int64_t* loc = nullptr;  // (argmax_abs, first_nonfinite) int64 when asked (Note [element locations], core/loc_ops.h)
};

// The ring slot of o (0 without a ring): p mod ring_slots, in [0, ring_slots) for any p.
HS_HD int64_t ring_slot(const StatsOut& o) {
  if (o.ring == nullptr || o.ring_slots <= 0) return 0;
  const int64_t r = *o.ring % o.ring_slots;
  return r < 0 ? r + o.ring_slots : r;
}

// The location row of o (Note [element locations]), in its ring slot when it has a ring.
HS_HD int64_t* ring_loc(const StatsOut& o) {
  return o.ring == nullptr ? o.loc : o.loc + ring_slot(o) * o.ring_loc_elems;
}

template <typename OutT>
HS_HD void store_typed(const double* r, OutT* values, int64_t* counts) {
  if (counts == nullptr) {
    for (int i = 0; i < kNumStatFields; ++i) values[i] = static_cast<OutT>(r[i]);
    return;
  }
  for (int i = 0; i < kNumValueFields; ++i) values[i] = static_cast<OutT>(r[kSum + i]);
  counts[0] = static_cast<int64_t>(r[kNumel]);
  counts[1] = static_cast<int64_t>(r[kNanCount]);
  counts[2] = static_cast<int64_t>(r[kInfCount]);
  counts[3] = static_cast<int64_t>(r[kZeroCount]);
}

HS_HD void store(const StatsPartial& p, const StatsOut& ring_out) {
  double r[kNumStatFields];
  finalize(p, r);
  StatsOut o = ring_out;
  if (o.ring != nullptr) o.values = static_cast<char*>(o.values) + ring_slot(o) * o.ring_value_bytes;
  if (o.counts != nullptr) {
    // Counts above 2^53 do not survive a double; take them from the partial directly.
    if (o.out_double) store_typed<double>(r, static_cast<double*>(o.values), o.counts);
    else store_typed<float>(r, static_cast<float*>(o.values), o.counts);
    o.counts[0] = p.n; o.counts[1] = p.nan; o.counts[2] = p.inf; o.counts[3] = p.zero;
    return;
  }
  if (o.out_double) store_typed<double>(r, static_cast<double*>(o.values), nullptr);
  else store_typed<float>(r, static_cast<float*>(o.values), nullptr);
}

}  // namespace hookstats
