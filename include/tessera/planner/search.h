#pragma once
// The search over plans (docs/planner.md): every grid, sharding spec,
// micro-batch count, schedule, activation checkpointing and offload choice
// the options allow, AMSP's placement rules for the specs, pruned by the
// memory limit, ranked by predicted step time.
#include "tessera/planner/estimate.h"

#include <torch/arg.h>

#include <vector>

namespace tessera {
namespace planner {

struct SearchOptions {
  TORCH_ARG(int64_t, global_batch) = 8;  // sequences per step
  TORCH_ARG(double, memory_limit) = 0;   // bytes per rank; 0: the cluster's memory
  TORCH_ARG(bool, bf16) = true;
  TORCH_ARG(int, top) = 5;
  // What may vary. Empty lists mean: tensor {1d}, sequence {ulysses} (only
  // tried with sp > 1), schedules {1f1b, interleaved, zb-h1, zb-v}.
  TORCH_ARG(std::vector<context::TensorMode>, tensor_modes) = {};
  TORCH_ARG(std::vector<context::SequenceMode>, sequence_modes) = {};
  TORCH_ARG(std::vector<parallel::ScheduleKind>, schedules) = {};
  TORCH_ARG(int, max_tensor) = 0;    // 0: ranks per node
  TORCH_ARG(int, max_sequence) = 1;  // sequence parallelism off unless raised
  TORCH_ARG(int, max_pipeline) = 0;  // 0: no limit
  TORCH_ARG(int, expert) = 0;        // 0: every size that divides the experts and dp
  TORCH_ARG(bool, checkpointing) = true;  // also try activation checkpointing
  TORCH_ARG(bool, offload) = false;       // also try offloading the optimizer to host memory
  // Only these specs (resolved at each dp); empty: every spec AMSP's rules allow.
  TORCH_ARG(std::vector<parallel::ShardingSpec>, specs) = {};
  TORCH_ARG(int64_t, max_micro_batches) = 64;

 public:
  SearchOptions() = default;
};

struct SearchResult {
  std::vector<Estimate> best;  // fitting, fastest first (at most options.top)
  int64_t considered = 0;
  int64_t over_memory = 0;
  int64_t invalid = 0;
  // The fastest of the plans over the limit, to say what memory would buy.
  std::vector<Estimate> over;
};

// The specs AMSP's rules allow at data size dp with `data_per_node` data
// ranks in a node: degrees 1 ≤ s_p ≤ s_g ≤ s_os, each dividing the next and
// dp, each either inside a node (dividing data_per_node) or whole nodes (a
// multiple of it): a shard group fills a node before it spans nodes.
std::vector<parallel::ShardingSpec> amsp_specs(int dp, int data_per_node);

SearchResult search(const ModelDesc& model, const ClusterDesc& cluster, const SearchOptions& options);

}  // namespace planner
}  // namespace tessera
