// The multi-tensor stats kernel over c10::Half inputs (Note [multi-tensor stats launches]).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_MULTI_KERNELS(c10::Half)
