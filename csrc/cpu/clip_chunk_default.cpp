// The clipping kernels' chunk entry points for the baseline target (SSE2 on x86-64, NEON on arm64), 16-byte vectors
// (Note [cpu dispatch]).
#include "clip_chunk.h"

namespace hookstats {
namespace clip_cpu {

HS_CLIP_TABLE(kClipDefault, 16, )

}  // namespace clip_cpu
}  // namespace hookstats
