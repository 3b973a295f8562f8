// HOOKSTATS_DISPATCH_FLOATING_TYPES(dtype, NAME, ...): runs the lambda body with scalar_t
// bound to float, double, c10::Half or c10::BFloat16, the dtypes every hookstats op takes.
#pragma once

#include <ATen/Dispatch.h>

#define HOOKSTATS_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
