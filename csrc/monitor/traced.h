// The recorders that compiled graphs reach by id (traced.cpp).
#pragma once

#include <cstdint>
#include <memory>

#include "recorder.h"

namespace hookstats {
namespace monitor {

// Makes r reachable by id from hookstats::_monitor_record (held weakly).
void register_recorder(int64_t id, const std::shared_ptr<Recorder>& r);

}  // namespace monitor
}  // namespace hookstats
