// The stats kernel over double inputs (Note [cuda cold paths] in stats_kernel.cuh: one kernel per unit).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_KERNELS(double, false)
