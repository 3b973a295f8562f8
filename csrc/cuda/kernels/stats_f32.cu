// The stats kernel over float inputs (Note [cuda cold paths] in stats_kernel.cuh: one kernel per unit).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_KERNELS(float, false)
