// The stats kernel with element locations over double inputs (Note [element locations]).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_KERNELS(double, true)
