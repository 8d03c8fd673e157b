#pragma once
// Where each rank's part of a parameter sits, and which ranks hold what: the
// one description that every consumer reads (the data-parallel wrapper, whole
// norms, checkpoints, consolidation, the trainer).
//
// Note [Placement model]
// A parameter's placement lists, for each axis of the rank grid that it is
// laid out over (the tensor group in 1D; row and column groups in 2D; ...),
// one AxisPlacement, in the spirit of DTensor's per-mesh-dimension placements:
// - Replicate: every rank of the axis holds the same values and computes the
//   same gradient.
// - Shard(d): the ranks hold consecutive chunks along tensor dimension d.
//   Several axes may shard one dimension; they nest in the listed order (the
//   first axis cuts the dimension into blocks, the next cuts each block).
// - Partial: the values are replicated, but each rank's gradient is a partial
//   sum over the axis (sequence-parallel LayerNorm, position embeddings and
//   row-parallel biases; a 2.5D depth axis), to be summed over it.
// From the axes follow the region of the full tensor this rank holds (an
// N-dimensional box: offset and length per dimension; the local tensor may
// carry zero padding past it along dimension 0, as a padded vocabulary does),
// the groups over which squared norms add up (shard_groups: each element once
// whatever replicates it) and the groups over which gradients are summed
// besides the data-parallel replicas (gradient_groups). The replicas
// themselves are the wrapper's business: by default the data group; an
// expert's parameters name theirs in replica_group.
// A new parallel mode adds layers that describe their parameters this way
// (PlacedModule); no consumer needs a new branch.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace tessera {
namespace nn {

enum class AxisKind { kReplicate, kShard, kPartial };

struct AxisPlacement {
  std::string axis;  // the grid axis: "tensor", "2d-row", "2d-col", "sequence", ...
  comm::CommunicatorPtr group;
  AxisKind kind = AxisKind::kReplicate;
  int64_t dim = -1;  // kShard: the tensor dimension
};

struct ParamPlacement {
  at::Tensor param;
  std::vector<int64_t> full_shape;
  std::vector<int64_t> offset;  // this rank's region of the full tensor, per dimension
  std::vector<int64_t> length;
  std::vector<AxisPlacement> axes;
  // The group over which data-parallel replicas of the parameter are reduced;
  // null: the wrapper's own (the data group).
  comm::CommunicatorPtr replica_group;

  bool defined() const { return param.defined(); }
  // The region is the whole tensor.
  bool whole() const;
  int64_t region_numel() const;
  // Elements of `param` inside the region: a flat prefix of it (padding trails).
  int64_t valid_numel() const;
  // Groups of the Shard axes (sum squares over them), and of the Partial
  // axes (sum gradients over them), in the listed order; size-1 groups left out.
  std::vector<comm::CommunicatorPtr> shard_groups() const;
  std::vector<comm::CommunicatorPtr> gradient_groups() const;

  // Adds an axis. shard() cuts this rank's block along dim (full_size: the
  // unpadded full extent of dim, set by the first axis that shards it;
  // -1: param.size(dim) times the sizes of every axis sharding dim).
  ParamPlacement& shard(std::string axis, comm::CommunicatorPtr group, int64_t dim, int64_t full_size = -1);
  ParamPlacement& replicate(std::string axis, comm::CommunicatorPtr group);
  ParamPlacement& partial(std::string axis, comm::CommunicatorPtr group);

  // "tensor:S(0) 2d-col:R", for messages.
  std::string describe() const;
};

// Full-state name -> placement, in a model's order.
using NamedPlacements = std::vector<std::pair<std::string, ParamPlacement>>;

// `param` whole on this rank, laid out over no axis.
ParamPlacement replicated_placement(const at::Tensor& param);
// `param`, this rank's chunk along dim over `group` of a full extent of
// `full_size` (the last chunks may be padding, along dim 0 only).
ParamPlacement sharded_placement(const at::Tensor& param, int64_t dim, int64_t full_size,
                                 const comm::CommunicatorPtr& group, const std::string& axis = "tensor");

// Copies this rank's region of `full` into p.param (padding zeroed).
void load_full(const ParamPlacement& p, const at::Tensor& full);
// The full tensor from every rank's `local` (p.param's values, or its
// gradient): gathered over the Shard axes, innermost first, padding dropped.
// Collective over those axes' groups.
at::Tensor gather_full(const ParamPlacement& p, const at::Tensor& local);
// gather_full of the parameter (or of its gradient, zeros where undefined).
at::Tensor full_value(const ParamPlacement& p, bool gradients = false);

// Sums each defined gradient over its gradient_groups() (collective), for
// training without the data-parallel wrapper, which does it itself.
void reduce_partial_gradients(const NamedPlacements& placements);

// Modules that lay out their own parameters (tensor-parallel layers).
class PlacedModule {
 public:
  virtual ~PlacedModule() = default;
  // Placements of the module's own parameters (not its children's), by the
  // names of named_parameters(/*recurse=*/false).
  virtual NamedPlacements local_placements() = 0;
};

// Every parameter of `module` (names as named_parameters()): PlacedModules
// give theirs, the others get `replicated(param)`.
NamedPlacements placements_of(torch::nn::Module& module,
                              const std::function<ParamPlacement(const at::Tensor&)>& replicated);

}  // namespace nn
}  // namespace tessera
