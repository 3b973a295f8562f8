// Torch-free norm and clipping math shared by the CPU and the CUDA kernels (clip_cpu.cpp,
// cuda/kernels/clip_device.cuh).
//
// Note [norm partials]
// A p-norm is reduced as NormPartial {s, e, flags}: for finite p the pieces' values were
// scaled by 2^-e before being raised to p, so sum |x|^p = s * 2^(p*e); for p = inf, s is
// max |x| and e is 0. Partials of pieces with different e merge by rescaling the smaller
// one, so no norm overflows or underflows while its true value fits a double, whatever the
// input's magnitudes (PyTorch's fp32 norm of 1000 values of 1e30 is inf; ours is 3.16e31).
// flags record NaN and Inf; finalize gives NaN if any NaN, else inf if any Inf, as
// torch.linalg.vector_norm does.
//
// A piece is reduced on the fast path, in the input's accumulation type (float for
// fp16/bf16/fp32, double for fp64), tracking max |x|; for p = 1, 2 its values are scaled by a
// power of two 2^-e first when their magnitudes call for it, and a piece with NaN/Inf is only
// flagged (Note [norm scaling], Note [norm piece]): no piece of a p = 1, 2 or inf norm is read
// in double, on the CPU or on CUDA. General p (neither 1, 2 nor inf) takes the careful path, in
// double: sweep 1 finds max |x| and the flags, sweep 2 sums (|x| * 2^-e)^p with 2^e >= max |x|;
// it needs pow() per element anyway.
#pragma once

#include <cmath>
#include <cstdint>

#include "stats_ops.h"  // HS_HD, hs_fmax

