// A CPU chunk's histogram counters (Note [cpu histogram counters]) and counting a chunk in registers (Note [one-hot
// chunk counts]): the AVX2 and AVX-512 entry points' counting pass for the exponent histogram and for range
// histograms of up to kOneHotMaxBins bins. Included by cpu/hist_chunk.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../core/hist_ops.h"
#include "simd.h"

namespace hookstats {
namespace cpu {

// Note [cpu histogram counters]
// A chunk is binned in two passes: its counter indices go into a 16 KB buffer (SIMD, or table loads),
// then a counting pass (count_keys) increments, for value j of each run of 64, copy j % copies of
// the `copies` uint32 copies of the histogram that the thread holds. So runs of values in one bin do
// not serialize on one counter's store-to-load latency, and data that alternates at random between a
// few bins (ReLU outputs, values around an edge) does not defeat the CPU's memory-dependence
// prediction: a bare `c[idx[i]] += 1` loop (torch.bincount) is 2-2.5x slower on such data than on
// spread data, this pass is not. A run of 64 equal indices is one addition. The copies are added
// into the thread's int64 totals before any counter can wrap (every 2^31 increments) and at the end;
// threads' totals are summed last. Counts are integers: the result does not depend on threads or
// order.
struct HistCounters {
  uint32_t* c;     // copies x len
  int64_t* total;  // len
  int64_t len;
  int copies;      // power of two
  int64_t pending;
};

inline void flush_counters(HistCounters& h) {
  const int64_t len = h.len;
  int64_t* __restrict__ total = h.total;
  for (int r = 0; r < h.copies; ++r) {
    uint32_t* __restrict__ c = h.c + r * len;
    for (int64_t i = 0; i < len; ++i) total[i] += c[i];
    std::memset(c, 0, static_cast<size_t>(len) * sizeof(uint32_t));
  }
  h.pending = 0;
}


// Note [one-hot chunk counts]
// A chunk's values fall in few slots: its exponents lie within 31 of the largest (randn's 2^20 values span about
// 25), a 64-bin range histogram has 67 counters. So a chunk's counter indices are first mapped to 64 keys (per
// chunk, from the chunk's min or largest |x|, which its statistics give: a window of indices, plus fixed keys for
// zero and NaN), and each value adds the one-hot word 1 << key (a 64-bit lane) to a bit-sliced counter: levels of
// 64-bit lanes, level l holding bit l of each (lane, key) count, added by carry-save adders (Harley-Seal: 15
// adders of two logic instructions each per 16 words, vpternlogq on AVX-512), so no value costs a store. At the
// chunk's end the levels are summed over the lanes and written to the 64 keys' counters. A value whose index has
// no key (an exponent more than 31 below the largest, a subnormal, an infinity, a bin outside the window: rare in
// most data) has key 64, whose one-hot word is 0 (vpsllv gives 0 for counts >= 64), and is counted by the exact
// per-value path instead. Counts are integers: the result is the same as value-by-value counting's, bit for bit.
constexpr int kOneHotKeys = 64;
constexpr int kOneHotDeep = 6;  // levels above the 4 of a Harley-Seal group: 15 + 16 * 63 >= 1023 per lane and key
constexpr int64_t kOneHotMaxBins = 64;

template <int B>
struct OneHotTypes {
  using I = typename simd::VT<B>::i32;
  using U = typename simd::VT<B>::u32;
};

// 1 << k per 32-bit lane, 0 where k >= 32 as unsigned (vpsllvd).
template <int B>
HS_INLINE typename OneHotTypes<B>::U onehot_of(const typename OneHotTypes<B>::I& k) {
  using U = typename OneHotTypes<B>::U;
  using I = typename OneHotTypes<B>::I;
#if HS_X86_BUILTINS
  if constexpr (B == 64) return (U)__builtin_ia32_psllv16si_mask(I{} + 1, k, I{}, (unsigned short)0xFFFF);
  if constexpr (B == 32) return (U)__builtin_ia32_psllv8si(I{} + 1, k);
#endif
  return ((U)k < 32u) ? (U{} + 1u) << ((U)k & 31u) : U{};
}

// Full adder on every bit: sum a ^ b ^ c, carry maj(a, b, c) (one vpternlogd each on AVX-512).
template <int B, typename Q>
HS_INLINE void csa(Q& carry, Q& sum, const Q& a, const Q& b, const Q& c) {
#if HS_X86_BUILTINS
  if constexpr (B == 64) {
    typedef int v16si __attribute__((vector_size(64)));
    const Q h = (Q)__builtin_ia32_pternlogd512_mask((v16si)a, (v16si)b, (v16si)c, 0xE8, (unsigned short)0xFFFF);
    sum = (Q)__builtin_ia32_pternlogd512_mask((v16si)a, (v16si)b, (v16si)c, 0x96, (unsigned short)0xFFFF);
    carry = h;
    return;
  }
#endif
  const Q u = a ^ b;
  const Q h = (a & b) | (u & c);
  sum = u ^ c;
  carry = h;
}

// The bit-sliced counts of 32 keys in the W 32-bit lanes of a B-byte vector: ones .. eights of the current
// Harley-Seal group, deep levels above.
template <int B>
struct SlicedCounts {
  using U = typename OneHotTypes<B>::U;
  U ones, twos, fours, eights;
  U deep[kOneHotDeep];
  HS_INLINE void zero() {
    ones = twos = fours = eights = U{};
    for (auto& d : deep) d = U{};
  }
  // Adds the one-hot words d[0, 16).
  HS_INLINE void add16(const U* d) {
    U twosA, twosB, foursA, foursB, eightsA, eightsB, sixteens;
    csa<B>(twosA, ones, ones, d[0], d[1]);
    csa<B>(twosB, ones, ones, d[2], d[3]);
    csa<B>(foursA, twos, twos, twosA, twosB);
    csa<B>(twosA, ones, ones, d[4], d[5]);
    csa<B>(twosB, ones, ones, d[6], d[7]);
    csa<B>(foursB, twos, twos, twosA, twosB);
    csa<B>(eightsA, fours, fours, foursA, foursB);
    csa<B>(twosA, ones, ones, d[8], d[9]);
    csa<B>(twosB, ones, ones, d[10], d[11]);
    csa<B>(foursA, twos, twos, twosA, twosB);
    csa<B>(twosA, ones, ones, d[12], d[13]);
    csa<B>(twosB, ones, ones, d[14], d[15]);
    csa<B>(foursB, twos, twos, twosA, twosB);
    csa<B>(eightsB, fours, fours, foursA, foursB);
    csa<B>(sixteens, eights, eights, eightsA, eightsB);
    U c = sixteens;
    for (int l = 0; l < kOneHotDeep; ++l) {
      const U t = deep[l] & c;
      deep[l] ^= c;
      c = t;
    }
  }
  // Adds the count of each of the 32 keys, summed over the lanes, to out[0, 32): the lanes' bit-sliced numbers
  // are added pairwise (a ripple-carry add per level, halving the lanes each time), then expanded per key.
  HS_INLINE void add_to(uint32_t* out) const {
    constexpr int W = B / 4, L = 4 + kOneHotDeep, LT = L + 5;  // + log2(W) bits for the sum over the lanes
    uint32_t lv[LT][W] = {};
    std::memcpy(lv[0], &ones, sizeof ones);
    std::memcpy(lv[1], &twos, sizeof twos);
    std::memcpy(lv[2], &fours, sizeof fours);
    std::memcpy(lv[3], &eights, sizeof eights);
    for (int l = 0; l < kOneHotDeep; ++l) std::memcpy(lv[4 + l], &deep[l], sizeof deep[l]);
    for (int w = W / 2; w >= 1; w /= 2) {
      uint32_t c[W] = {};
      for (int l = 0; l < LT; ++l) {
        for (int j = 0; j < w; ++j) {
          const uint32_t a = lv[l][j], b = lv[l][j + w], u = a ^ b;
          lv[l][j] = u ^ c[j];
          c[j] = (a & b) | (u & c[j]);
        }
      }
    }
    for (int l = 0; l < LT; ++l) {
      const uint32_t word = lv[l][0];
      if (word == 0) continue;
      for (uint32_t b = 0; b < 32; ++b) out[b] += ((word >> b) & 1u) << l;
    }
  }
};

// Counts nvec vectors into out[0, 64) (added) and returns how many of their lanes it did not count. offsets(i, kp,
// kn) gives vector i's W int32 lanes twice: a lane counts for key kp where kp < 32 (unsigned), for key 32 + kn
// where kn < 32, and not at all where neither is (1 << kp and 1 << kn by vpsllvd, which gives 0 for counts >= 32:
// no compare, no blend). A (lane, key) count grows by at most 1 a vector: nvec <= 1023 keeps it within the levels
// (kChunk / W is 256 or 512).
template <int B, typename OffsetFn>
HS_INLINE int64_t count_onehot(int64_t nvec, OffsetFn&& offsets, uint32_t* out) {
  using I = typename OneHotTypes<B>::I;
  using U = typename OneHotTypes<B>::U;
  SlicedCounts<B> lo, hi;
  lo.zero();
  hi.zero();
  I missed{};
  auto group = [&](int64_t i, int gv) __attribute__((always_inline)) {
    U dlo[16], dhi[16];
    for (int u = 0; u < 16; ++u) {
      if (u < gv) {
        I kp, kn;
        offsets(i + u, kp, kn);
        dlo[u] = onehot_of<B>(kp);
        dhi[u] = onehot_of<B>(kn);
        const I none = (I)(dlo[u] | dhi[u]);
#if HS_X86_BUILTINS
        if constexpr (B == 64) {
          missed = simd::k16::add_where(simd::k16::cmpu<0 /*EQ*/>(none, I{}), missed, I{} + 1);
          continue;
        }
#endif
        missed -= (I)(none == 0);
      } else {
        dlo[u] = dhi[u] = U{};
      }
    }
    lo.add16(dlo);
    hi.add16(dhi);
  };
  int64_t i = 0;
  for (; i + 16 <= nvec; i += 16) group(i, 16);
  if (i < nvec) group(i, static_cast<int>(nvec - i));
  lo.add_to(out);
  hi.add_to(out + 32);
  int64_t m = 0;
  for (int j = 0; j < B / 4; ++j) m += missed[j];
  return m;
}

// Note [one-hot chunk counts] for the exponent histogram of float32 and bfloat16 inputs: keys 0..31 are the positive
// normals of exponents lo .. lo + 31 (the 32 at and below the chunk's largest |x|, amax), 32..63 the negative ones
// (offsets from the 9 sign and exponent bits, t - lo and t - lo - 256). Zeros and NaNs come from the chunk's
// statistics (zero, nan); a value of another exponent, a subnormal or an infinity, which no key counts, makes the
// chunk counted again value by value, for those values alone.
template <int B, typename scalar_t>
HS_INLINE void exp_chunk_onehot(const scalar_t* p, int64_t n, HistCounters& h, double amax, int64_t zero,
                                int64_t nan) {
  using I = typename OneHotTypes<B>::I;
  using U = typename OneHotTypes<B>::U;
  constexpr int W = B / 4;
  constexpr int32_t nE = 254;
  int ex = 0;
  std::frexp(amax, &ex);  // amax = m 2^ex, 1/2 <= m < 1
  const int top = amax > 0.0 && amax - amax == 0.0 ? ex - 1 + 127 : 254;
  const int32_t lo = std::min(std::max(top - 31, 1), 223);  // [lo, lo + 31] within the normals 1..254
  auto bits = [&](int64_t i) __attribute__((always_inline)) -> U {
    U u;
    if constexpr (sizeof(scalar_t) == 4) {
      std::memcpy(&u, p + i * W, sizeof u);
    } else {
      typename simd::VT<B>::u16 r;
      std::memcpy(&r, p + i * W, sizeof r);
      u = __builtin_convertvector(r, U) << 16;  // bf16: the float32 layout
    }
    return u;
  };
  auto offsets = [&](int64_t i, I& kp, I& kn) __attribute__((always_inline)) {
    const I t = (I)(bits(i) >> 23);
    kp = t - lo;
    kn = t - (lo + 256);
  };
  uint32_t cnt[kOneHotKeys] = {};
  const int64_t nvec = n / W;
  const int64_t missed = count_onehot<B>(nvec, offsets, cnt);
  int64_t tail_special = 0;
  auto count_one = [&](uint32_t u) {
    const uint32_t a = u & 0x7fffffffu;
    if (a == 0 || a > 0x7f800000u) {
      ++tail_special;
      return;
    }
    h.c[exp_slot<8, 23>(u)] += 1;
  };
  for (int64_t i = nvec * W; i < n; ++i) {
    uint32_t u;
    if constexpr (sizeof(scalar_t) == 4) std::memcpy(&u, p + i, 4);
    else u = static_cast<uint32_t>(p[i].x) << 16;
    count_one(u);
  }
  if (missed > zero + nan - tail_special) {  // values outside the window: count them
    tail_special = 0;
    for (int64_t i = 0; i < nvec; ++i) {
      const U u = bits(i);
      for (int j = 0; j < W; ++j) {
        const uint32_t t = u[j] >> 23;
        if (t - static_cast<uint32_t>(lo) >= 32u && t - static_cast<uint32_t>(lo + 256) >= 32u) count_one(u[j]);
      }
    }
  }
  for (int k = 0; k < 32; ++k) {
    if (cnt[k]) h.c[nE + lo + k - 1] += cnt[k];
    if (cnt[32 + k]) h.c[lo + k - 1] += cnt[32 + k];
  }
  h.c[2 * nE + 2] += static_cast<uint32_t>(zero);
  h.c[2 * nE + 5] += static_cast<uint32_t>(nan);
}

// Note [one-hot chunk counts] over n counter indices (range ordinals or slots): keys 0..63 are indices kb .. kb + 63
// (kb: the index of the chunk's least value); NaN, when its index nan_idx is outside, comes from the chunk's count
// (nan); other indices make the chunk's indices read again, for those alone.
template <int B>
HS_INLINE void count_indices_onehot(const int32_t* idx, int64_t n, HistCounters& h, int32_t kb, int32_t nan_idx,
                                    int64_t nan) {
  using I = typename OneHotTypes<B>::I;
  constexpr int W = B / 4;
  auto offsets = [&](int64_t i, I& kp, I& kn) __attribute__((always_inline)) {
    I o;
    std::memcpy(&o, idx + i * W, sizeof o);
    kp = o - kb;
    kn = o - (kb + 32);
  };
  uint32_t cnt[kOneHotKeys] = {};
  const int64_t nvec = n / W;
  const int64_t missed = count_onehot<B>(nvec, offsets, cnt);
  const bool nan_apart = static_cast<uint32_t>(nan_idx - kb) >= 64u;
  int64_t tail_nan = 0;
  for (int64_t i = nvec * W; i < n; ++i) {
    if (nan_apart && idx[i] == nan_idx) ++tail_nan;
    else h.c[idx[i]] += 1;
  }
  if (missed > (nan_apart ? nan - tail_nan : 0)) {
    for (int64_t i = 0; i < nvec * W; ++i) {
      const int32_t o = idx[i];
      if (static_cast<uint32_t>(o - kb) >= 64u && o != nan_idx) h.c[o] += 1;
    }
  }
  for (int k = 0; k < 64; ++k) {
    if (cnt[k]) h.c[kb + k] += cnt[k];
  }
  if (nan_apart) h.c[nan_idx] += static_cast<uint32_t>(nan);
}

}  // namespace cpu
}  // namespace hookstats
