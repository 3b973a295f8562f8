// The exponent histogram's counting pass over a chunk in registers (Note [one-hot chunk counts] in
// cpu/onehot_count.h): a window of 32 exponents per sign on the AVX2 and AVX-512 levels, and on AVX-512 the narrow
// window of 16 on 16-bit lanes (Note [narrow exponent windows]). Included by cpu/hist_chunk.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "onehot_count.h"
#include "simd.h"

namespace hookstats {
namespace cpu {

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
      u = simd::widen_u16<B>(r) << 16;  // bf16: the float32 layout
    }
    return u;
  };
  auto offsets = [&](int64_t i, I& kp, I& kn) __attribute__((always_inline)) {
    I t;  // the 9 sign and exponent bits
    if constexpr (sizeof(scalar_t) == 4) {
      t = (I)(bits(i) >> 23);
    } else {
      typename simd::VT<B>::u16 r;
      std::memcpy(&r, p + i * W, sizeof r);
      t = (I)(simd::widen_u16<B>(r) >> 7);
    }
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
  if (missed > zero + nan - tail_special) {  // values outside the window: count them (Note [one-hot misses])
    int64_t outside = 0;
    for (int64_t i = 0; i < nvec; ++i) {
      const U u = bits(i);
      for (int j = 0; j < W; ++j) {  // branch-free: 0 or 1 a value; zeros and NaNs come from the statistics
        const uint32_t t = u[j] >> 23, a = u[j] & 0x7fffffffu;
        const uint32_t m = static_cast<uint32_t>(t - static_cast<uint32_t>(lo) >= 32u) &
                           static_cast<uint32_t>(t - static_cast<uint32_t>(lo + 256) >= 32u) &
                           static_cast<uint32_t>(a != 0) & static_cast<uint32_t>(a <= 0x7f800000u);
        h.c[exp_slot<8, 23>(u[j])] += m;
        outside += m;
      }
    }
    if (outside > kOneHotMaxMissed) h.onehot_wait = kOneHotWait;
  }
  h.c[2 * nE + 2] += static_cast<uint32_t>(zero);
  h.c[2 * nE + 5] += static_cast<uint32_t>(nan);
}

#if HS_X86_BUILTINS
// Note [narrow exponent windows]
// A chunk of real data spans few exponents: 4096 normal values lie within about 14 exponents of their largest |x|
// (randn: 80% of its chunks within 16). So the AVX-512 entry points first count a float32 or bfloat16 chunk's exponent
// histogram in a window of 16 exponents of either sign, on 16-bit lanes (vpsllvw, AVX-512 BW: 0 for counts >= 16): 32
// values a one-hot word instead of 16, so half the shifts and adders per value of the 32-bit lanes' window of 32 (Note
// [one-hot chunk counts], whose levels and folding it shares: a 32-bit word of the levels holds two lanes' 16 keys,
// HistCounters::keys16). A lane holds the 9 sign and exponent bits t (bfloat16: its bits >> 7; float32: bits >> 23 of
// one vector in the even lanes, merged by one masked vpsrlw of another), its keys t - lo and t - lo - 256, lo = 15
// below the largest |x|'s exponent, or the last chunk's lo while it holds this chunk (a move folds the levels, ~10x a
// recount). Values below the window and subnormals are missed, as in the wide window (infinities cannot be: a chunk
// whose largest |x| is infinite goes to the wide window): the chunk is read again, 32 values a compare, until the
// missed ones are found and counted one by one (a third of randn's chunks, one value each). A chunk with more of them
// than kNarrowMaxMissed sends the next kNarrowWait chunks to the wide window (HistCounters::narrow_wait). Counts are
// integers: the result is bit for bit the per-value counting's. Measured (2^20 randn, one thread, shared machine),
// statistics + exponent histogram against the wide window alone: float32 ~7% faster, bfloat16 ~14% (no widening, half
// the words). Where its time goes (2^20 randn, AVX-512, one thread; perf and a harness of the chunk functions): the
// loop takes ~11 vector instructions a 32 values (float32: two shifts for t, two subtractions, two vpsllvw, ~3.9
// vpternlogd, ~1 for the deep levels; bfloat16 one shift fewer) at ~3.7 instructions a cycle, the pipes' throughput;
// per chunk, the levels' population count (SlicedCounts::total) and the search for the missed values together ~10% of
// the counting. The chunk's 16-bit constants are broadcast as 32-bit lanes: GCC 12 builds a v32hu_t{} + x lane by
// lane (32 masked vpbroadcastw), which, with total()'s table filled by a scalar loop each chunk, was ~10% of the whole
// op. (Flagging the groups of 32 vectors that hold a value below the window, one vpmaxub a vector, cost more than the
// search it shortened: not kept.)
constexpr int64_t kNarrowMaxMissed = kChunk / 16;
constexpr int32_t kNarrowWait = 8;

