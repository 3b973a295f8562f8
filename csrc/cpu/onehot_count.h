// A CPU chunk's histogram counters (Note [cpu histogram counters]) and counting a chunk in registers (Note [one-hot
// chunk counts]): the AVX2 and AVX-512 entry points' counting pass for range histograms of up to kOneHotMaxBins bins,
// and the machinery the exponent histogram's pass (cpu/exp_onehot.h) shares. Included by cpu/hist_chunk.h.
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
  int64_t sliced_total;  // how many values the bit-sliced counts hold (their population count, weighted)
  bool keys16;           // the bit-sliced counts are of 16-bit lanes: bit b of a 32-bit word is key b % 16
  int32_t narrow_wait;   // Note [narrow exponent windows]: chunks to count in the wide window before trying again
  int32_t onehot_wait;   // Note [one-hot misses]: chunks to count value by value before trying the window again
};

constexpr int kOneHotGroupLevels = 5;  // ones .. sixteens: a Harley-Seal group of 32 words
constexpr int kOneHotDeep = 7;  // levels above the group's: a (lane, key) count < 32 * 2^7
constexpr int kSlicedLevels = kOneHotGroupLevels + kOneHotDeep;
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
      if (out[k]) h.c[h.base[plane] + (h.keys16 ? k & 15 : k)] += out[k];
    }
  }
  std::memset(h.sliced, 0, sizeof(uint32_t) * kSlicedWords);
  h.base[0] = h.base[1] = -1;
  h.sliced_chunks = 0;
  h.sliced_total = 0;
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
// (Harley-Seal: 31 full adders of two logic instructions per 32 words, one vpternlogd each on AVX-512; the group's
// carries of weight 32 ripple into the deep levels, two instructions a level, once per 32 words). The levels
// are carried from chunk to chunk (HistCounters::sliced) while the window holds the chunk (the window is chosen from
// the chunk's statistics: its largest |x|, or its least and greatest index) and folded into the counters
// (fold_sliced: the lanes added as bit-sliced numbers, then expanded per key) when it moves, before a count could
// outgrow the levels, and at the end. Zeros and NaNs of the exponent histogram come from the chunk's statistics, as
// do NaNs outside a range window. How many of the chunk's values the keys counted is read off the levels, not
// counted per vector: the growth of their population count (a bit of level l weighs 2^l; popcounts of the 24 level
// words, once a chunk, against the total carried in HistCounters::sliced_total). When more values are
// uncounted than the chunk's zeros and NaNs explain (a value far below the largest, a subnormal, an infinity, a bin
// outside the window: rare in most data), the chunk's values outside the window are counted again one by one. Counts
// are integers: the result is bit for bit the per-value counting's, on every level.
// Cost, per vector on AVX-512: one shift for t (bfloat16: one vpmovzxwd and a shift), two subtractions, two vpsllvd,
// ~3.9 vpternlogd and ~1 logic instruction for the deep levels. The one-hot words are made right before their adder
// takes them and each adder overwrites only operands that are dead (csa), so nothing spills and nothing is copied
// (the first version, all 32 words made first and a copy per adder, spilled the group levels to the stack). The loop
// is at the vector pipes' throughput (~3.5 instructions a cycle measured): fewer instructions per value, not another
// schedule, make it faster, hence Note [narrow exponent windows] on AVX-512.
constexpr int kOneHotKeys = 64;
constexpr int64_t kOneHotMaxBins = 64;

// Note [one-hot misses]
// Data whose chunks do not fit a window (a range histogram of values far outside its range on both sides, 64 bins'
// underflow and overflow counters 65 apart; exponents spread over more than 32 binades: gradients of mixed scales,
// randn * 1e30 next to randn * 1e-30) leaves most of a chunk to the second read, which was a branch per value on a
// coin flip: 38x the time of randn for the exponent histogram, 15x for the range one (2^20 float32, 5 ms). The second
// read is branch-free (an increment of 0 or 1 per value), and a chunk that leaves more than kOneHotMaxMissed values
// to it sends the next kOneHotWait chunks to the per-value counting (HistCounters::onehot_wait: the indices, then
// count_indices' copies), which costs the same on every distribution: such data then costs what the value-by-value
// histogram costs, and data within the window keeps the window's speed (2^20 float32, AVX-512, quiet run: the range
// histogram's slowest distribution 2.1x its fastest, the exponent histogram's 5.7x, against 15x and 38x before).
constexpr int64_t kOneHotMaxMissed = kChunk / 16;
constexpr int32_t kOneHotWait = 8;

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

#if HS_X86_BUILTINS
typedef short v32hi_t __attribute__((vector_size(64)));
typedef unsigned short v32hu_t __attribute__((vector_size(64)));
// 1 << k per 16-bit lane, 0 where k >= 16 as unsigned (vpsllvw, AVX-512 BW), in the 32-bit lanes' vector type.
HS_INLINE OneHotTypes<64>::U onehot16_of(const OneHotTypes<64>::I& k) {
  return (OneHotTypes<64>::U)__builtin_ia32_psllv32hi_mask(v32hi_t{} + 1, (v32hi_t)k, v32hi_t{}, 0xFFFFFFFFu);
}
#endif

