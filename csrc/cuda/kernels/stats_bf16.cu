// The stats kernel over c10::BFloat16 inputs (Note [cuda cold paths] in stats_kernel.cuh: one kernel per unit).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_KERNELS(c10::BFloat16, false)
