#pragma once
// RankGrid: which global ranks form the group of each parallel mode.
//
// Pure arithmetic on a resolved ParallelConfig and the world size: no MPI, no
// communicator. ParallelContext builds one communicator per mode from it, and
// tests check it without launching processes (docs/parallel-context.md).
#include "tessera/context/parallel_config.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace context {

// One communicator per mode (ParallelContext); the tensor sub-modes exist only
// for their tensor mode.
enum class ParallelMode {
  kGlobal,
  kData,
  kPipeline,
  kTensor,
  kSequence,
  kDataSequence,
  kModel,
  k1D,
  k2DRow,
  k2DCol,
  k2p5DRow,
  k2p5DCol,
  k2p5DDep,
  k2p5DXZ,
  k3DInput,
  k3DWeight,
  k3DOutput,
  k3DInputWeight,
  k3DOutputWeight,
  kExpert,
  kExpertData,
  kSequenceUlysses,
  kSequenceRing,
};

// "global", "data", ..., "2.5d_xz", "3d_input_weight", "expert_data",
// "sequence_ulysses", "sequence_ring".
std::string mode_name(ParallelMode mode);
// Every mode, in declaration order (the order communicators are created in).
const std::vector<ParallelMode>& all_modes();

// Note [Rank grid]
// Global rank = Σ coord_d · stride_d over d in {tp, sp, dp, pp}, the strides
// following config.order() innermost first. With the default "tp-sp-dp-pp":
// stride(tp) = 1, stride(sp) = tp, stride(dp) = tp·sp, stride(pp) = tp·sp·dp.
// Tensor ranks are adjacent so that they share a node (tensor parallelism
// talks the most); pipeline is outermost (it talks the least).
//
// Note [Mode groups]
// A mode's group is the set of ranks whose coordinates agree everywhere except
// on the axes the mode varies; group order (local rank) is mixed-radix over
// those axes, first listed innermost.
//   global         every rank, in global rank order
//   data           dp                       pipeline   pp
//   tensor, 1d     tp                       sequence   sp
//   data_sequence  (sp, dp), sp inner       model      (tp, pp), tp inner
// Inside the tensor group, with tensor-local rank t:
//   2d   (tp = q²)    t = i·q + j (row i, column j)
//        2d_row: fixed i, vary j         2d_col: fixed j, vary i
//   2.5d (tp = q²·d)  t = k·q² + i·q + j (depth k, row i, column j)
//        2.5d_row: fixed (k, i), vary j  2.5d_col: fixed (k, j), vary i
//        2.5d_dep: fixed (i, j), vary k  2.5d_xz: fixed j, vary (i, k), i inner
//        (xz = col × dep: every batch shard of one hidden shard, the groups of
//        Colossal-AI's PARALLEL_2P5D_XZ)
//   3d   (tp = q³)     t = i + q·j + q²·k
//        3d_input: vary j    3d_weight: vary k    3d_output: vary i
//        3d_input_weight: fixed i, vary (j, k), j inner
//        3d_output_weight: fixed j, vary (i, k), i inner
// Expert (ep divides dp), with data-local rank d:
//   expert: fixed d / ep, vary d % ep (consecutive data ranks)
//   expert_data: fixed d % ep, vary d / ep
// Sequence mode hybrid (sp = U·R, U = sequence_ulysses), with sequence-local
// rank s = r·U + u (Note [Hybrid sequence groups] in parallel_config.cpp):
//   sequence_ulysses: fixed r, vary u (U adjacent sequence ranks)
//   sequence_ring:    fixed u, vary r
// These two exist only in sequence mode hybrid.
// In 2d and 2.5d, the local rank in 2d_col / 2.5d_col is the row index i and
// the local rank in 2d_row / 2.5d_row is the column index j.
class RankGrid {
 public:
  // config is resolved (and so checked) again here against world_size.
  RankGrid(const ParallelConfig& config, int world_size);

  const ParallelConfig& config() const { return config_; }
  int world_size() const { return world_size_; }

