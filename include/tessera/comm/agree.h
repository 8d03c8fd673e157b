#pragma once
// Runs a step that may fail on some ranks of a group but not others (a full
// disk, a memory budget measured per process) and makes every rank of the
// group stop together: the failing ranks rethrow their own error, the others
// throw naming the first failing rank, instead of going on into a collective
// that would hang. One 8-byte all-reduce on the group's control channel.
#include "tessera/comm/communicator.h"

#include <functional>
#include <string>

namespace tessera {
namespace comm {

// `what` names the step in the others' error ("disk offload", ...).
void on_every_rank(const CommunicatorPtr& group, const std::string& what, const std::function<void()>& step);

}  // namespace comm
}  // namespace tessera
