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

// The CPU kernels' chunk: the unit of reading, of the statistics' partials and of binning.
constexpr int64_t kChunk = 4096;

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
  // Note [one-hot chunk counts]: the bit-sliced counts carried from chunk to chunk (kSlicedWords, zero while
  // base[0] is -1), the counter index of each plane's key 0, and the chunks added since they were last folded.
  uint32_t* sliced;
  int32_t base[2];
  int32_t sliced_chunks;
};

constexpr int kOneHotDeep = 8;  // levels above the 4 of a Harley-Seal group: a (lane, key) count < 16 * 2^8
constexpr int kSlicedLevels = 4 + kOneHotDeep;
constexpr int kSlicedWords = 2 * kSlicedLevels * 16;  // 2 planes x levels x 16 lanes

// Adds the carried bit-sliced counts to copy 0 of the counters and empties them: each plane's 16 lanes are added
// as bit-sliced numbers (a ripple-carry add per level, halving the lanes each time), then expanded per key.
inline void fold_sliced(HistCounters& h) {
  if (h.base[0] < 0) return;
  constexpr int LT = kSlicedLevels + 4;  // + log2(16) bits for the sum over the lanes
  for (int plane = 0; plane < 2; ++plane) {
    uint32_t lv[LT][16] = {};
    std::memcpy(lv, h.sliced + plane * kSlicedLevels * 16, sizeof(uint32_t) * kSlicedLevels * 16);
    for (int w = 8; w >= 1; w /= 2) {
      uint32_t c[16] = {};
      for (int l = 0; l < LT; ++l) {
        for (int j = 0; j < w; ++j) {
          const uint32_t a = lv[l][j], b = lv[l][j + w], u = a ^ b;
          lv[l][j] = u ^ c[j];
          c[j] = (a & b) | (u & c[j]);
        }
      }
    }
    uint32_t out[32] = {};
    for (int l = 0; l < LT; ++l) {
      const uint32_t word = lv[l][0];
      if (word == 0) continue;
      for (uint32_t b = 0; b < 32; ++b) out[b] += ((word >> b) & 1u) << l;
    }
    for (int k = 0; k < 32; ++k) {
      if (out[k]) h.c[h.base[plane] + k] += out[k];
    }
  }
  std::memset(h.sliced, 0, sizeof(uint32_t) * kSlicedWords);
  h.base[0] = h.base[1] = -1;
  h.sliced_chunks = 0;
}

inline void flush_counters(HistCounters& h) {
  fold_sliced(h);
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
// The AVX2 and AVX-512 entry points count the exponent histogram (float32, bfloat16) and range histograms of up to
// kOneHotMaxBins bins without a store per value. A chunk's values fall in few counters: its exponents lie within 31
// of its largest |x| (randn's span about 25), a 64-bin histogram has 67 counters. So each value's counter index is
// turned into two offsets from a window of 64 indices: exponents lo .. lo + 31 of either sign (from the 9 sign and
// exponent bits t: t - lo and t - lo - 256), or range indices kb .. kb + 63 (o - kb and o - kb - 32). 1 << offset
// (vpsllvd: 0 for offsets >= 32) is a one-hot word per 32-bit lane for each of two planes of 32 keys, added to a
// bit-sliced counter: level l of a plane holds bit l of every (lane, key) count, added by carry-save adders
// (Harley-Seal: 15 full adders of two logic instructions per 16 words, one vpternlogd each on AVX-512). The levels
// are carried from chunk to chunk (HistCounters::sliced) while the window holds the chunk (the window is chosen from
// the chunk's statistics: its largest |x|, or its least and greatest index) and folded into the counters
// (fold_sliced: the lanes added as bit-sliced numbers, then expanded per key) when it moves, before a count could
// outgrow the levels, and at the end. Zeros and NaNs of the exponent histogram come from the chunk's statistics, as
// do NaNs outside a range window. A lane that no key counts is counted by the vector loop too; when more lanes are
// uncounted than the chunk's zeros and NaNs explain (a value far below the largest, a subnormal, an infinity, a bin
// outside the window: rare in most data), the chunk's values outside the window are counted again one by one. Counts
// are integers: the result is bit for bit the per-value counting's, on every level.
constexpr int kOneHotKeys = 64;
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
  HS_INLINE void load(const uint32_t* m) {
    std::memcpy(&ones, m, sizeof(U));
    std::memcpy(&twos, m + 16, sizeof(U));
    std::memcpy(&fours, m + 32, sizeof(U));
    std::memcpy(&eights, m + 48, sizeof(U));
    for (int l = 0; l < kOneHotDeep; ++l) std::memcpy(&deep[l], m + 16 * (4 + l), sizeof(U));
  }
  HS_INLINE void store(uint32_t* m) const {
    std::memcpy(m, &ones, sizeof(U));
    std::memcpy(m + 16, &twos, sizeof(U));
    std::memcpy(m + 32, &fours, sizeof(U));
    std::memcpy(m + 48, &eights, sizeof(U));
    for (int l = 0; l < kOneHotDeep; ++l) std::memcpy(m + 16 * (4 + l), &deep[l], sizeof(U));
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
};

// Counts nvec vectors into the bit-sliced counts that h carries (their key 0 at counter index base_p, key 32 at
// base_n) and returns how many of their lanes it did not count. offsets(i, kp,
// kn) gives vector i's W int32 lanes twice: a lane counts for key kp where kp < 32 (unsigned), for key 32 + kn
// where kn < 32, and not at all where neither is (1 << kp and 1 << kn by vpsllvd, which gives 0 for counts >= 32:
// no compare, no blend). A (lane, key) count grows by at most 1 a vector: nvec <= 1023 keeps it within the levels
// (kChunk / W is 256 or 512).
template <int B, typename OffsetFn>
HS_INLINE int64_t count_onehot(int64_t nvec, OffsetFn&& offsets, HistCounters& h, int32_t base_p, int32_t base_n) {
  using I = typename OneHotTypes<B>::I;
  using U = typename OneHotTypes<B>::U;
  if (h.base[0] != base_p || h.base[1] != base_n) {  // another window: the carried counts go to their counters
    fold_sliced(h);
    h.base[0] = base_p;
    h.base[1] = base_n;
  }
  SlicedCounts<B> lo, hi;
  lo.load(h.sliced);
  hi.load(h.sliced + kSlicedLevels * 16);
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
  lo.store(h.sliced);
  hi.store(h.sliced + kSlicedLevels * 16);
  // A chunk adds at most kChunk / W to a (lane, key) count; the levels hold 16 * 2^kOneHotDeep - 1.
  if (++h.sliced_chunks >= ((16 << kOneHotDeep) - 1) / (kChunk / (B / 4))) fold_sliced(h);
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
  // [lo, lo + 31] within the normals 1..254; the last chunk's window while it has at most 3 exponents above top
  const int32_t last = h.base[1] + 1;
  const int32_t lo = h.base[1] >= 0 && top >= last + 28 && top <= last + 31 ? last : std::min(std::max(top - 31, 1), 223);
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
  const int64_t nvec = n / W;
  const int64_t missed = count_onehot<B>(nvec, offsets, h, nE + lo - 1, lo - 1);
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
  const int64_t nvec = n / W;
  const int64_t missed = count_onehot<B>(nvec, offsets, h, kb, kb + 32);
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
  if (nan_apart) h.c[nan_idx] += static_cast<uint32_t>(nan);
}

}  // namespace cpu
}  // namespace hookstats
