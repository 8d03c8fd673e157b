#include "tessera/parallel/module_layout.h"

#include "tessera/comm/hierarchical_communicator.h"
#include "tessera/parallel/bucket_size.h"

#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <set>
#include <utility>

namespace tessera {
namespace parallel {
namespace {

// Note [The first bucket]
// Replicated gradients fill buckets in the order backward produces them,
// so the first bucket's reduction can run while the rest of backward
// computes; if it is as large as the others (25 MiB), a model under 25 MiB
// has one bucket, reduced after backward, with nothing to hide behind.
// PyTorch's DDP closes its first bucket once it holds 1 MiB for that
// reason; so do we (at bucket_bytes, if smaller). Closing after the tensor
// that reaches it, not before, keeps a bias from being a bucket alone in
// front of a large matrix. Across 2 hosts of 4 ranks at 200 Mbit/s
// the 3.4 MB demo GPT's DDP step took 651 ms with one bucket, 610 ms with
// the first at 1 MiB (medians of 2 runs) and 514-571 ms with every bucket
// at 1 MiB (--bucket-mb 1: more overlap, more calls). Across hosts the
// default buckets are smaller (Note [Buckets across hosts]).

ParamSlot make_slot(std::string name, const at::Tensor& param) {
  ParamSlot slot;
  slot.name = std::move(name);
  slot.param = param;
  return slot;
}

// The wrapper's layout, then one per replica group (Note [Replica groups]).
void plan_layouts(ModuleLayout& m, const comm::CommunicatorPtr& group, const ShardedModuleOptions& options) {
  m.layouts.push_back({group, options.spec().resolve(group->size())});
  std::vector<comm::CommunicatorPtr> replica_groups;
  for (const auto& [name, p] : options.placements()) {
    const auto& r = p.replica_group;
    if (!r || r.get() == group.get() || r->size() == group->size()) continue;
    TORCH_CHECK(group->size() % r->size() == 0, "ShardedModule: parameter '", name, "' names a replica group of ",
                r->size(), " ranks, which does not divide the wrapper's group of ", group->size(),
                " ranks; a replica group must be a sub-group of it (expert-data inside data)");
    auto it = std::find(replica_groups.begin(), replica_groups.end(), r);
    if (it == replica_groups.end()) {
      ShardDegrees degrees;
      try {
        degrees = options.spec().resolve(r->size());
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "ShardedModule: parameter '", name, "' is replicated over a replica group of ", r->size(),
                    " ranks ('", r->name(), "'), over which sharding spec ", options.spec().to_string(),
                    " cannot be laid out: ", e.what_without_backtrace(),
                    "; choose a spec whose degrees divide every replica group's size");
      }
      m.layouts.push_back({r, degrees});
      it = replica_groups.insert(replica_groups.end(), r);
    }
    m.layout_of[p.param.unsafeGetTensorImpl()] = 1 + static_cast<size_t>(it - replica_groups.begin());
  }
}

struct UnitSlots {
  std::vector<std::string> units;
  std::vector<std::vector<ParamSlot>> of_unit;  // per unit, registration order
  std::vector<ParamSlot> rest;                  // parameters no unit holds
};

// Which parameters form which unit (Note [Units and gathering]).
UnitSlots plan_units(torch::nn::Module& module, const ShardedModuleOptions& options, bool materialize) {
  UnitSlots u;
  u.units = options.units();
  auto named_modules = module.named_modules();
  if (u.units.empty() && materialize)
    if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&module))
      for (const auto& child : seq->named_children()) u.units.push_back(child.key());
  u.of_unit.resize(u.units.size());
  std::set<const void*> claimed;
  std::vector<size_t> order(u.units.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  // Deeper names first, so a nested unit keeps its own parameters.
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return u.units[a].size() > u.units[b].size(); });
  for (size_t i : order) {
    const auto* found = named_modules.find(u.units[i]);
    TORCH_CHECK(found != nullptr, "ShardedModule: unit '", u.units[i],
                "' is not a submodule name of the module; names are those of named_modules(), e.g. 'layers.0'");
    for (const auto& p : (*found)->named_parameters(true)) {
      if (!p.value().requires_grad() || !claimed.insert(p.value().unsafeGetTensorImpl()).second) continue;
      u.of_unit[i].push_back(make_slot(u.units[i] + "." + p.key(), p.value()));
    }
  }
  // Registration order inside each unit.
  std::map<const void*, size_t> position;
  size_t pos = 0;
  for (const auto& p : module.named_parameters(true)) position.emplace(p.value().unsafeGetTensorImpl(), pos++);
  for (auto& list : u.of_unit)
    std::sort(list.begin(), list.end(), [&](const ParamSlot& a, const ParamSlot& b) {
      return position[a.param.unsafeGetTensorImpl()] < position[b.param.unsafeGetTensorImpl()];
    });
  // A parameter registered twice (a tied embedding in a Sequential's first
  // and last layers) gets one slot: two would reduce and count it twice.
  for (const auto& p : module.named_parameters(true))
    if (p.value().requires_grad() && claimed.insert(p.value().unsafeGetTensorImpl()).second)
      u.rest.push_back(make_slot(p.key(), p.value()));
  return u;
}

class BucketPlanner {
 public:
  BucketPlanner(ModuleLayout& m, const comm::CommunicatorPtr& covered, const ShardedModuleOptions& options) : m_(m) {
    // Gradient groups per parameter: parameters whose gradients are partial
    // over the same groups share buckets (the same on every rank of those
    // groups, so the chunks summed over them line up).
    for (const auto& [name, p] : options.placements()) {
      auto groups = p.gradient_groups();
      // Only the wrapper's own reduction spans the sequence group; a parameter
      // reduced over a replica group (experts) still sums over it as a partial group.
      if (m.layout_index(p.param) == 0) groups.erase(std::remove(groups.begin(), groups.end(), covered), groups.end());
      if (!groups.empty()) partial_[p.param.unsafeGetTensorImpl()] = std::move(groups);
    }
  }

