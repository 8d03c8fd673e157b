#pragma once
// ParallelContext: one communicator per parallel mode, this rank's
// coordinates and its per-mode seeds. Passed around as a shared_ptr; there is
// no global instance (docs/parallel-context.md).
#include "tessera/comm/communicator.h"
#include "tessera/context/parallel_config.h"
#include "tessera/context/rank_grid.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace context {

class ParallelContext {
 public:
  // Collective over world: every rank calls it with the same config.
  //
  // Note [Context creation]
  // 1. The config is resolved against world->size() before any
  //    communication, so a rejected config throws the same error on every
  //    rank and nobody is left waiting in a collective.
  // 2. One split of world, colored by a hash of the resolved config, checks
  //    that all ranks were given the same config; otherwise the splits below
  //    would pair up the wrong ranks or hang. Every rank throws if not.
  // 3. For every mode in all_modes() order that the grid has (kGlobal is world
  //    itself): world->split(color = grid.group_index(mode, rank),
  //    key = grid.local_rank(mode, rank), name = mode_name(mode)). The same
  //    modes are split in the same order on every rank because they depend
  //    only on the config.
  static std::shared_ptr<ParallelContext> create(comm::CommunicatorPtr world, const ParallelConfig& config);

  // The resolved config (data derived).
  const ParallelConfig& config() const { return grid_.config(); }
  const RankGrid& grid() const { return grid_; }
  const comm::CommunicatorPtr& world() const { return world_; }

  bool has(ParallelMode mode) const { return grid_.has_mode(mode); }
  // Throws, naming the mode and the tensor mode, if !has(mode).
  comm::CommunicatorPtr comm(ParallelMode mode) const;
  // This rank's position in its group of mode, and the group's size.
  int rank(ParallelMode mode) const;
  int size(ParallelMode mode) const;
  int global_rank() const { return global_rank_; }
  // See Note [Seeds per mode] in rank_grid.h; base is config().seed().
  uint64_t seed(ParallelMode mode) const;

  // Note [Rows of the global batch]
  // Data rank d of D trains rows [d·B/D, (d+1)·B/D) of a global batch of B
  // rows; the other dimensions see the same rows. The trainer keys
  // row-keyed dropout by these rows, the elastic trainer and the commands
  // slice their batches with them. Throws unless D divides B.
  struct Rows {
    int64_t first = 0, count = 0;
  };
  Rows batch_rows(int64_t global_batch) const;

  // Several lines: backend, config, coordinates, and every mode's local rank,
  // members and seed on this rank.
  std::string describe() const;

 private:
  ParallelContext(comm::CommunicatorPtr world, RankGrid grid);

  comm::CommunicatorPtr world_;
  RankGrid grid_;
  int global_rank_;
  // Indexed by ParallelMode; null where the grid has no such mode.
  std::vector<comm::CommunicatorPtr> comms_;
};

using ParallelContextPtr = std::shared_ptr<ParallelContext>;

}  // namespace context
}  // namespace tessera
