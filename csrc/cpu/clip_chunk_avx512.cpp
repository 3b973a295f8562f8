// The clipping kernels' chunk entry points for AVX-512 (ATen's level: F, BW, VL, DQ), 64-byte vectors
// (Note [cpu dispatch]).
// Off x86 the table is the baseline one.
#include "clip_chunk.h"

namespace hookstats {
namespace clip_cpu {

#if HS_HAVE_AVX2_TARGET
HS_CLIP_TABLE(kClipAvx512, 64, HS_TARGET_AVX512)
#else
const ClipTable kClipAvx512 = kClipDefault;
#endif

}  // namespace clip_cpu
}  // namespace hookstats
