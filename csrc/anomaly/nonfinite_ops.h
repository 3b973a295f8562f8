// Torch-free pieces of hookstats.detect_nonfinite shared by the CPU check (check_cpu.cpp) and the CUDA
// kernel (check_cuda.cu): what counts as non-finite, how a record is laid out in a guard's state, and how
// a hit is committed.
//
// Note [nonfinite guard state]
// Each device the guard has seen holds one int64 state tensor of kNumSlots slots, on that device (host
// memory for the CPU). kStep is the step counter that guard.step() advances there (a one-thread kernel on
// CUDA, so it is captured with the rest of a CUDA graph). kFound is 0 until a checked op output holds a
// NaN or an Inf; then it is that op's `order` (its position in the process-wide order of checked op calls,
// >= 1, counted on the host when the op ran) and the record slots describe it. Only the first hit of a
// device is kept: a check whose device state already has kFound != 0 commits nothing (on CUDA it returns
// at once). Across devices guard.first() takes the smallest order. Commit: the first piece that finds a
// non-finite element claims kFound with a compare-and-swap (CUDA: atomicCAS; CPU: under the guard's
// mutex) and writes the op's metadata; every piece of the same check adds its counts and lowers kFirst.
// A check of another op sees kFound != its order and commits nothing.
#pragma once

#include <cstdint>

#include "../core/layout.h"     // StridedLayout, element_offset
#include "../core/stats_ops.h"  // HS_HD

