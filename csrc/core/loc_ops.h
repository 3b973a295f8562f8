// Torch-free element locations shared by the CPU and the CUDA kernels (hookstats::stats_loc,
// stats_into(..., loc=)).
//
// Note [element locations]
// Beside the statistics, a kernel asked for locations finds two flat indices of x (positions in
// x's logical row-major order, what x.flatten() indexes, whatever the strides), as int64:
//   * argmax_abs: the first element of largest |x|. NaN is never a candidate; +-Inf counts as
//     the largest |x|. -1 when x has no non-NaN element (empty or all NaN);
//   * first_nonfinite: the first NaN or +-Inf, -1 when there is none.
// "First" is the smallest index: ties of |x| go to the smaller index. A LocPartial is the
// answer for one piece of x; merge() is associative and commutative (it compares values, then
// indices), so the result does not depend on how x was cut or in which order pieces merge:
// bit-identical whatever the thread count or grid. Kernels that read x in another order than
// the logical one (a dense permuted tensor is read in memory order) read it in logical order
// instead when locations are asked for (Note [layouts]), so a piece's elements carry their
// logical index. Without locations the kernels are the ones they always were.
#pragma once

#include <cstdint>

#include "stats_ops.h"  // HS_HD

namespace hookstats {

struct LocPartial {
  double amax;     // largest |x| over the non-NaN elements seen; -1 when none
  int64_t amax_i;  // its smallest index, -1 when none
  int64_t nf_i;    // smallest index of a NaN/Inf, -1 when none
};

HS_HD LocPartial empty_loc() {
  LocPartial l;
  l.amax = -1.0;
  l.amax_i = -1;
  l.nf_i = -1;
  return l;
}

// Whether (va, ia) beats (vb, ib) as argmax |x|: a larger value, or the same value at a smaller index.
HS_HD bool loc_better(double va, int64_t ia, double vb, int64_t ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  return va > vb || (va == vb && ia < ib);
}

HS_HD void loc_merge(LocPartial& a, const LocPartial& b) {
  if (loc_better(b.amax, b.amax_i, a.amax, a.amax_i)) {
    a.amax = b.amax;
    a.amax_i = b.amax_i;
  }
  if (b.nf_i >= 0 && (a.nf_i < 0 || b.nf_i < a.nf_i)) a.nf_i = b.nf_i;
}

// What one thread (CUDA) or one CPU task gathers element by element, in the accumulation type:
// the same answer as a LocPartial, compared without conversions.
template <typename acc_t>
struct LocAcc {
  acc_t amax;      // -1 when no non-NaN element was seen
  int64_t amax_i;  // -1 when none
  int64_t nf_i;    // -1 when none
};

template <typename acc_t>
HS_HD void loc_init(LocAcc<acc_t>& l) {
  l.amax = acc_t(-1);
  l.amax_i = -1;
  l.nf_i = -1;
}

// One element v at flat index i. Any visiting order gives the same result.
template <typename acc_t>
HS_HD void loc_add(LocAcc<acc_t>& l, acc_t v, int64_t i) {
  if (v != v) {  // NaN: a first-non-finite candidate only
    if (l.nf_i < 0 || i < l.nf_i) l.nf_i = i;
    return;
  }
  const acc_t a = v < acc_t(0) ? -v : v;
  if (a == static_cast<acc_t>(INFINITY) && (l.nf_i < 0 || i < l.nf_i)) l.nf_i = i;
  if (a > l.amax || (a == l.amax && i < l.amax_i)) {
    l.amax = a;
    l.amax_i = i;
  }
}

template <typename acc_t>
HS_HD LocPartial loc_to_partial(const LocAcc<acc_t>& l) {
  LocPartial p;
  p.amax = static_cast<double>(l.amax);
  p.amax_i = l.amax_i;
  p.nf_i = l.nf_i;
  return p;
}

// The two results, in the order of a location row: (argmax_abs, first_nonfinite).
HS_HD void store_loc(const LocPartial& l, int64_t* out) {
  out[0] = l.amax_i;
  out[1] = l.nf_i;
}

}  // namespace hookstats
