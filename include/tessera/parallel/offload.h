#pragma once
// Where the optimizer states and fp32 master copies of a sharded model live
// (docs/offload.md): with the parameters' device (none), in host memory
// (host), or on a local disk through bounded host buffers (disk).
#include <string>

namespace tessera {
namespace parallel {

enum class Offload { kNone, kHost, kDisk };

// "none", "host", "disk".
std::string offload_name(Offload offload);
// The names above; throws c10::Error listing them.
Offload parse_offload(const std::string& name);

}  // namespace parallel
}  // namespace tessera