namespace hookstats {
namespace anomaly {

constexpr int kMaxShapeDims = 8;  // dims of the hit output kept in the record (ndim is kept whole)
constexpr int kMaxInputs = 6;     // inputs of a hit op whose finiteness the record says

enum Phase : int64_t { kForward = 1, kBackward = 2, kOptimizer = 3 };

enum Slot : int {
  kFound = 0,    // 0, or the order of the op call whose output was the first non-finite one
  kStep,         // the current step (advanced by guard.step() on the device)
  kHitStep,      // the step the hit happened in
  kPhase,        // Phase
  kOp,           // name-table index of the op ("aten::log")
  kModule,       // module id (-1 none)
  kNode,         // name-table index of the autograd node in backward (-1 none)
  kSeq,          // autograd sequence number of the op (forward) or node (backward), -1 none
  kOutput,       // which output of the op (tensors of a list output counted in order)
  kNan,          // NaN count of that output
  kInf,          // +-Inf count
  kFirst,        // logical flat index of its first NaN/Inf (kNoIndex until one is lowered in)
  kNumel,
  kDtype,        // c10::ScalarType of the output
  kNdim,
  kDataPtr,      // the output's data pointer (names a parameter or gradient in the optimizer phase)
  kInputs,       // how many tensor inputs were checked (at most kMaxInputs)
  kBadInputs,    // bit i: floating input i held a NaN/Inf
  kShape,        // kMaxShapeDims sizes
  kNumSlots = kShape + kMaxShapeDims
};

constexpr int64_t kNoIndex = INT64_MAX;

// Bit masks of a floating format: exponent all ones is non-finite; with a non-zero mantissa, NaN.
struct FloatMasks {
  uint64_t exp;
  uint64_t man;
  int bytes;
};

// masks_for(bytes, bf16): fp16 and bf16 are both 2 bytes.
HS_HD FloatMasks float_masks(int bytes, bool bf16) {
  FloatMasks m;
  m.bytes = bytes;
  if (bytes == 8) { m.exp = 0x7ff0000000000000ull; m.man = 0x000fffffffffffffull; }
  else if (bytes == 4) { m.exp = 0x7f800000ull; m.man = 0x007fffffull; }
  else if (bf16) { m.exp = 0x7f80ull; m.man = 0x007full; }
  else { m.exp = 0x7c00ull; m.man = 0x03ffull; }
  return m;
}

// The same test as nonfinite_add in core/stats_ops.h (v != v, |v| == inf), on the raw bits: exact for
// every format, and an integer compare that vectorises.
template <typename U>
HS_HD bool bits_nonfinite(U b, U exp) { return (b & exp) == exp; }

// The same test, as bits that OR together: with the sign bit cleared, adding the exponent's lowest bit carries
// into the sign bit exactly when the exponent is all ones. So the OR of nf_carry over a block has its sign bit set
// iff the block holds a NaN/Inf: AND, ADD and OR only, which vectorise on any SIMD width (the CPU's scan).
template <typename U>
HS_HD U nf_carry(U b, U exp) {
  const U sign = static_cast<U>(U(1) << (8 * sizeof(U) - 1));
  const U low = static_cast<U>(exp & static_cast<U>(~exp + 1));
  return static_cast<U>(static_cast<U>(b & static_cast<U>(~sign)) + low);
}

template <typename U>
HS_HD bool carry_nonfinite(U acc) {
  return (acc >> (8 * sizeof(U) - 1)) != 0;
}

// What one piece of an output gathers: counts and the smallest logical index of a NaN/Inf.
struct NfAcc {
  int64_t nan;
  int64_t inf;
  int64_t first;  // kNoIndex when none
};

HS_HD void nf_init(NfAcc& a) {
  a.nan = 0;
  a.inf = 0;
  a.first = kNoIndex;
}

// Element with raw bits b at logical index i.
template <typename U>
HS_HD void nf_add(NfAcc& a, U b, U exp, U man, int64_t i) {
  if (!bits_nonfinite(b, exp)) return;
  if ((b & man) != 0) ++a.nan; else ++a.inf;
  if (i < a.first) a.first = i;
}

HS_HD void nf_merge(NfAcc& a, const NfAcc& b) {
  a.nan += b.nan;
  a.inf += b.inf;
  if (b.first < a.first) a.first = b.first;
}

HS_HD bool nf_hit(const NfAcc& a) { return a.nan + a.inf > 0; }

// The op's metadata, known on the host when the op ran (kernel arguments on CUDA).
struct OpMeta {
  int64_t order, phase, op, module, node, seq, output, numel, dtype, ndim, data_ptr;
  int64_t shape[kMaxShapeDims];
};

// Writes the metadata of a claimed record (the counts, kFirst and kBadInputs are added separately).
HS_HD void write_meta(int64_t* s, const OpMeta& m) {
  s[kHitStep] = s[kStep];
  s[kPhase] = m.phase;
  s[kOp] = m.op;
  s[kModule] = m.module;
  s[kNode] = m.node;
  s[kSeq] = m.seq;
  s[kOutput] = m.output;
  s[kNumel] = m.numel;
  s[kDtype] = m.dtype;
  s[kNdim] = m.ndim;
  s[kDataPtr] = m.data_ptr;
  for (int d = 0; d < kMaxShapeDims; ++d) s[kShape + d] = m.shape[d];
}

// How an output is read. kFlat: contiguous, element i at offset i. kDense: non-overlapping and dense in
// another order (channels_last, a permutation): read in memory order, and a hit's memory offset turned
// into its logical index (logical_from_offset). kStrided: anything else (steps, stride 0), read in
// logical order through a coalesced StridedLayout.
enum ReadMode : int { kFlat = 0, kDense = 1, kStrided = 2 };

// The logical (row-major) flat index of the element at memory offset `off` of a non-overlapping dense
// tensor: along each dim of size > 1 its coordinate is (off / stride) % size, since the dims of smaller
// stride add up to less than stride and those of larger stride are multiples of stride * size.
HS_HD int64_t logical_from_offset(int64_t off, int ndim, const int64_t* sizes, const int64_t* strides) {
  int64_t idx = 0;
  for (int d = 0; d < ndim; ++d) {
    const int64_t c = sizes[d] > 1 ? (off / strides[d]) % sizes[d] : 0;
    idx = idx * sizes[d] + c;
  }
  return idx;
}

// One check: an output of an op and the op's first inputs, as the CPU check and the CUDA kernel take it.
struct CheckLaunch {
  const void* data;
  int64_t numel;
  int mode;        // ReadMode
  FloatMasks masks;
  int ndim;        // kDense: the tensor's own dims (at most kMaxDims)
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
  StridedLayout lay;  // kStrided
  OpMeta meta;
  int n_inputs;    // dense floating inputs to scan on a hit (memory order: only their finiteness counts)
  const void* in_data[kMaxInputs];
  int64_t in_numel[kMaxInputs];
  FloatMasks in_masks[kMaxInputs];
  int64_t* state;  // the device's state (Note [nonfinite guard state])
};

// Whether element i (memory order) of a dense input holds a NaN/Inf, whatever its format.
HS_HD bool input_nonfinite(const void* data, const FloatMasks& m, int64_t i) {
  if (m.bytes == 8) return bits_nonfinite(static_cast<const uint64_t*>(data)[i], static_cast<uint64_t>(m.exp));
  if (m.bytes == 4) return bits_nonfinite(static_cast<const uint32_t*>(data)[i], static_cast<uint32_t>(m.exp));
  return bits_nonfinite(static_cast<const uint16_t*>(data)[i], static_cast<uint16_t>(m.exp));
}

}  // namespace anomaly
}  // namespace hookstats