  // Buckets of `slots`: one set per (layout, gradient groups) in order of
  // first appearance (the same on every rank), the wrapper's layout without
  // partial groups first; each set cut at cap_bytes (0: no cap) and where
  // the dtype or device changes.
  std::vector<size_t> add(std::vector<ParamSlot> slots, int64_t cap_bytes) {
    using Key = std::pair<size_t, std::vector<comm::CommunicatorPtr>>;
    std::vector<std::pair<Key, std::vector<ParamSlot>>> sets;
    for (auto& slot : slots) {
      Key key{m_.layout_index(slot.param), groups_of(slot)};
      auto it = std::find_if(sets.begin(), sets.end(), [&](const auto& e) { return e.first == key; });
      if (it == sets.end()) it = sets.insert(sets.end(), {key, {}});
      it->second.push_back(std::move(slot));
    }
    std::stable_partition(sets.begin(), sets.end(),
                          [](const auto& e) { return e.first.first == 0 && e.first.second.empty(); });
    std::vector<size_t> made;
    for (auto& [key, members] : sets)
      for (size_t b : add_plain(std::move(members), cap_bytes, key.first, key.second)) made.push_back(b);
    return made;
  }

 private:
  std::vector<comm::CommunicatorPtr> groups_of(const ParamSlot& slot) const {
    auto it = partial_.find(slot.param.unsafeGetTensorImpl());
    return it == partial_.end() ? std::vector<comm::CommunicatorPtr>{} : it->second;
  }

  // In the order backward produces gradients: reverse registration.
  std::vector<size_t> add_plain(std::vector<ParamSlot> slots, int64_t cap_bytes, size_t layout,
                                const std::vector<comm::CommunicatorPtr>& partial_groups) {
    std::vector<size_t> made;
    std::reverse(slots.begin(), slots.end());
    PlannedBucket current{{}, layout, partial_groups};
    int64_t bytes = 0;

    auto flush = [&] {
      if (current.slots.empty()) return;
      made.push_back(m_.buckets.size());
      m_.buckets.push_back(std::move(current));
      current = PlannedBucket{{}, layout, partial_groups};
      bytes = 0;
    };
    for (auto& slot : slots) {
      const int64_t b = slot.param.numel() * static_cast<int64_t>(slot.param.element_size());
      const auto& last = current.slots;
      const bool same_kind = last.empty() || (last.back().param.scalar_type() == slot.param.scalar_type() &&
                                              last.back().param.device() == slot.param.device());
      if (!last.empty() && (!same_kind || (cap_bytes > 0 && bytes + b > cap_bytes))) flush();
      bytes += b;
      current.slots.push_back(std::move(slot));
      // Note [The first bucket]
      if (made.empty() && cap_bytes > 0 && bytes >= std::min(cap_bytes, kFirstBucketBytes)) flush();
    }
    flush();
    return made;
  }

  ModuleLayout& m_;
  std::map<const void*, std::vector<comm::CommunicatorPtr>> partial_;
};

}  // namespace

size_t ModuleLayout::layout_index(const at::Tensor& param) const {
  auto it = layout_of.find(param.unsafeGetTensorImpl());
  return it == layout_of.end() ? size_t{0} : it->second;
}

ModuleLayout plan_module_layout(torch::nn::Module& module, const comm::CommunicatorPtr& group,
                                const comm::CommunicatorPtr& covered, const ShardedModuleOptions& options) {
  ModuleLayout m;
  plan_layouts(m, group, options);
  m.materialize = m.layouts[0].degrees.params > 1 || options.offload_params();
  UnitSlots u = plan_units(module, options, m.materialize);
  BucketPlanner buckets(m, covered, options);
  if (m.materialize) {
    // One bucket per unit (and dtype); units reduce in reverse order.
    m.unit_names = u.units;
    m.unit_buckets.resize(u.units.size());
    if (!u.rest.empty() || u.units.empty()) {
      m.has_root_unit = true;
      m.unit_names.push_back("");
      m.unit_buckets.push_back(buckets.add(std::move(u.rest), 0));
    }
    for (size_t i = u.units.size(); i-- > 0;) m.unit_buckets[i] = buckets.add(std::move(u.of_unit[i]), 0);
  } else {
    std::vector<ParamSlot> all;
    std::set<const void*> seen;  // one slot per parameter, as above
    for (const auto& p : module.named_parameters(true))
      if (p.value().requires_grad() && seen.insert(p.value().unsafeGetTensorImpl()).second)
        all.push_back(make_slot(p.key(), p.value()));
    int64_t cap = options.bucket_bytes();
    if (cap == 0) {  // the default (Note [Buckets across hosts])
      int64_t bytes = 0;
      for (const auto& slot : all) bytes += slot.param.numel() * static_cast<int64_t>(slot.param.element_size());
      cap = default_bucket_bytes(bytes, dynamic_cast<const comm::HierarchicalCommunicator*>(group.get()) != nullptr);
    }
    buckets.add(std::move(all), cap);
    m.unit_names = u.units.empty() ? std::vector<std::string>{""} : u.units;
    m.unit_buckets.resize(m.unit_names.size());
  }
  return m;
}

}  // namespace parallel
}  // namespace tessera
