#pragma once
// The one place where LibTorch 1.13 and 2.x differ for tessera
// (see docs/latest-libtorch.md). Keep version checks out of other files.
#include <torch/csrc/api/include/torch/version.h>

#define TESSERA_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace tessera {

// "1.13" or "2.15": the LibTorch this build compiled against.
inline const char* torch_version_string() { return TORCH_VERSION; }

}  // namespace tessera