// Full adder on every bit: sum a ^ b ^ c, carry maj(a, b, c) (one vpternlogd each on AVX-512). vpternlogd overwrites
// its first operand: the sum goes over c and the carry over b (the callers' fresh words, dead afterwards), the carry
// taken from (b, a, sum) (maj(a, b, c) is a where a == b, else c = !sum), so that no operand needs a copy.
template <int B, typename Q>
HS_INLINE void csa(Q& carry, Q& sum, const Q& a, const Q& b, const Q& c) {
#if HS_X86_BUILTINS
  if constexpr (B == 64) {
    typedef int v16si __attribute__((vector_size(64)));
    const Q s = (Q)__builtin_ia32_pternlogd512_mask((v16si)c, (v16si)a, (v16si)b, 0x96, (unsigned short)0xFFFF);
    const Q h = (Q)__builtin_ia32_pternlogd512_mask((v16si)b, (v16si)a, (v16si)s, 0xD4, (unsigned short)0xFFFF);
    sum = s;
    carry = h;
    return;
  }
#endif
  const Q u = a ^ b;
  const Q h = (a & b) | (u & c);
  sum = u ^ c;
  carry = h;
}

// Population count of each 32-bit lane (SWAR: no instruction outside ATen's levels).
template <typename U>
HS_INLINE U popcount_lanes(U v) {
  v = v - ((v >> 1) & 0x55555555u);
  v = (v & 0x33333333u) + ((v >> 2) & 0x33333333u);
  v = (v + (v >> 4)) & 0x0F0F0F0Fu;
  return (v * 0x01010101u) >> 24;
}

// The bit-sliced counts of the two planes of 32 keys, in the W 32-bit lanes of a B-byte vector: ones .. sixteens of
// the Harley-Seal groups in registers ([0]: keys 0..31, [1]: keys 32..63), the deep levels in memory (h.sliced, read
// and written once a group of 32 words), so that the one-hot words, made just before their adder takes them, and the
// group levels fit the 32 (16) vector registers with no spill.
template <int B>
struct SlicedCounts {
  using U = typename OneHotTypes<B>::U;
  static constexpr int kPlane = kSlicedLevels * 16;  // words of one plane in h.sliced
  U ones[2], twos[2], fours[2], eights[2], sixteens[2];
  uint32_t* m;
  HS_INLINE U at(int plane, int level) const {
    U v;
    std::memcpy(&v, m + plane * kPlane + 16 * level, sizeof(U));
    return v;
  }
  HS_INLINE void put(int plane, int level, const U& v) { std::memcpy(m + plane * kPlane + 16 * level, &v, sizeof(U)); }
  HS_INLINE explicit SlicedCounts(uint32_t* sliced) : m(sliced) {
    for (int q = 0; q < 2; ++q) {
      ones[q] = at(q, 0);
      twos[q] = at(q, 1);
      fours[q] = at(q, 2);
      eights[q] = at(q, 3);
      sixteens[q] = at(q, 4);
    }
  }
  HS_INLINE void store() {
    for (int q = 0; q < 2; ++q) {
      put(q, 0, ones[q]);
      put(q, 1, twos[q]);
      put(q, 2, fours[q]);
      put(q, 3, eights[q]);
      put(q, 4, sixteens[q]);
    }
  }
  // How many values the counts hold (after store): the population count of level l weighs 2^l. A lane's sum is
  // below 2 x 32 keys x 32 * 2^kOneHotDeep: no 32-bit lane can wrap.
  HS_INLINE int64_t total() const {
#if HS_X86_BUILTINS
    if constexpr (B == 64) {  // per level: nibble counts by table (vpshufb), the two planes' bytes added, vpsadbw
      typedef char v64qi __attribute__((vector_size(64)));
      typedef long long v8di __attribute__((vector_size(64)));
      // (a constant: filled by a loop, the table was built anew each chunk, 64 scalar popcounts and stores)
      constexpr v64qi lut = {0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4,
                             0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4};
      v8di acc{};
      for (int l = 0; l < kSlicedLevels; ++l) {
        v64qi bytes{};
        for (int q = 0; q < 2; ++q) {
          const U w = at(q, l);
          bytes += __builtin_ia32_pshufb512_mask(lut, (v64qi)(w & 0x0F0F0F0Fu), v64qi{}, ~0ull);
          bytes += __builtin_ia32_pshufb512_mask(lut, (v64qi)((w >> 4) & 0x0F0F0F0Fu), v64qi{}, ~0ull);
        }
        acc += (v8di)__builtin_ia32_psadbw512(bytes, v64qi{}) << l;
      }
      int64_t sum = 0;
      for (int j = 0; j < 8; ++j) sum += acc[j];
      return sum;
    }
#endif
    U t{};
    for (int q = 0; q < 2; ++q) {
      for (int l = 0; l < kSlicedLevels; ++l) t += popcount_lanes(at(q, l)) << l;
    }
    int64_t sum = 0;
    for (int j = 0; j < B / 4; ++j) sum += t[j];
    return sum;
  }
  // Adds the one-hot words of 2^LG vectors, fetch(u, d) writing vector u's two words d[0], d[1] (u from 0), to
  // ones ..: the carries of weight 2^LG go to c[0], c[1]. Each word is made right before its adder takes it.
  template <int LG, typename Fetch>
  HS_INLINE void tree(int u, Fetch&& fetch, U* c) {
    if constexpr (LG == 1) {
      U a[2], b[2];
      fetch(u, a);
      fetch(u + 1, b);
      for (int q = 0; q < 2; ++q) csa<B>(c[q], ones[q], ones[q], a[q], b[q]);
    } else {
      U a[2], b[2];
      tree<LG - 1>(u, fetch, a);
      tree<LG - 1>(u + (1 << (LG - 1)), fetch, b);
      U* level = LG == 2 ? twos : (LG == 3 ? fours : (LG == 4 ? eights : sixteens));
      for (int q = 0; q < 2; ++q) csa<B>(c[q], level[q], level[q], a[q], b[q]);
    }
  }
  // Adds 32 vectors' words (tree<5>), then their carries of weight 32 into the deep levels.
  template <typename Fetch>
  HS_INLINE void add32(int u, Fetch&& fetch) {
    U c[2];
    tree<5>(u, fetch, c);
    for (int q = 0; q < 2; ++q) {
      U cq = c[q];
      for (int l = 0; l < kOneHotDeep; ++l) {
        const U d = at(q, kOneHotGroupLevels + l);
        put(q, kOneHotGroupLevels + l, d ^ cq);
        cq = d & cq;
      }
    }
  }
};

