#include "tessera/parallel/unit_host.h"

#include "tessera/parallel/sharded_module.h"

namespace tessera {
namespace parallel {

at::Tensor UnitHost::unit(const std::string& name, const std::function<at::Tensor()>& fn) {
  return sharded_ != nullptr ? sharded_->run_unit(name, fn) : fn();
}

}  // namespace parallel
}  // namespace tessera
