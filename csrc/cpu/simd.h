// Portable SIMD for the CPU kernels: GCC/Clang vector extensions, compiled once per instruction set
// that ATen builds for (baseline, AVX2, AVX-512), chosen at run time as ATen chooses (Note [cpu dispatch]).
//
// Note [cpu dispatch]
// A kernel body is a template marked HS_INLINE, written over the B-byte vector types (VT<B>) below. It is
// instantiated inside entry points: one with no target attribute (B = 16: SSE2 on x86-64, NEON on arm64),
// one marked HS_TARGET_AVX2 (B = 32) and one marked HS_TARGET_AVX512 (B = 64). Because the body is inlined
// before vector lowering, the same source becomes AVX2+FMA code in the second and AVX-512 code in the third:
// one source of the math, no per-file compiler flags, and every function that is not inlined (the C++
// library's, c10's) keeps the baseline target, so nothing compiled for a wider ISA can be picked by the
// linker for a caller on an older CPU. The statistics, per-channel and clipping kernels keep each ISA's entry points
// in a translation unit of its own (cpu/stats_chunk_{default,avx2,avx512}.cpp over cpu/stats_chunk.h,
// cpu/channel_chunk_{default,avx2,avx512}.cpp over cpu/channel_chunk.h, cpu/clip_chunk_{default,avx2,avx512}.cpp
// over cpu/clip_chunk.h), each a table of function pointers that its driver picks once per call; a body declares its
// lane types with HS_LANE_TYPES (cpu/cpu_common.h).
// Which entry point runs is isa(): the level ATen's own kernels run at (at::get_cpu_capability(), which
// honours the ATEN_CPU_CAPABILITY environment variable: "default", "avx2", "avx512"), or
// HOOKSTATS_CPU_ISA when it is set, never above what the CPU supports. Tests pick each level with set_isa
// (the hookstats._cpu_isa op) or the environment variables in a subprocess.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // also makes GCC declare the AVX2 / AVX-512 builtins used below
#endif

#define HS_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) || defined(__i386__)
#define HS_HAVE_AVX2_TARGET 1
#define HS_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// ATen's AVX-512 level (avx512f/bw/vl/dq + FMA).
#define HS_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#else
#define HS_HAVE_AVX2_TARGET 0
#define HS_TARGET_AVX2
#define HS_TARGET_AVX512
#endif
// GCC's builtins for single instructions (min, max, round, test, half -> float), in the wide entry points.
#if HS_HAVE_AVX2_TARGET && defined(__GNUC__) && !defined(__clang__)
#define HS_X86_BUILTINS 1
#else
#define HS_X86_BUILTINS 0
#endif

