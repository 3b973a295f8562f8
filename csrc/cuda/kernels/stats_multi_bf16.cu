// The multi-tensor stats kernel over c10::BFloat16 inputs (Note [multi-tensor stats launches]).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_MULTI_KERNELS(c10::BFloat16)
