#include "tessera/parallel/offload.h"

#include <c10/util/Exception.h>

namespace tessera {
namespace parallel {

std::string offload_name(Offload offload) {
  switch (offload) {
    case Offload::kNone:
      return "none";
    case Offload::kHost:
      return "host";
    case Offload::kDisk:
      return "disk";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown offload");
}

Offload parse_offload(const std::string& name) {
  for (Offload o : {Offload::kNone, Offload::kHost, Offload::kDisk})
    if (offload_name(o) == name) return o;
  TORCH_CHECK(false, "unknown offload '", name, "'; use none (the device), host (CPU memory) or disk");
}

}  // namespace parallel
}  // namespace tessera