namespace hookstats {
namespace simd {

// Vector types of B bytes: 32 for the AVX2 entry points, 16 for the baseline ones (SSE2 and
// NEON handle 16-byte vectors natively; wider ones would be split, and selects scalarized).
template <int B> struct VT {
  typedef float f32 __attribute__((vector_size(B)));
  typedef int32_t i32 __attribute__((vector_size(B)));
  typedef uint32_t u32 __attribute__((vector_size(B)));
  typedef uint16_t u16 __attribute__((vector_size(B / 2)));
  typedef double f64 __attribute__((vector_size(B)));
  typedef int64_t i64 __attribute__((vector_size(B)));
  typedef uint64_t u64 __attribute__((vector_size(B)));
};

// W double lanes (the lanes of W float or double lanes, widened).
template <int W> struct F64Lanes { typedef double type __attribute__((vector_size(8 * W))); };

// The SIMD levels, in ATen's order (at::native::CPUCapability: DEFAULT, AVX2, AVX512).
enum Isa : int { kIsaDefault = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };

// The highest level this CPU runs: AVX2 needs AVX2 + FMA + F16C, AVX-512 ATen's avx512f/bw/vl/dq too.
inline Isa cpu_max_isa() {
#if HS_HAVE_AVX2_TARGET
  static const Isa level = [] {
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) {
      return kIsaDefault;
    }
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return avx512 ? kIsaAvx512 : kIsaAvx2;
  }();
  return level;
#else
  return kIsaDefault;
#endif
}

// The level ATen's kernels run at (at::get_cpu_capability(): ATEN_CPU_CAPABILITY or the CPU's), or
// HOOKSTATS_CPU_ISA's when that is set. Defined in cpu/stats_cpu.cpp (it asks ATen).
Isa requested_isa();

inline Isa& isa_flag() {
  static Isa flag = [] {
    const Isa want = requested_isa();
    return want < cpu_max_isa() ? want : cpu_max_isa();
  }();
  return flag;
}
// The level the kernels run at (Note [cpu dispatch]).
inline Isa isa() { return isa_flag(); }
inline bool use_avx2() { return isa() >= kIsaAvx2; }
// Sets the level (capped at the CPU's) and returns the one before.
inline Isa set_isa(Isa want) {
  const Isa before = isa_flag();
  isa_flag() = want < cpu_max_isa() ? want : cpu_max_isa();
  return before;
}
inline const char* isa_name(Isa i) { return i == kIsaAvx512 ? "avx512" : (i == kIsaAvx2 ? "avx2" : "default"); }

// Flush-to-zero for the float kernels, for the scope's lifetime, on the calling thread (x86 MXCSR.FTZ;
// DAZ stays off, so subnormal inputs are read, compared and counted exactly). A float result that
// would be subnormal becomes 0: on x86 such a result costs a microcode assist of ~100 cycles, and in
// the kernels that use this it is at most 2^-126 of the largest term of its sum (Note [stats scaling]).
class FlushToZero {
 public:
  explicit FlushToZero(bool on) {
#if defined(__x86_64__) || defined(__i386__)
    on_ = on;
    if (on_) {
      saved_ = _mm_getcsr();
      _mm_setcsr(saved_ | 0x8000u);
    }
#else
    (void)on;
#endif
  }
  ~FlushToZero() {
#if defined(__x86_64__) || defined(__i386__)
    if (on_) _mm_setcsr(saved_);
#endif
  }
  FlushToZero(const FlushToZero&) = delete;
  FlushToZero& operator=(const FlushToZero&) = delete;