// The chunk's exponent histogram in the narrow window, or false (nothing counted) where the wide one should count it.
template <typename scalar_t>
HS_INLINE bool exp_chunk_narrow(const scalar_t* p, int64_t n, HistCounters& h, double amax, int64_t zero,
                                int64_t nan) {
  using I = typename OneHotTypes<64>::I;
  constexpr int32_t nE = 254;
  if (h.narrow_wait > 0) {
    --h.narrow_wait;
    return false;
  }
  if (!(amax > 0.0 && amax - amax == 0.0)) return false;
  int ex = 0;
  std::frexp(amax, &ex);
  const int top = ex - 1 + 127;
  // [lo, lo + 15] within the normals 1..254; the last chunk's window while it has at most 3 exponents above top
  const int32_t last = h.base[1] + 1;
  const int32_t lo = h.keys16 && h.base[1] >= 0 && top >= last + 12 && top <= last + 15
                         ? last : std::min(std::max(top - 15, 1), 239);
  // (broadcast as 32-bit lanes: GCC 12 builds v32hu_t{} + x lane by lane, 32 masked vpbroadcastw a chunk)
  auto words = [](uint32_t x) { return (v32hu_t)(OneHotTypes<64>::U{} + (x | x << 16)); };
  const v32hu_t vlo = words(static_cast<uint32_t>(lo));
  const v32hu_t vlo_n = words(static_cast<uint32_t>(lo + 256));
  constexpr int G = 32;  // values a vector of 16-bit lanes
  auto sign_exp = [&](int64_t i) __attribute__((always_inline)) -> v32hu_t {  // the 9 sign and exponent bits
    if constexpr (sizeof(scalar_t) == 4) {  // t of values 16..31 (>> 23) in the even lanes, merged with the odd
      typedef unsigned v16su_t __attribute__((vector_size(64)));  // lanes of values 0..15 >> 7 (lane_value below)
      v32hi_t a;
      v16su_t b;
      std::memcpy(&a, p + i * G, sizeof a);
      std::memcpy(&b, p + i * G + 16, sizeof b);
      return (v32hu_t)__builtin_ia32_psrlwi512_mask(a, 7, (v32hi_t)(b >> 23), 0xAAAAAAAAu);
    } else {
      v32hu_t w;
      std::memcpy(&w, p + i * G, sizeof w);
      return w >> 7;
    }
  };
  // The value of 16-bit lane j (float32: odd lanes hold values 0..15, even lanes values 16..31).
  auto lane_value = [](int j) -> int {
    if constexpr (sizeof(scalar_t) == 4) return (j & 1) ? j >> 1 : 16 + (j >> 1);
    return j;
  };
  auto offsets = [&](int64_t i, I& kp, I& kn) __attribute__((always_inline)) {
    const v32hu_t t = sign_exp(i);
    kp = (I)(t - vlo);
    kn = (I)(t - vlo_n);
  };
  const int64_t nvec = n / G;
  const int64_t missed = count_onehot<64, true>(nvec, offsets, h, nE + lo - 1, lo - 1);
  auto bits_of = [&](int64_t i) -> uint32_t {
    if constexpr (sizeof(scalar_t) == 4) {
      uint32_t u;
      std::memcpy(&u, p + i, 4);
      return u;
    } else {
      return static_cast<uint32_t>(p[i].x) << 16;
    }
  };
  int64_t special = 0, counted = 0;  // zeros and NaNs seen by count_one; values it counted
  auto count_one = [&](uint32_t u) {
    const uint32_t a = u & 0x7fffffffu;
    if (a == 0 || a > 0x7f800000u) {
      ++special;
      return;
    }
    ++counted;
    h.c[exp_slot<8, 23>(u)] += 1;
  };
  for (int64_t i = nvec * G; i < n; ++i) count_one(bits_of(i));
  const int64_t others = missed - (zero + nan - special);  // values outside the window that zeros and NaNs leave
  if (others > 0) {  // count them, reading until the last one is found
    // A lane's kp & 0xFF is (its exponent - lo) mod 256 whatever its sign: 0..15 in the window, 256 - lo for a zero
    // or a subnormal, above it for a normal below the window, below it for the rest (NaN: 255 - lo; lo <= 239). So
    // the lanes to look at are those whose low byte of kp is at least 256 - lo: one vpcmpub on the even bytes.
    typedef char v64qi_t __attribute__((vector_size(64)));
    const v64qi_t below = (v64qi_t)words(static_cast<uint32_t>(256 - lo));  // in the low bytes
    counted = 0;
    for (int64_t i = 0; i < nvec && counted < others; ++i) {
      const v64qi_t kp = (v64qi_t)(sign_exp(i) - vlo);
      unsigned long long out = __builtin_ia32_ucmpb512_mask(kp, below, 5 /*NLT*/, 0x5555555555555555ull);
      for (; out != 0; out &= out - 1) count_one(bits_of(i * G + lane_value(__builtin_ctzll(out) / 2)));
    }
    if (counted > kNarrowMaxMissed) h.narrow_wait = kNarrowWait;
  }
  h.c[2 * nE + 2] += static_cast<uint32_t>(zero);
  h.c[2 * nE + 5] += static_cast<uint32_t>(nan);
  return true;
}
#endif

}  // namespace cpu
}  // namespace hookstats