namespace hookstats {

enum NormKind : int { kNormInf = 0, kNorm1 = 1, kNorm2 = 2, kNormP = 3 };

struct NormSpec {
  int kind;
  double p;  // the order; only read for kNormP
};

// norm_type as the Python API takes it: inf, or a finite p > 0 (checked by the caller).
HS_HD NormSpec make_norm_spec(double p) {
  NormSpec s;
  s.p = p;
  s.kind = p == static_cast<double>(INFINITY) ? kNormInf : (p == 1.0 ? kNorm1 : (p == 2.0 ? kNorm2 : kNormP));
  return s;
}

constexpr int32_t kNormHasNan = 1;
constexpr int32_t kNormHasInf = 2;

struct NormPartial {
  double s;
  int32_t e;
  int32_t flags;
};

HS_HD NormPartial empty_norm() {
  NormPartial n;
  n.s = 0.0; n.e = 0; n.flags = 0;
  return n;
}

// s * 2^(p*de) for de <= 0: a partial brought to a larger exponent.
HS_HD double rescale(double s, int32_t de, const NormSpec& ns) {
  if (de == 0 || s == 0.0) return s;
  const int d = de < -4000 ? -4000 : de;
  switch (ns.kind) {
    case kNorm1: return ldexp(s, d);
    case kNorm2: return ldexp(s, 2 * d);
    case kNormP: return s * exp2(ns.p * static_cast<double>(d));
    default: return ldexp(s, d);
  }
}

// Merges b into a. Associative up to rounding; callers merge in a fixed order.
HS_HD void norm_merge(NormPartial& a, const NormPartial& b, const NormSpec& ns) {
  a.flags |= b.flags;
  if (ns.kind == kNormInf) { a.s = hs_fmax(a.s, b.s); return; }
  if (b.s == 0.0) return;
  if (a.s == 0.0) { a.s = b.s; a.e = b.e; return; }
  if (a.e >= b.e) {
    a.s += rescale(b.s, b.e - a.e, ns);
  } else {
    a.s = rescale(a.s, a.e - b.e, ns) + b.s;
    a.e = b.e;
  }
}

HS_HD double norm_finalize(const NormPartial& n, const NormSpec& ns) {
  if (n.flags & kNormHasNan) return NAN;
  if (n.flags & kNormHasInf) return INFINITY;
  switch (ns.kind) {
    case kNorm1: return ldexp(n.s, n.e);
    case kNorm2: return ldexp(sqrt(n.s), n.e);
    case kNormP: return n.s == 0.0 ? 0.0 : ldexp(pow(n.s, 1.0 / ns.p), n.e);
    default: return n.s;
  }
}

// ---------------------------------------------------------------------------------------
// Fast path: sums in acc_t. Magnitudes inside [lo, hi] give sums that neither overflow nor
// go subnormal over a piece of up to kMaxFastPiece values (Note [norm partials]); an all-zero
// piece is trusted too.
constexpr int64_t kMaxFastPiece = int64_t(1) << 14;
template <typename acc_t> struct NormLimits;
template <> struct NormLimits<float> {
  static constexpr float hi = 7.2057594037927936e16f;  // 2^56: 2^14 squares stay below 2^127
  static constexpr float lo = 8.6736173798840355e-19f;  // 2^-60: squares stay normal
};
template <> struct NormLimits<double> {
  static constexpr double hi = 1.6069380442589903e60;  // 2^200
  static constexpr double lo = 6.2230152778611417e-61;  // 2^-200
};

template <typename acc_t>
struct FastNorm {
  acc_t s;     // sum |x| (p = 1), sum x^2 (p = 2); unused for inf
  acc_t amax;  // max |x|; NaN-sticky for p = inf (fast_norm_add)
};

template <typename acc_t>
HS_HD void fast_norm_init(FastNorm<acc_t>& f) { f.s = acc_t(0); f.amax = acc_t(0); }

template <int KIND, typename acc_t>
HS_HD void fast_norm_add(FastNorm<acc_t>& f, acc_t v) {
  const acc_t a = v < acc_t(0) ? -v : v;
  if (KIND == kNorm1) f.s += a;
  if (KIND == kNorm2) f.s += v * v;
  if (KIND == kNormInf) {
    f.amax = (a > f.amax || a != a) ? a : f.amax;  // keeps a NaN once seen
    f.s += v - v;                                   // NaN once a NaN or Inf was seen
  } else {
    f.amax = a > f.amax ? a : f.amax;
  }
}

// Whether a fast result may be kept. For p = 1, 2 a NaN or Inf makes s non-finite; for
// p = inf, s collects x - x for the same purpose.
template <typename acc_t>
HS_HD bool fast_norm_trusted(const FastNorm<acc_t>& f, int kind) {
  if (!(f.s - f.s == acc_t(0))) return false;
  if (kind == kNormInf) return true;
  return f.amax == acc_t(0) || (f.amax <= NormLimits<acc_t>::hi && f.amax >= NormLimits<acc_t>::lo);
}

template <typename acc_t>
HS_HD NormPartial fast_norm_partial(const FastNorm<acc_t>& f, int kind) {
  NormPartial n = empty_norm();
  n.s = static_cast<double>(kind == kNormInf ? f.amax : f.s);
  return n;
}

// Note [norm scaling]
// The CPU kernel never leaves the SIMD fast path for p = 1, 2, inf: a piece whose max |x| lies
// outside NormLimits is summed again in acc_t after scaling by the power of two 2^-e with
// 2^e >= max |x| (norm_scale_exponent), which is exact, keeps every term below 1 and loses only
// terms below 2^-126 of the largest (as Note [stats scaling]); the next chunk starts with that
// e. A piece whose sum is not finite is checked by a vector compare pass (NaN, Inf flags); one
// with neither overflowed and is scaled (Note [norm piece]). Once a piece has a NaN the norm is
// NaN: the CPU kernel stops reading that tensor; after an Inf it only looks for NaN. The CUDA
// kernels (cuda/kernels/clip_device.cuh) take the same decisions per thread share. The careful path below stays
// for general p only, which needs pow() per element anyway.
template <typename acc_t>
HS_HD int32_t norm_scale_exponent(double amax) {
  if (!(amax > 0.0) || amax == static_cast<double>(INFINITY) ||
      (amax <= static_cast<double>(NormLimits<acc_t>::hi) && amax >= static_cast<double>(NormLimits<acc_t>::lo))) {
    return 0;
  }
  int ex;
  frexp(amax, &ex);
  if (ex < FastLimits<acc_t>::emin) ex = FastLimits<acc_t>::emin;  // 2^-e stays a normal acc_t
  if (ex > FastLimits<acc_t>::emax) ex = FastLimits<acc_t>::emax;
  return ex;
}

// Whether a piece with max |x| = amax may be summed with scale exponent e.
template <typename acc_t>
HS_HD bool norm_scale_fits(double amax, int32_t e) {
  if (amax == 0.0) return true;
  const double a = ldexp(amax, -e);
  return a <= static_cast<double>(NormLimits<acc_t>::hi) && a >= static_cast<double>(NormLimits<acc_t>::lo);
}

// One value of a piece summed with scale sc = 2^-e (Note [norm scaling]); max |x| is of the
// unscaled value. The CPU kernel does the same in SIMD lanes.
template <int KIND, typename acc_t>
HS_HD void fast_norm_add_scaled(FastNorm<acc_t>& f, acc_t v, acc_t sc) {
  const acc_t a = v < acc_t(0) ? -v : v;
  if (KIND == kNorm1) f.s += a * sc;
  if (KIND == kNorm2) {
    const acc_t y = v * sc;
    f.s += y * y;
  }
  f.amax = a > f.amax ? a : f.amax;
}

// The NaN / Inf flag of one value: the count-only pass of a piece whose sum is not finite.
template <typename acc_t>
HS_HD int32_t nonfinite_norm_flag(acc_t v) {
  if (v != v) return kNormHasNan;
  return (v < acc_t(0) ? -v : v) == static_cast<acc_t>(INFINITY) ? kNormHasInf : 0;
}

// Note [norm piece]
// The decisions of Note [norm scaling] for one piece, shared by the CPU kernel (R reads a chunk
// in SIMD lanes) and the CUDA kernels (R reads a thread's share): R::fast(e) sums the piece on
// the fast path with its values scaled by 2^-e (e = 0: unscaled) and R::flags() is the NaN / Inf
// flags of the piece by compares alone. e is the scale exponent carried in (a guess from the
// piece's first values, or the previous chunk's) and out (the one the sums used).
//   p = 1, 2: the fast sum; if it is not finite, the flags decide: a NaN or an Inf is all the
//     piece's partial needs; else (it overflowed) and also when max |x| does not fit e, the
//     piece is summed once more with the exponent of its max |x|.
//   p = inf: the fast max, or only the flags when a NaN or an Inf was seen.
// Every pass is in acc_t: no value is read in double.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // R's passes are __device__ in cuda/kernels/clip_device.cuh, host code in clip_cpu.cpp
#endif
template <typename acc_t, typename R>
HS_HD NormPartial fast_norm_piece(const R& r, int kind, int32_t& e) {
  NormPartial out = empty_norm();
  if (kind == kNormInf) {
    const FastNorm<acc_t> f = r.fast(0);
    if (fast_norm_trusted(f, kind)) return fast_norm_partial(f, kind);
    out.flags = r.flags();
    return out;
  }
  FastNorm<acc_t> f = r.fast(e);
  const bool finite = f.s - f.s == acc_t(0);
  if (!finite) {
    const int32_t flags = r.flags();
    if (flags) {
      out.flags = flags;
      return out;
    }
  }
  const double amax = static_cast<double>(f.amax);
  if (!finite || !norm_scale_fits<acc_t>(amax, e)) {
    e = norm_scale_exponent<acc_t>(amax);
    f = r.fast(e);
  }
  out.s = static_cast<double>(f.s);
  out.e = f.s == acc_t(0) ? 0 : e;
  return out;
}

// ---------------------------------------------------------------------------------------
// Careful path (general p only). Sweep 1 over every value of the piece:
struct CarefulNorm {
  double amax;  // largest finite |x|
  int32_t flags;
};

HS_HD CarefulNorm careful_norm_init() { CarefulNorm c; c.amax = 0.0; c.flags = 0; return c; }

HS_HD void careful_norm_scan(CarefulNorm& c, double v) {
  if (v != v) { c.flags |= kNormHasNan; return; }
  const double a = fabs(v);
  if (a == static_cast<double>(INFINITY)) { c.flags |= kNormHasInf; return; }
  c.amax = hs_fmax(c.amax, a);
}

// The exponent of sweep 2: 2^e >= amax, or 0 when the values need no scaling.
HS_HD int32_t careful_norm_exponent(const CarefulNorm& c, const NormSpec& ns) {
  if (ns.kind == kNormInf || c.amax == 0.0) return 0;
  if (ns.kind != kNormP && c.amax <= 1.0e100 && c.amax >= 1.0e-100) return 0;
  int ex;
  frexp(c.amax, &ex);
  return ex;
}

// Sweep 2: the term of one value (0 for NaN/Inf, which the flags already decide).
HS_HD double careful_norm_term(double v, int32_t e, const NormSpec& ns) {
  const double a = fabs(v);
  if (!(a - a == 0.0)) return 0.0;
  const double y = e == 0 ? a : ldexp(a, -e);
  switch (ns.kind) {
    case kNorm1: return y;
    case kNorm2: return y * y;
    case kNormP: return y == 0.0 ? 0.0 : pow(y, ns.p);
    default: return 0.0;
  }
}

HS_HD NormPartial careful_norm_partial(const CarefulNorm& c, double s, int32_t e, const NormSpec& ns) {
  NormPartial n;
  n.flags = c.flags;
  n.e = e;
  n.s = ns.kind == kNormInf ? c.amax : s;
  return n;
}

// ---------------------------------------------------------------------------------------
// Clipping.
enum NonfinitePolicy : int { kPropagate = 0, kZero = 1 };

// The factor x is multiplied by: PyTorch's min(1, max_norm / (norm + eps)), computed in
// double; NaN stays NaN (as torch.clamp(max=1) keeps it). Under kZero a non-finite norm gives
// 0, and scale_value() then writes zeros (0 * inf would be NaN).
HS_HD double clip_coef(double norm, double max_norm, double eps, int policy) {
  if (policy == kZero && !(norm - norm == 0.0)) return 0.0;
  const double c = max_norm / (norm + eps);
  return c > 1.0 ? 1.0 : c;
}

// Whether clip_coef() leaves x as it is: multiplying by 1 changes no bit, so the scale pass
// can skip writing.
HS_HD bool coef_is_identity(double coef) { return coef == 1.0; }

// Note [coefficient one]
// The scale pass multiplies in acc_t (float for fp16/bf16/fp32 tensors, double for fp64), so a
// float64 coefficient such as 1 - 1e-9 is exactly 1 once rounded to float, and multiplying by it
// would rewrite every element with the bits it already has. Every scale kernel (CPU, CUDA
// two-launch, CUDA fused) asks this, per tensor dtype, after reading the coefficient (on the
// device, so no host sync), and writes nothing when it says so; the README promises it.
template <typename acc_t>
HS_HD bool scale_is_identity(double coef, bool zero) {
  return !zero && static_cast<acc_t>(coef) == acc_t(1);
}

template <typename acc_t>
HS_HD acc_t scale_value(acc_t v, acc_t coef, bool zero) { return zero ? acc_t(0) : v * coef; }

// Clamping to [lo, hi] with lo <= hi already rounded to x's dtype, so the result is one of
// x, lo, hi and needs no rounding. NaN stays NaN and is not counted as clipped.
template <typename acc_t>
HS_HD acc_t clamp_value(acc_t v, acc_t lo, acc_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

template <typename acc_t>
HS_HD bool is_clipped(acc_t v, acc_t lo, acc_t hi) { return v < lo || v > hi; }

}  // namespace hookstats
