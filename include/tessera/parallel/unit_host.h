#pragma once
// UnitHost: a base for user modules whose forward runs its units through the
// ShardedModule that wraps it, without a callback threaded through the model.
//
//   struct NetImpl : torch::nn::Module, tessera::parallel::UnitHost {
//     at::Tensor forward(at::Tensor x) {
//       x = stem->forward(x);                                  // root unit
//       x = unit("block1", [&] { return block1->forward(x); });
//       return unit("block2", [&] { return block2->forward(x); });
//     }
//   };
//   ShardedModuleOptions().units({"block1", "block2"})
//
// Unwrapped (single-process code, or before wrapping) unit() just calls fn;
// wrapped, it is ShardedModule::run_unit(name, fn). A module is wrapped by
// one ShardedModule at a time; a copy (clone()) starts unwrapped.
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>

namespace tessera {
namespace parallel {

class ShardedModule;

class UnitHost {
 public:
  // Runs fn as the unit `name` of the wrapper, or plainly when unwrapped.
  at::Tensor unit(const std::string& name, const std::function<at::Tensor()>& fn);
  // The wrapper, or null.
  ShardedModule* sharded() const { return sharded_; }

 protected:
  UnitHost() = default;
  UnitHost(const UnitHost&) {}  // a copy is not wrapped
  UnitHost& operator=(const UnitHost&) { return *this; }
  virtual ~UnitHost() = default;

 private:
  friend class ShardedModule;
  ShardedModule* sharded_ = nullptr;
};

}  // namespace parallel
}  // namespace tessera