 private:
  bool on_ = false;
  unsigned int saved_ = 0;
};

template <typename F, typename I>
HS_INLINE F abs_bits(F v) {
  return (F)((I)v & (sizeof(v[0]) == 4 ? (int64_t)0x7fffffff : (int64_t)0x7fffffffffffffffLL));
}

// IEEE half -> float, bit exact for normals, subnormals, zeros, inf and NaN (the branch-free
// method of the FP16 library by Marat Dukhan, on vectors).
template <int B>
HS_INLINE typename VT<B>::f32 half_to_float(typename VT<B>::u16 h) {
  using F = typename VT<B>::f32; using I = typename VT<B>::i32; using U = typename VT<B>::u32;
#if HS_X86_BUILTINS
  if constexpr (B == 32) {  // F16C's vcvtph2ps: the same bits (exact; NaN quieted with its payload, as below)
    typedef short v8hi __attribute__((vector_size(16)));
    return __builtin_ia32_vcvtph2ps256((v8hi)h);
  }
  if constexpr (B == 64) {
    typedef short v16hi __attribute__((vector_size(32)));
    return __builtin_ia32_vcvtph2ps512_mask((v16hi)h, typename VT<B>::f32{}, (unsigned short)0xFFFF, 4);
  }
#endif
  const U w = __builtin_convertvector(h, U) << 16;
  const U sign = w & 0x80000000u;
  const U two_w = w + w;
  const F normalized = (F)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const F denormalized = (F)((two_w >> 17) | (126u << 23)) - 0.5f;
  const I is_denorm = (I)(two_w < (1u << 27));
  const U bits = (U)(((I)denormalized & is_denorm) | ((I)normalized & ~is_denorm));
  return (F)(sign | bits);
}

// 16-bit lanes zero-extended to 32 bits: one vpmovzxwd (GCC 12 widens a 32-byte vector in pieces: four instructions).
template <int B>
HS_INLINE typename VT<B>::u32 widen_u16(typename VT<B>::u16 h) {
#if HS_X86_BUILTINS
  if constexpr (B == 64) {
    typedef short v16hi __attribute__((vector_size(32)));
    return (typename VT<B>::u32)__builtin_ia32_pmovzxwd512_mask((v16hi)h, typename VT<B>::i32{}, (unsigned short)0xFFFF);
  }
#endif
  return __builtin_convertvector(h, typename VT<B>::u32);
}

template <int B>
HS_INLINE typename VT<B>::f32 bf16_to_float(typename VT<B>::u16 h) {
  return (typename VT<B>::f32)(widen_u16<B>(h) << 16);
}

// float -> IEEE half, round to nearest even, bit exact for every float including subnormal
// results, overflow to inf, and NaN (the branch-free method of the FP16 library, on vectors).
template <int B>
HS_INLINE typename VT<B>::u16 float_to_half(typename VT<B>::f32 f) {
  using F = typename VT<B>::f32; using I = typename VT<B>::i32; using U = typename VT<B>::u32;
  F base = (abs_bits<F, I>(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const U w = (U)f;
  const U shl1_w = w + w;
  const U sign = w & 0x80000000u;
  U bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? U{} + 0x71000000u : bias;
  base = (F)((bias >> 1) + 0x07800000u) + base;
  const U bits = (U)base;
  const U nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const U r = (sign >> 16) | (shl1_w > 0xFF000000u ? U{} + 0x7E00u : nonsign);
  return __builtin_convertvector(r, typename VT<B>::u16);
}

// float -> bfloat16, round to nearest even; NaN becomes 0x7FC0 as c10::BFloat16 does.
template <int B>
HS_INLINE typename VT<B>::u16 float_to_bf16(typename VT<B>::f32 f) {
  using U = typename VT<B>::u32; using I = typename VT<B>::i32;
  const U w = (U)f;
  U r = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  r = (I)(f != f) ? U{} + 0x7FC0u : r;
  return __builtin_convertvector(r, typename VT<B>::u16);
}

// m ? a : b per lane, m holding -1 / 0 integer lanes of a's width. 64-byte vectors take the bitwise
// form: GCC 12 scalarizes a 64-byte `?:` (and `~`) whose mask is a variable rather than a compare
// written in place, lane by lane.
template <typename Mk, typename T>
HS_INLINE T select(const Mk& m, const T& a, const T& b) {
  if constexpr (sizeof(T) == 64) {
    return (T)((Mk)b ^ (((Mk)a ^ (Mk)b) & m));
  } else {
    return m ? a : b;
  }
}

template <typename Vec>
HS_INLINE bool any_lane(const Vec& m) {
  uint64_t w[sizeof(Vec) / 8];
  std::memcpy(w, &m, sizeof(Vec));
  uint64_t a = 0;
  for (size_t j = 0; j < sizeof(Vec) / 8; ++j) a |= w[j];
  return a != 0;
}

// A vector's lanes folded by halves with op (log2(W) vector steps instead of a chain of W scalar ones; the order is
// fixed by the width): sum_lanes, and max_lanes for lanes without NaN.
template <typename Vec, typename Op>
HS_INLINE auto fold_lanes(const Vec& v, Op op) {
  using S = decltype(v[0] + 0);
  if constexpr (sizeof(Vec) == sizeof(S)) {
    return v[0];
  } else {
    typedef S Half __attribute__((vector_size(sizeof(Vec) / 2)));
    Half lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return fold_lanes(op(lo, hi), op);
  }
}
struct Plus {
  template <typename T> HS_INLINE T operator()(const T& a, const T& b) const { return a + b; }
};
struct Larger {
  template <typename T> HS_INLINE T operator()(const T& a, const T& b) const { return a > b ? a : b; }
};
template <typename Vec> HS_INLINE auto sum_lanes(const Vec& v) { return fold_lanes(v, Plus{}); }
template <typename Vec> HS_INLINE auto max_lanes(const Vec& v) { return fold_lanes(v, Larger{}); }

// any_lane for a mask of a B-byte kernel body (Note [cpu dispatch]): one vptest in the AVX2 entry
// points (B = 32; a GCC builtin is checked against the function it is finally inlined into, unlike
// the _mm256 wrappers, so it can sit in the shared template), one vptestmq in the AVX-512 ones, the
// portable reduction elsewhere.
template <int B, typename Vec>
HS_INLINE bool any_lane_of(const Vec& m) {
#if HS_X86_BUILTINS
  if constexpr (B == 32 && sizeof(Vec) == 32) {
    typedef long long v4di __attribute__((vector_size(32)));
    return !__builtin_ia32_ptestz256((v4di)m, (v4di)m);
  }
  if constexpr (B == 64 && sizeof(Vec) == 64) {
    typedef long long v8di __attribute__((vector_size(64)));
    return __builtin_ia32_ptestmq512((v8di)m, (v8di)m, (unsigned char)0xFF) != 0;
  }
#endif
  return any_lane(m);
}

// a > b ? a : b, a < b ? a : b (b when a is NaN) and round-to-nearest of float or double lanes of a
// B-byte kernel body: one instruction each in the AVX2 entry points (the builtins, as in any_lane_of),
// selects elsewhere.
template <int B, typename F>
HS_INLINE F max_of(const F& a, const F& b) {
#if HS_X86_BUILTINS
  if constexpr (B == 32 && sizeof(F) == 32 && sizeof(a[0]) == 4) return __builtin_ia32_maxps256(a, b);
  if constexpr (B == 32 && sizeof(F) == 32 && sizeof(a[0]) == 8) return __builtin_ia32_maxpd256(a, b);
  if constexpr (B == 64 && sizeof(F) == 64 && sizeof(a[0]) == 4) return __builtin_ia32_maxps512_mask(a, b, a, (unsigned short)0xFFFF, 4);
  if constexpr (B == 64 && sizeof(F) == 64 && sizeof(a[0]) == 8) return __builtin_ia32_maxpd512_mask(a, b, a, (unsigned char)0xFF, 4);
#endif
  return a > b ? a : b;
}
template <int B, typename F>
HS_INLINE F min_of(const F& a, const F& b) {
#if HS_X86_BUILTINS
  if constexpr (B == 32 && sizeof(F) == 32 && sizeof(a[0]) == 4) return __builtin_ia32_minps256(a, b);
  if constexpr (B == 32 && sizeof(F) == 32 && sizeof(a[0]) == 8) return __builtin_ia32_minpd256(a, b);
  if constexpr (B == 64 && sizeof(F) == 64 && sizeof(a[0]) == 4) return __builtin_ia32_minps512_mask(a, b, a, (unsigned short)0xFFFF, 4);
  if constexpr (B == 64 && sizeof(F) == 64 && sizeof(a[0]) == 8) return __builtin_ia32_minpd512_mask(a, b, a, (unsigned char)0xFF, 4);
#endif
  return a < b ? a : b;
}
// The nearest integer of lanes a >= 0 (ties either way), in a's type; I: integer lanes of a's width.
template <int B, typename F, typename I>
HS_INLINE F round_nonneg_of(const F& a) {
#if HS_X86_BUILTINS
  // nearest, no exceptions
  if constexpr (B == 32 && sizeof(F) == 32 && sizeof(a[0]) == 4) return __builtin_ia32_roundps256(a, 0x8);
  if constexpr (B == 32 && sizeof(F) == 32 && sizeof(a[0]) == 8) return __builtin_ia32_roundpd256(a, 0x8);
  if constexpr (B == 64 && sizeof(F) == 64 && sizeof(a[0]) == 4) return __builtin_ia32_rndscaleps_mask(a, 0x8, a, (unsigned short)0xFFFF, 4);
  if constexpr (B == 64 && sizeof(F) == 64 && sizeof(a[0]) == 8) return __builtin_ia32_rndscalepd_mask(a, 0x8, a, (unsigned char)0xFF, 4);
#endif
  using S = decltype(a[0] + 0);  // float or double
  return __builtin_convertvector(__builtin_convertvector(a + S(0.5), I), F);
}

// AVX-512 mask-register helpers for 16 float / int32 lanes (the B = 64 bodies' hot select chains, which
// GCC 12 would otherwise scalarize: see select). Only called inside HS_TARGET_AVX512 entry points.
#if HS_X86_BUILTINS
namespace k16 {
using F = VT<64>::f32;
using I = VT<64>::i32;
typedef unsigned short mask;
// _CMP_* predicates of _mm512_cmp_ps_mask
template <int P> HS_INLINE mask cmp(const F& a, const F& b) { return __builtin_ia32_cmpps512_mask(a, b, P, (mask)0xFFFF, 4); }
// _MM_CMPINT_* predicates of _mm512_cmp_epu32_mask
template <int P> HS_INLINE mask cmpu(const I& a, const I& b) { return __builtin_ia32_ucmpd512_mask(a, b, P, (mask)0xFFFF); }
HS_INLINE mask test(const I& a, const I& b) { return __builtin_ia32_ptestmd512(a, b, (mask)0xFFFF); }
// a + b where m, a elsewhere
HS_INLINE I add_where(mask m, const I& a, const I& b) { return __builtin_ia32_paddd512_mask(a, b, a, m); }
// b where m, a elsewhere
HS_INLINE I blend(mask m, const I& a, const I& b) { return __builtin_ia32_blendmd_512_mask(a, b, m); }
}  // namespace k16
#endif

// Loads (and stores) of W lanes in the accumulation type. Tag types keep this header torch-free:
// the kernel maps c10::Half -> HalfBits and c10::BFloat16 -> BF16Bits.
struct HalfBits { uint16_t x; };
struct BF16Bits { uint16_t x; };

template <typename T, int B> struct Lanes;
template <int B> struct Lanes<float, B> {
  using acc_t = float; using V = typename VT<B>::f32; using M = typename VT<B>::i32;
  static constexpr int W = B / 4;
  static HS_INLINE V load(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
  static HS_INLINE void store(void* p, const V& v) { std::memcpy(p, &v, sizeof v); }
};
template <int B> struct Lanes<double, B> {
  using acc_t = double; using V = typename VT<B>::f64; using M = typename VT<B>::i64;
  static constexpr int W = B / 8;
  static HS_INLINE V load(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
  static HS_INLINE void store(void* p, const V& v) { std::memcpy(p, &v, sizeof v); }
};
template <int B> struct Lanes<HalfBits, B> {
  using acc_t = float; using V = typename VT<B>::f32; using M = typename VT<B>::i32;
  static constexpr int W = B / 4;
  static HS_INLINE V load(const void* p) {
    typename VT<B>::u16 h; std::memcpy(&h, p, sizeof h); return half_to_float<B>(h);
  }
  static HS_INLINE void store(void* p, const V& v) {
    const typename VT<B>::u16 h = float_to_half<B>(v); std::memcpy(p, &h, sizeof h);
  }
};
template <int B> struct Lanes<BF16Bits, B> {
  using acc_t = float; using V = typename VT<B>::f32; using M = typename VT<B>::i32;
  static constexpr int W = B / 4;
  static HS_INLINE V load(const void* p) {
    typename VT<B>::u16 h; std::memcpy(&h, p, sizeof h); return bf16_to_float<B>(h);
  }
  static HS_INLINE void store(void* p, const V& v) {
    const typename VT<B>::u16 h = float_to_bf16<B>(v); std::memcpy(p, &h, sizeof h);
  }
};

}  // namespace simd
}  // namespace hookstats
