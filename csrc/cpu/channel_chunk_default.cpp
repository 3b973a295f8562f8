// The per-channel kernel's task entry points for the baseline target (SSE2 on x86-64, NEON on arm64), 16-byte
// vectors (Note [cpu dispatch]).
#include "channel_chunk.h"

namespace hookstats {
namespace channel_cpu {

HS_CHANNEL_TABLE(kChannelDefault, 16, )

}  // namespace channel_cpu
}  // namespace hookstats
