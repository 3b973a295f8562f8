// The per-channel kernel's task entry points for AVX-512 (ATen's level: F, BW, VL, DQ), 64-byte vectors
// (Note [cpu dispatch]).
// Off x86 the table is the baseline one.
#include "channel_chunk.h"

namespace hookstats {
namespace channel_cpu {

#if HS_HAVE_AVX2_TARGET
HS_CHANNEL_TABLE(kChannelAvx512, 64, HS_TARGET_AVX512)
#else
const ChannelTable kChannelAvx512 = kChannelDefault;
#endif

}  // namespace channel_cpu
}  // namespace hookstats
