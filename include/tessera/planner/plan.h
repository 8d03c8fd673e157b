#pragma once
// A plan: everything the planner chooses for a training job. It maps onto
// a ParallelConfig, a ShardingSpec and TrainerOptions (docs/planner.md).
#include "tessera/context/parallel_config.h"
#include "tessera/parallel/offload.h"
#include "tessera/parallel/pipeline_schedule.h"
#include "tessera/parallel/sharding_spec.h"

#include <cstdint>
#include <string>

namespace tessera {
namespace planner {

struct Plan {
  // Sizes resolved (data given, not 0).
  context::ParallelConfig grid;
  parallel::ShardingSpec spec = parallel::ShardingSpec::ddp();
  // Sequences per optimizer step, over all data replicas.
  int64_t global_batch = 8;
  // Micro-batches per step and replica: the pipeline's, or gradient
  // accumulation steps without a pipeline.
  int64_t micro_batches = 1;
  parallel::ScheduleKind schedule = parallel::ScheduleKind::k1F1B;
  int chunks = 1;  // stages per pipeline rank (interleaved; 2 in a V for zb-v and dualpipev)
  bool checkpoint_activations = false;
  // Optimizer states and fp32 masters: with the parameters, or in host
  // memory, stepped there (the planner does not model disk).
  parallel::Offload offload = parallel::Offload::kNone;
  // bf16 parameters and gradients with fp32 masters in the optimizer
  // (2Ψ/s_p + 2Ψ/s_g + 12Ψ/s_os); false: fp32 everywhere (4 + 4 + 8).
  bool bf16 = false;
  // Every expert's matrices split over the 1D tensor group (Note [Expert
  // tensor parallelism] in nn/moe.cpp); a no-op at tensor size 1.
  bool expert_tensor_parallel = false;

  int world() const;
  int64_t replica_batch() const;      // sequences per data replica and step
  int64_t micro_batch_rows() const;   // sequences per micro-batch
  // The pipeline rank holding stage `stage`: s % pp, or the V of zb-v and
  // dualpipev (Note [Pipeline stages and messages]).
  int pipeline_rank_of(int stage) const;
  // One line: "dp8 pp1 tp1(1d) sp1 ep1 {R,R,S} mb1 1f1b ckpt=0 offload=0 fp32".
  std::string to_string() const;
  std::string to_json() const;
};

}  // namespace planner
}  // namespace tessera
