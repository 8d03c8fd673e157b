#include "tessera/optim/param_groups.h"

namespace tessera {
namespace optim {

std::vector<std::string> default_exclusion_patterns() { return {"bias", "ln_", "norm"}; }

bool excluded(const std::string& name, const std::vector<std::string>& patterns) {
  for (const auto& p : patterns)
    if (!p.empty() && name.find(p) != std::string::npos) return true;
  return false;
}

}  // namespace optim
}  // namespace tessera
