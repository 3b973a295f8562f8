// The stats kernel with element locations over float inputs (Note [element locations]).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_KERNELS(float, true)
