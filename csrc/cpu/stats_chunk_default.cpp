// The statistics kernel's chunk entry points for the baseline target (SSE2 on x86-64, NEON on arm64), 16-byte vectors (Note [cpu dispatch]).
#include "stats_chunk.h"

namespace hookstats {
namespace cpu {

HS_CHUNK_TABLE(kChunksDefault, 16, )

}  // namespace cpu
}  // namespace hookstats