  // Size and stride of one grid dimension.
  int dim_size(Dim dim) const;
  int stride(Dim dim) const;
  // Coordinate of global_rank along dim, in [0, dim_size(dim)).
  int coordinate(Dim dim, int global_rank) const;
  // The global rank at the given coordinates, indexed by Dim.
  int global_rank_at(const std::array<int, kNumDims>& coordinates) const;

  // Note [Layout arithmetic]
  // What the layers, ShardedModule and the planner read off a layout,
  // computed here once:
  //   q()             the tensor arrangement's side: heads and hidden blocks
  //                   split over it (1d: tp; 2d, 2.5d: q; 3d: q)
  //   batch_blocks()  the parts the grid modes split a batch into: 1 in 1d,
  //                   q in 2d, q·depth in 2.5d, q² in 3d
  //   hidden_blocks() the parts one [rows, hidden] matrix is split into: tp,
  //                   but tp / depth in 2.5d (its depth replicates matrices)
  //   vocab_unit()    what the vocabulary is padded to a multiple of
  //   token_mode()    the group of ranks that hold different tokens of one
  //                   replica's batch: data, or data × sequence when sp > 1;
  //                   replicated parameters are reduced over it and MoE
  //                   statistics span it
  int q() const;
  int batch_blocks() const;
  int hidden_blocks() const;
  int vocab_unit() const;
  ParallelMode token_mode() const;
  // Tensor size > 1 in mode 2d, 2.5d or 3d.
  bool grid_tensor_mode() const;

  // Whether the mode has a group (and a communicator) under this config.
  bool has_mode(ParallelMode mode) const;
  // has_mode's modes, in all_modes() order.
  std::vector<ParallelMode> modes() const;

  // The functions below throw if !has_mode(mode), naming the mode and the
  // tensor mode.
  int group_size(ParallelMode mode) const;
  // Position of global_rank in its group of mode.
  int local_rank(ParallelMode mode, int global_rank) const;
  // Members of global_rank's group, in group order (element r has local rank r).
  std::vector<int> group_of(ParallelMode mode, int global_rank) const;
  // Index of global_rank's group within groups(mode); ParallelContext splits
  // with it as the color.
  int group_index(ParallelMode mode, int global_rank) const;
  // Every group of mode, each in group order, groups ordered by first member.
  std::vector<std::vector<int>> groups(ParallelMode mode) const;

  // Note [Seeds per mode]
  // A mode's seed differs between the ranks of that mode's group and between
  // pipeline stages, and is equal across the other dimensions. Dropout drawn
  // with it therefore differs where activations are sharded along the mode
  // and is identical where they are replicated (same local rank in the mode,
  // same stage). It is splitmix64 applied to (base_seed, mode, local rank in
  // the mode, pipeline coordinate); kGlobal's seed is base_seed on all ranks.
  uint64_t seed_for(ParallelMode mode, int global_rank, uint64_t base_seed) const;

  // Several lines for logs and demos: the config, the coordinates of
  // global_rank, and for every mode its local rank, members and seed.
  std::string describe(int global_rank) const;

 private:
  // Note [Fine axes]
  // The grid is kept as eight axes: tensor split into up to three sub-axes
  // (their meaning depends on the tensor mode), sequence split into
  // (s % U, s / U) (U = 1 outside hybrid), data split into (d % ep, d / ep),
  // and pipeline. Every mode is a list of axes to vary.
  enum Axis { kT0, kT1, kT2, kS0, kS1, kE0, kE1, kPipe, kNumAxes };
  using Coords = std::array<int, kNumAxes>;

  Coords split(int global_rank) const;
  int join(const Coords& coords) const;
  std::vector<Axis> varying_axes(ParallelMode mode) const;
  void check_mode(ParallelMode mode) const;
  void check_rank(int global_rank) const;

  ParallelConfig config_;
  int world_size_;
  std::array<int, kNumDims> dim_size_{};
  std::array<int, kNumDims> stride_{};
  std::array<int, kNumAxes> axis_size_{};
};

}  // namespace context
}  // namespace tessera