// Counts nvec vectors into the bit-sliced counts that h carries (their key 0 at counter index base_p, key 32 at
// base_n) and returns how many of their lanes it did not count (from the levels' population count, once).
// offsets(i, kp, kn) gives vector i's W int32 lanes twice: a lane counts for key kp where kp < 32 (unsigned), for
// key 32 + kn where kn < 32, and not at all where neither is (1 << kp and 1 << kn by vpsllvd, which gives 0 for
// counts >= 32: no compare, no blend, no per-vector tally). A (lane, key) count grows by at most 1 a vector:
// nvec <= 4095 keeps it within the levels (kChunk / W is 256 or 512).
// K16 (Note [narrow exponent windows]): the lanes are 16-bit, 2 B of them a vector, with 16 keys each.
template <int B, bool K16 = false, typename OffsetFn>
HS_INLINE int64_t count_onehot(int64_t nvec, OffsetFn&& offsets, HistCounters& h, int32_t base_p, int32_t base_n) {
  using I = typename OneHotTypes<B>::I;
  using U = typename OneHotTypes<B>::U;
  constexpr int kLanes = K16 ? B / 2 : B / 4;
  if (h.base[0] != base_p || h.base[1] != base_n || h.keys16 != K16) {  // another window: the carried counts go
    fold_sliced(h);                                                     // to their counters
    h.base[0] = base_p;
    h.base[1] = base_n;
    h.keys16 = K16;
  }
  SlicedCounts<B> sc(h.sliced);
  auto group = [&](int64_t i, int gv) __attribute__((always_inline)) {
    sc.add32(0, [&](int u, U* d) __attribute__((always_inline)) {
      if (u < gv) {
        I kp, kn;
        offsets(i + u, kp, kn);
#if HS_X86_BUILTINS
        if constexpr (K16) {
          d[0] = onehot16_of(kp);
          d[1] = onehot16_of(kn);
          return;
        }
#endif
        d[0] = onehot_of<B>(kp);
        d[1] = onehot_of<B>(kn);
      } else {
        d[0] = d[1] = U{};
      }
    });
  };
  int64_t i = 0;
  for (; i + 32 <= nvec; i += 32) group(i, 32);
  if (i < nvec) group(i, static_cast<int>(nvec - i));
  sc.store();
  const int64_t total = sc.total();
  const int64_t missed = nvec * kLanes - (total - h.sliced_total);
  h.sliced_total = total;
  // A chunk adds at most kChunk / kLanes to a (lane, key) count; the levels hold 32 * 2^kOneHotDeep - 1.
  if (++h.sliced_chunks >= ((32 << kOneHotDeep) - 1) / (kChunk / kLanes)) fold_sliced(h);
  return missed;
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
  if (missed > (nan_apart ? nan - tail_nan : 0)) {  // Note [one-hot misses]: branch-free, 0 or 1 a value
    int64_t outside = 0;
    for (int64_t i = 0; i < nvec * W; ++i) {
      const int32_t o = idx[i];
      const uint32_t m = static_cast<uint32_t>(static_cast<uint32_t>(o - kb) >= 64u) & static_cast<uint32_t>(o != nan_idx);
      h.c[o] += m;
      outside += m;
    }
    if (outside > kOneHotMaxMissed) h.onehot_wait = kOneHotWait;
  }
  if (nan_apart) h.c[nan_idx] += static_cast<uint32_t>(nan);
}

}  // namespace cpu
}  // namespace hookstats
