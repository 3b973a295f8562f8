// The stats kernel with element locations over c10::BFloat16 inputs (Note [element locations]).
#include "stats_kernel.cuh"

HOOKSTATS_STATS_KERNELS(c10::BFloat16, true)
