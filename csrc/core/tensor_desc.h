// The torch-free description of one tensor of a list, which the multi-tensor kernels read (core/tensor_list.h
// builds it; cuda/kernels/clip_*.cu read it).
#pragma once

#include <cstdint>

namespace hookstats {

enum DtypeCode : int32_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };

// One tensor of a list. layout < 0: the elements fill a dense block read flat from data
// (Note [layouts]); otherwise the index of its StridedLayout in the list's layout array.
struct TensorDesc {
  void* data;
  int64_t numel;
  int32_t dtype;
  int32_t layout;
};

}  // namespace hookstats
