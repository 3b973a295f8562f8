// The per-channel kernel's task entry points for AVX2 + FMA + F16C, 32-byte vectors (Note [cpu dispatch]).
// Off x86 the table is the baseline one.
#include "channel_chunk.h"

namespace hookstats {
namespace channel_cpu {

#if HS_HAVE_AVX2_TARGET
HS_CHANNEL_TABLE(kChannelAvx2, 32, HS_TARGET_AVX2)
#else
const ChannelTable kChannelAvx2 = kChannelDefault;
#endif

}  // namespace channel_cpu
}  // namespace hookstats
