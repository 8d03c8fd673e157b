#pragma once
// Norms of whole parameters when each rank holds only a piece of them.
//
// Note [Whole-parameter norms]
// LAMB's and LARS's trust ratios and global gradient clipping need norms of
// whole parameters, but a parameter may be split over the tensor group (a
// column-parallel weight), over a data shard group (a ZeRO optimizer chunk)
// or both, while other parameters are replicated there. The optimizer
// computes, for every tensor it steps, its local squared norms (k numbers:
// the weight's, the update's, ...) in one [n, k] float64 tensor and hands it
// to a WholeNorms, which replaces each row by the squares of the whole
// parameter: summed over exactly the ranks that hold distinct pieces of it,
// once per element (replicated copies are not added twice; padding is not
// part of any piece). One all-reduce per group per step, whatever n is.
#include "tessera/comm/communicator.h"
#include "tessera/nn/placement.h"

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <vector>

namespace tessera {
namespace parallel {

class WholeNorms {
 public:
  virtual ~WholeNorms() = default;
  // squares: [params.size(), k] float64 on the parameters' device, row i
  // for params[i] as held here; nothing is read to the host (Note [One host
  // sync per step] in whole_norms.cpp). Collective over the groups the parameters are split over:
  // every rank of them calls it in the same step with the same k.
  virtual void reduce(const std::vector<at::Tensor>& params, at::Tensor& squares) const = 0;
  // The sum over distinct whole parameters of column 0 of `squares` (local
  // squares as for reduce), each parameter once: the same on every rank of
  // the groups. By default the sum of reduce()'s rows, right when every rank
  // lists each of its parameters once. A one-element float64 tensor on the
  // squares' device.
  virtual at::Tensor total(const std::vector<at::Tensor>& params, at::Tensor squares) const;
};
using WholeNormsPtr = std::shared_ptr<const WholeNorms>;

// Norms from the parameters' placements (nn/placement.h): a parameter's
// squares are summed over each group of its Shard axes, so every element
// counts once whatever replicates it; parameters without a placement are
// whole here. One all-reduce per distinct shard group.
class PlacementNorms : public WholeNorms {
 public:
  explicit PlacementNorms(const nn::NamedPlacements& placements);
  void reduce(const std::vector<at::Tensor>& params, at::Tensor& squares) const override;

 private:
  std::map<const c10::TensorImpl*, std::vector<size_t>> groups_of_;  // indices into groups_
  std::vector<comm::CommunicatorPtr> groups_;                       // in order of first appearance
};

// Optimizers whose step needs whole-parameter norms (tessera's LAMB, LARS)
// implement this; ShardedOptimizer and the user give them their WholeNorms.
class NormAware {
 public:
  virtual ~NormAware() = default;
  virtual void set_whole_norms(WholeNormsPtr norms) = 0;
};

// Optimizers whose state ShardedOptimizer::state_bytes cannot know by type
// (tessera's LAMB and LARS) list their state tensors.
class StateTensors {
 public:
  virtual ~StateTensors() = default;
  virtual std::vector<at::Tensor> state_tensors() const = 0;
};

// Squared norms of each tensor's gradient (or of the tensor with
// `gradients` false), made whole by `norms` when given: [n] float64.
at::Tensor whole_squares(const std::vector<at::Tensor>& params, const WholeNorms* norms, bool gradients);

// Scales every gradient by min(1, max_norm / (total + 1e-6)), where total is
// the norm of all gradients together: each element once, over the groups
// `norms` knows (WholeNorms::total), then summed over `across` (groups that
// hold disjoint parameters, such as the pipeline group: list a tied
// parameter on one stage only, and its other copies in `uncounted`, which
// are scaled alike but add nothing to the norm). Returns the norm before
// clipping, the same on every rank.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, const WholeNorms* norms = nullptr,
                      const std::vector<comm::CommunicatorPtr>& across = {},
                      const std::vector<at::Tensor>& uncounted = {});

}  // namespace parallel
}  // namespace tessera
