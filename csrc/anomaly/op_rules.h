// Which ops and tensors the observer reads (Note [nonfinite observer] in observer.cpp): one predicate each.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace hookstats {
namespace anomaly {

bool starts_with(const char* s, const char* prefix);
// Ops whose output is memory nobody has written yet (empty, empty_like, new_empty_strided, resize_).
bool makes_uninitialized(const char* name);
// Ops that only move values: with the output's dtype on every floating input they cannot make a NaN or an Inf.
bool moves_values(const char* name);
// A CompositeImplicitAutograd kernel: a decomposition, which writes only through the ops it calls.
bool is_composite(const char* name, const char* overload);
// The USER_SCOPE that torch.optim opens around step() and zero_grad().
bool is_optimizer_scope(const char* name);
// float32/64, float16, bfloat16.
bool checkable_dtype(c10::ScalarType st);
// A tensor whose memory the observer may read.
bool readable(const at::Tensor& t);
// An in-place op by its name (add_, not __iand__).
bool inplace_name(const char* name);
// Whether a number argument of the op is NaN or +-Inf (fill_(nan), full(inf), masked_fill(-inf)).
bool nonfinite_scalar(c10::ArrayRef<const c10::IValue> args);

}  // namespace anomaly
}  // namespace hookstats
