// The statistics kernel's chunk entry points for AVX2 + FMA + F16C, 32-byte vectors (Note [cpu dispatch]).
// Off x86 the table is the baseline one.
#include "stats_chunk.h"

namespace hookstats {
namespace cpu {

#if HS_HAVE_AVX2_TARGET
HS_CHUNK_TABLE(kChunksAvx2, 32, HS_TARGET_AVX2)
#else
const ChunkTable kChunksAvx2 = kChunksDefault;
#endif

}  // namespace cpu
}  // namespace hookstats
