// The predicates of op_rules.h: which ops and tensors the observer reads (Note [nonfinite observer]).
#include "op_rules.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstring>

namespace hookstats {
namespace anomaly {

bool starts_with(const char* s, const char* prefix) { return std::strncmp(s, prefix, std::strlen(prefix)) == 0; }

// Ops whose output is memory nobody has written yet (empty, empty_like, new_empty_strided, resize_): its bits are
// whatever was there before, not a value an op computed.
bool makes_uninitialized(const char* name) {
  for (const char* p : {"aten::empty", "aten::new_empty", "aten::_empty", "aten::resize", "aten::_resize"}) {
    if (starts_with(name, p)) return true;
  }
  return false;
}

// Ops that only move values: with the output's dtype on every floating input they cannot make a NaN or an Inf.
bool moves_values(const char* name) {
  for (const char* p : {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat",
                        "aten::stack", "aten::index_select", "aten::gather", "aten::narrow_copy", "aten::index",
                        "aten::_copy_from", "aten::_copy_from_and_resize", "aten::repeat", "aten::flip",
                        "aten::roll", "aten::constant_pad_nd", "aten::slice_scatter", "aten::select_scatter",
                        "aten::index_copy", "aten::index_copy_", "aten::masked_select", "aten::take"}) {
    if (std::strcmp(name, p) == 0) return true;
  }
  return false;
}

bool is_composite(const char* name, const char* overload) {
  auto op = c10::Dispatcher::singleton().findOp(c10::OperatorName(name, overload));
  return op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
}

bool is_optimizer_scope(const char* name) {
  return starts_with(name, "Optimizer.step#") || starts_with(name, "Optimizer.zero_grad#");
}

bool checkable_dtype(c10::ScalarType st) {
  return st == c10::kFloat || st == c10::kDouble || st == c10::kHalf || st == c10::kBFloat16;
}

// A tensor whose memory this observer may read: see Note [nonfinite observer].
bool readable(const at::Tensor& t) {
  if (!t.defined() || t.layout() != c10::kStrided || !checkable_dtype(t.scalar_type())) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_python_dispatch() || t.key_set().has(c10::DispatchKey::Functionalize)) return false;
  if (!(t.is_cpu() || t.is_cuda()) || !t.has_storage() || t.numel() == 0) return false;
  return t.const_data_ptr() != nullptr;
}

bool inplace_name(const char* name) {
  const size_t n = std::strlen(name);
  return n > 1 && name[n - 1] == '_' && name[n - 2] != '_';
}

bool nonfinite_scalar(c10::ArrayRef<const c10::IValue> args) {
  for (const c10::IValue& v : args) {
    if (v.isDouble()) {
      const double d = v.toDouble();
      if (d != d || d == INFINITY || d == -INFINITY) return true;
    } else if (v.isScalar() && v.toScalar().isFloatingPoint()) {
      const double d = v.toScalar().toDouble();
      if (d != d || d == INFINITY || d == -INFINITY) return true;
    }
  }
  return false;
}

}  // namespace anomaly
}  // namespace hookstats
