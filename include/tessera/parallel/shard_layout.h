#pragma once
// ShardLayout: the nested shard layout of a ShardingSpec over the data group
// and the collectives that move a flat buffer between its levels. The only
// place where sharded model states are communicated.
//
// Note [Nested shard layout]
// The distinct degrees of {1, s_params, s_grads, s_optim} form a chain
// 1 = c0 < c1 < ... < cn, each dividing the next (ShardingSpec::resolve).
// Level i splits a c(i-1)-chunk into c(i)/c(i-1) sub-chunks among the ranks
//   S_i(r) = { r' : r' in the same block of c(i) consecutive data ranks as r,
//              r' ≡ r (mod c(i-1)) },
// and rank r takes sub-chunk floor((r mod c(i)) / c(i-1)) (its rank in S_i).
// So level 1 is a block of c1 consecutive ranks (neighbours, as MiCS and hpZ
// want), every finer chunk lies inside the coarser chunk of the same rank (a
// gradient shard contains the optimizer shard, which is therefore a slice and
// needs no communication), and ranks r' ≡ r (mod c) hold the same c-chunk:
// that is the replica group R_c over which a P(k) gradient shard is summed.
// Moving between levels is one reduce-scatter or all-gather per level; the
// bus bytes add up to those of a single collective over the whole span.
#include "tessera/comm/communicator.h"
#include "tessera/parallel/sharding_spec.h"

#include <functional>
#include <memory>
#include <vector>

namespace tessera {
namespace parallel {

// A chain of dependent asynchronous operations (one per level), advanced by
// poll() without blocking or run to the end by wait().
class CommTask {
 public:
  using Stage = std::function<comm::WorkPtr()>;
  explicit CommTask(std::vector<Stage> stages) : stages_(std::move(stages)) {}
  CommTask() = default;

  // Issues the first stage if none is issued yet.
  void start();
  // Issues the next stage when the current one has completed, but never more
  // than `max_issued` stages in all; never blocks. True when all completed.
  bool poll(size_t max_issued = static_cast<size_t>(-1));
  void wait();
  // Stages issued so far (the queue in ShardedModule keeps ranks in step with it).
  size_t issued() const { return next_; }
  size_t stages() const { return stages_.size(); }
  bool done() const { return done_; }

 private:
  std::vector<Stage> stages_;
  size_t next_ = 0;
  comm::WorkPtr current_;
  bool done_ = false;
};

class ShardLayout {
 public:
  // Collective over data: splits one communicator per level and, when the
  // gradients are partially sharded, the replica group of their degree.
  ShardLayout(comm::CommunicatorPtr data, ShardDegrees degrees);

  const ShardDegrees& degrees() const { return degrees_; }
  // The group the layout spans (the data group, or a parameter's replica group).
  const comm::CommunicatorPtr& group() const { return data_; }
  int dp() const { return dp_; }
  int rank() const { return rank_; }
  // The largest degree: flat buffers are padded to a multiple of it.
  int max_degree() const { return chain_.back(); }

  // Offset (elements) of this rank's chunk at `degree` within a flat buffer
  // of `numel` elements (numel a multiple of max_degree()).
  int64_t chunk_offset(int64_t numel, int degree) const;

  // All-gather from this rank's `from`-chunk to its `to`-chunk (to divides
  // from). `out` is the to-chunk (numel / to elements). With `source` given,
  // it holds the from-chunk (numel / from elements); without, the from-chunk
  // is already in place inside `out`.
  CommTask gather(at::Tensor out, int64_t numel, int from, int to, at::Tensor source = {}) const;

  // Sums `full` (numel elements, this rank's local values) over the whole
  // data group into this rank's `to`-chunk, written to `out` (numel / to
  // elements). For to == 1, `out` may be `full` itself (all-reduce in place).
  // `full` is used as scratch.
  CommTask reduce(at::Tensor full, at::Tensor out, int to) const;

  // Names of the communicators, for traces: "data.level1", "data.replica".
  std::vector<comm::CommunicatorPtr> level_comms() const { return levels_; }

 private:
  int level_of(int degree) const;

  comm::CommunicatorPtr data_;
  ShardDegrees degrees_;
  int dp_;
  int rank_;
  std::vector<int> chain_;                     // 1 = c0 < c1 < ...
  std::vector<comm::CommunicatorPtr> levels_;  // levels_[i] splits c(i) into c(i+1)
  comm::CommunicatorPtr grad_replicas_;        // R_{s_grads} when 1 < s_grads < dp
};

}  // namespace parallel
}  // namespace tessera
