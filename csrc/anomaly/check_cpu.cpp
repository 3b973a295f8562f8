// The CPU check of one op output (hookstats.detect_nonfinite): the output is read once, on the fast path
// as raw bits in blocks whose "any exponent all ones" test vectorises; only a block that holds a NaN/Inf
// (once a run, since a device's first hit ends its checks) is read again element by element for the
// counts, the first index and the inputs. Note [nonfinite guard state] in nonfinite_ops.h.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "device_fns.h"
#include "nonfinite_ops.h"

namespace hookstats {
namespace anomaly {
namespace {

constexpr int64_t kBlock = 4096;          // elements tested per any-scan block
constexpr int64_t kParallelMin = 1 << 18;  // below this an output is scanned on the calling thread
constexpr int kMaxTasks = 64;

std::mutex& commit_mutex() {
  static std::mutex mu;
  return mu;
}

// The first block of [lo, hi) (memory order) holding a non-finite element, or hi (nf_carry: AND, ADD, OR), compiled
// for AVX2 and for the baseline, chosen at load time.
template <typename U>
inline __attribute__((always_inline)) int64_t first_bad_block_body(const U* x, int64_t lo, int64_t hi, U exp) {
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t e = std::min(hi, b + kBlock);
    U acc = 0;
    for (int64_t i = b; i < e; ++i) acc |= nf_carry(x[i], exp);
    if (carry_nonfinite(acc)) return b;
  }
  return hi;
}

#define HS_BAD_BLOCK(U)                                                                      \
  __attribute__((target_clones("avx2", "default"))) int64_t first_bad_block(const U* x, int64_t lo, \
                                                                             int64_t hi, U exp) { \
    return first_bad_block_body<U>(x, lo, hi, exp);                                         \
  }
HS_BAD_BLOCK(uint16_t)
HS_BAD_BLOCK(uint32_t)
HS_BAD_BLOCK(uint64_t)
#undef HS_BAD_BLOCK

// The first memory offset at which a block holds a non-finite element, or n; parallel over fixed tasks.
template <typename U>
int64_t scan_dense(const U* x, int64_t n, U exp) {
  if (n < kParallelMin) return first_bad_block(x, 0, n, exp);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int tasks = static_cast<int>(std::min<int64_t>(kMaxTasks, blocks));
  const int64_t per = (blocks + tasks - 1) / tasks * kBlock;
  int64_t found[kMaxTasks];
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
      found[t] = first_bad_block(x, lo, hi, exp);
      if (found[t] == hi) found[t] = n;
    }
  });
  return *std::min_element(found, found + tasks);
}

template <typename U>
NfAcc count_dense(const CheckLaunch& c, int64_t from) {
  const U* x = static_cast<const U*>(c.data);
  const U exp = static_cast<U>(c.masks.exp), man = static_cast<U>(c.masks.man);
  NfAcc a;
  nf_init(a);
  for (int64_t i = from; i < c.numel; ++i) {
    if (!bits_nonfinite(x[i], exp)) continue;
    const int64_t logical = c.mode == kFlat ? i : logical_from_offset(i, c.ndim, c.sizes, c.strides);
    nf_add(a, x[i], exp, man, logical);
  }
  return a;
}

// kStrided: logical order, element by element (outputs that are neither dense nor views are rare).
template <typename U>
NfAcc scan_strided(const CheckLaunch& c) {
  const U* x = static_cast<const U*>(c.data);
  const U exp = static_cast<U>(c.masks.exp), man = static_cast<U>(c.masks.man);
  NfAcc a;
  nf_init(a);
  for (int64_t i = 0; i < c.numel; ++i) {
    const U b = x[element_offset(c.lay, i)];
    nf_add(a, b, exp, man, i);
  }
  return a;
}

template <typename U>
NfAcc scan(const CheckLaunch& c) {
  if (c.mode == kStrided) return scan_strided<U>(c);
  const int64_t from = scan_dense(static_cast<const U*>(c.data), c.numel, static_cast<U>(c.masks.exp));
  NfAcc a;
  nf_init(a);
  if (from < c.numel) a = count_dense<U>(c, from);
  return a;
}

int64_t bad_inputs(const CheckLaunch& c) {
  int64_t bits = 0;
  for (int k = 0; k < c.n_inputs; ++k) {
    for (int64_t i = 0; i < c.in_numel[k]; ++i) {
      if (input_nonfinite(c.in_data[k], c.in_masks[k], i)) {
        bits |= int64_t(1) << k;
        break;
      }
    }
  }
  return bits;
}

}  // namespace

void check_cpu(const CheckLaunch& c) {
  int64_t* s = c.state;
  if (__atomic_load_n(&s[kFound], __ATOMIC_ACQUIRE) != 0) return;  // this device has its first hit
  NfAcc a;
  switch (c.masks.bytes) {
    case 8: a = scan<uint64_t>(c); break;
    case 4: a = scan<uint32_t>(c); break;
    default: a = scan<uint16_t>(c); break;
  }
  if (!nf_hit(a)) return;
  const int64_t bad = bad_inputs(c);
  std::lock_guard<std::mutex> lock(commit_mutex());
  if (s[kFound] != 0) return;  // another thread's op came first
  write_meta(s, c.meta);
  s[kNan] = a.nan;
  s[kInf] = a.inf;
  s[kFirst] = a.first;
  s[kInputs] = c.n_inputs;
  s[kBadInputs] = bad;
  __atomic_store_n(&s[kFound], c.meta.order, __ATOMIC_RELEASE);
}

}  // namespace anomaly
}  // namespace hookstats
