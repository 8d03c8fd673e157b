#pragma once
// Memory per rank predicted for a plan (docs/planner.md): model states by the
// ZeRO/AMSP formula over the rank's own parameters, activations per layer
// and micro-batch times the micro-batches a pipeline rank holds at once
// (from the schedule simulator), and the transient buffers of sharding.
#include "tessera/planner/model_desc.h"
#include "tessera/planner/plan.h"

namespace tessera {
namespace planner {

struct MemoryEstimate {
  // Model states after a step, as ShardedOptimizer::memory() counts them:
  // parameters e·Ψ/s_p, gradients e·Ψ/s_g, AdamW's two fp32 moments (and
  // fp32 masters with bf16 parameters) 8Ψ/s_os (12Ψ/s_os).
  double params = 0, grads = 0, optim = 0;
  // In host memory instead of the device's under offload (optimizer states
  // and masters).
  double host = 0;
  // Activations kept for backward at the peak: one micro-batch's per layer
  // times the micro-batches in flight.
  double activations = 0;
  int inflight = 1;
  // Sharded parameters gathered for use (the unit in use and the one
  // prefetched), full gradients of a stage before they are reduced.
  double buffers = 0;
  double states() const { return params + grads + optim; }
  double peak() const { return states() + activations + buffers; }
};

// For the rank of the plan's first pipeline stage (it holds the most
// micro-batches in flight) or `global_rank`'s stage.
MemoryEstimate predict_memory(const ModelDesc& model, const Plan& plan, int global_rank = 0);

// Activation bytes one micro-batch leaves for backward in one block, on
// one rank (Note [Activation memory] in memory.cpp).
double block_activation_bytes(const ModelDesc& model, const Plan& plan);

}  // namespace planner
}  // namespace tessera
