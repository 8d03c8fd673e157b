#pragma once
// Note [Module layout]
// What ShardedModule decides before any communication, from the module and
// its options alone and the same on every rank: the layouts its parameters
// are sharded over (the wrapper's group first, then each replica group in
// order of first appearance: Note [Replica groups] in sharded_module.cpp),
// which parameters form which unit (Note [Units and gathering] in
// sharded_module.h), and which buckets hold which parameters in which
// order. Communicators enter only as identities, sizes and whether they
// reduce by host (the default bucket size: Note [Buckets across hosts]),
// so a test checks the decision in one process.
#include "tessera/comm/communicator.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharding_spec.h"

#include <map>
#include <string>
#include <vector>

namespace tessera {
namespace parallel {

struct PlannedLayout {
  comm::CommunicatorPtr group;
  ShardDegrees degrees;
};

struct PlannedBucket {
  // In the order backward produces gradients (reverse registration).
  std::vector<ParamSlot> slots;
  size_t layout = 0;  // into ModuleLayout::layouts
  // The groups its gradients are partial over, summed beside the data reduction.
  std::vector<comm::CommunicatorPtr> partial_groups;
};

struct ModuleLayout {
  std::vector<PlannedLayout> layouts;  // [0]: the wrapper's group
  // Parameters sharded (or offloaded): buckets keep this rank's chunk and
  // gather by unit; otherwise buckets are capped at bucket_bytes.
  bool materialize = false;
  std::vector<PlannedBucket> buckets;  // in reduction order
  std::vector<std::string> unit_names;  // the root unit, if any, last and named ""
  std::vector<std::vector<size_t>> unit_buckets;  // buckets per unit (materialized)
  bool has_root_unit = false;
  std::map<const void*, size_t> layout_of;  // parameter (TensorImpl) -> layout, when not 0

  size_t layout_index(const at::Tensor& param) const;
};

// `group`: the wrapper's group; `covered`: the sequence group its reduction
// spans (null: none), dropped from the partial groups of the parameters it
// reduces. Throws naming the parameter and the rule for a replica group or
// a unit that cannot be laid out.
ModuleLayout plan_module_layout(torch::nn::Module& module, const comm::CommunicatorPtr& group,
                                const comm::CommunicatorPtr& covered, const ShardedModuleOptions& options);

}  // namespace parallel
}  // namespace tessera
