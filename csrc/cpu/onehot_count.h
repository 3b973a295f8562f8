// Counting a chunk's histogram in registers (Note [one-hot chunk counts]): the AVX2 and AVX-512 entry points'
// counting pass for the exponent histogram and for range histograms of up to kOneHotMaxBins bins. Included by
// cpu/hist_chunk.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace hookstats {
namespace cpu {

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
constexpr int kOneHotDeep = 7;  // levels above the 4 of a Harley-Seal group: 15 + 16 * 127 >= 1024 per lane
constexpr int64_t kOneHotMaxBins = 64;

template <int B>
struct OneHotTypes {
  using I = typename simd::VT<B>::i32;
  using U = typename simd::VT<B>::u32;
  using Q = typename simd::VT<B>::u64;       // B / 8 one-hot words
  using H = typename simd::VT<B / 2>::u32;   // half of a key vector
};

// 1 << k per 64-bit lane, 0 where k >= 64 (vpsllvq).
template <int B>
HS_INLINE typename OneHotTypes<B>::Q onehot_of(const typename OneHotTypes<B>::Q& k) {
  using Q = typename OneHotTypes<B>::Q;
#if HS_X86_BUILTINS
  if constexpr (B == 64) {
    typedef long long v8di __attribute__((vector_size(64)));
    return (Q)__builtin_ia32_psllv8di_mask((v8di)(Q{} + 1u), (v8di)k, (v8di)Q{}, (unsigned char)0xFF);
  }
  if constexpr (B == 32) {
    typedef long long v4di __attribute__((vector_size(32)));
    return (Q)__builtin_ia32_psllv4di((v4di)(Q{} + 1u), (v4di)k);
  }
#endif
  return (k < 64u) ? (Q{} + 1u) << (k & 63u) : Q{};
}

// Full adder on every bit: sum a ^ b ^ c, carry maj(a, b, c) (one vpternlogq each on AVX-512).
template <int B, typename Q>
HS_INLINE void csa(Q& carry, Q& sum, const Q& a, const Q& b, const Q& c) {
#if HS_X86_BUILTINS
  if constexpr (B == 64) {
    typedef long long v8di __attribute__((vector_size(64)));
    const Q h = (Q)__builtin_ia32_pternlogq512_mask((v8di)a, (v8di)b, (v8di)c, 0xE8, (unsigned char)0xFF);
    sum = (Q)__builtin_ia32_pternlogq512_mask((v8di)a, (v8di)b, (v8di)c, 0x96, (unsigned char)0xFF);
    carry = h;
    return;
  }
#endif
  const Q u = a ^ b;
  const Q h = (a & b) | (u & c);
  sum = u ^ c;
  carry = h;
}

// Counts the keys of nvec key vectors into out[0, 64) (added). keys(i) gives vector i's W int32 keys; a vector
// with a key >= 64 (unsigned) is passed to fallback(i, keys) first, which counts those lanes itself. A (lane, key)
// count grows by at most 2 a key vector, so nvec <= 1023 (kChunk / W is 512 or 256) keeps it within the levels.
template <int B, typename KeyFn, typename Fallback>
HS_INLINE void count_onehot(int64_t nvec, KeyFn&& keys, Fallback&& fallback, uint32_t* out) {
  using T = OneHotTypes<B>;
  using I = typename T::I;
  using U = typename T::U;
  using Q = typename T::Q;
  using H = typename T::H;
  constexpr int QL = B / 8;
  Q ones{}, twos{}, fours{}, eights{};
  Q deep[kOneHotDeep];
  for (auto& d : deep) d = Q{};
  auto words = [&](int64_t i, Q& a, Q& b) {
    const I k = keys(i);
    if (simd::any_lane_of<B>((I)((U)k > 63u))) fallback(i, k);
    H lo, hi;
    std::memcpy(&lo, &k, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&k) + sizeof lo, sizeof hi);
    a = onehot_of<B>(__builtin_convertvector(lo, Q));
    b = onehot_of<B>(__builtin_convertvector(hi, Q));
  };
  // One Harley-Seal group: the one-hot words of 8 key vectors (gv of them real, the rest 0).
  auto group = [&](int64_t i, int gv) {
    Q d[16];
    for (int u = 0; u < 8; ++u) {
      if (u < gv) words(i + u, d[2 * u], d[2 * u + 1]);
      else d[2 * u] = d[2 * u + 1] = Q{};
    }
    Q twosA, twosB, foursA, foursB, eightsA, eightsB, sixteens;
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
    Q c = sixteens;
    for (int l = 0; l < kOneHotDeep; ++l) {
      const Q t = deep[l] & c;
      deep[l] ^= c;
      c = t;
    }
  };
  int64_t i = 0;
  for (; i + 8 <= nvec; i += 8) group(i, 8);
  if (i < nvec) group(i, static_cast<int>(nvec - i));
  // The levels, summed over the lanes as bit-sliced numbers (a ripple-carry add per lane), then expanded per key.
  constexpr int L = 4 + kOneHotDeep, LT = L + 3;  // + log2(QL) <= 3 bits for the sum over lanes
  uint64_t lv[L][QL];
  std::memcpy(lv[0], &ones, sizeof ones);
  std::memcpy(lv[1], &twos, sizeof twos);
  std::memcpy(lv[2], &fours, sizeof fours);
  std::memcpy(lv[3], &eights, sizeof eights);
  for (int l = 0; l < kOneHotDeep; ++l) std::memcpy(lv[4 + l], &deep[l], sizeof deep[l]);
  uint64_t acc[LT] = {};
  for (int q = 0; q < QL; ++q) {
    uint64_t c = 0;
    for (int l = 0; l < LT; ++l) {
      const uint64_t a = acc[l], b = l < L ? lv[l][q] : 0;
      const uint64_t u = a ^ b;
      acc[l] = u ^ c;
      c = (a & b) | (u & c);
    }
  }
  for (int l = 0; l < LT; ++l) {
    if (acc[l] == 0) continue;
    const uint32_t lo = static_cast<uint32_t>(acc[l]), hi = static_cast<uint32_t>(acc[l] >> 32);
    for (uint32_t b = 0; b < 32; ++b) out[b] += ((lo >> b) & 1u) << l;
    for (uint32_t b = 0; b < 32; ++b) out[32 + b] += ((hi >> b) & 1u) << l;
  }
}

}  // namespace cpu
}  // namespace hookstats
