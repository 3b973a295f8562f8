// The statistics kernel's chunk entry points for AVX-512 (ATen's level: F, BW, VL, DQ), 64-byte vectors (Note [cpu dispatch]).
// Off x86 the table is the baseline one.
#include "stats_chunk.h"

namespace hookstats {
namespace cpu {

#if HS_HAVE_AVX2_TARGET
HS_CHUNK_TABLE(kChunksAvx512, 64, HS_TARGET_AVX512)
#else
const ChunkTable kChunksAvx512 = kChunksDefault;
#endif

}  // namespace cpu
}  // namespace hookstats
