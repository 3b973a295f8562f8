// The clipping kernels' chunk entry points for AVX2 + FMA + F16C, 32-byte vectors (Note [cpu dispatch]).
// Off x86 the table is the baseline one.
#include "clip_chunk.h"

namespace hookstats {
namespace clip_cpu {

#if HS_HAVE_AVX2_TARGET
HS_CLIP_TABLE(kClipAvx2, 32, HS_TARGET_AVX2)
#else
const ClipTable kClipAvx2 = kClipDefault;
#endif

}  // namespace clip_cpu
}  // namespace hookstats
