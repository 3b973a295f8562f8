// The multi-tensor stats kernel over float inputs (Note [multi-tensor stats launches]).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_MULTI_KERNELS(float)
