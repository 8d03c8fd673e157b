#pragma once
// The communication of one training step on one rank, predicted from the
// model, the plan and the rank's pipeline stage: per group and collective,
// the calls and the bytes the tracing communicator would record (Note
// [Trace byte counts]) and the bus bytes that set the time.
//
// Note [One function per mode]
// Each tensor mode and each sequence mode has one function that adds its
// layers' traffic for one micro-batch of one stage (tensor_traffic_1d, ...,
// sequence_traffic_ring); a table maps the mode to it. Data-parallel
// sharding, experts and the pipeline's messages are one function each too.
// A new mode adds its function and its table entry; nothing else changes.
// Each function's comment names the layer code whose collectives it counts.
#include "tessera/comm/communicator.h"
#include "tessera/context/rank_grid.h"
#include "tessera/planner/model_desc.h"
#include "tessera/planner/plan.h"

#include <string>
#include <vector>

namespace tessera {
namespace planner {

struct Collective {
  std::string component;  // "tensor", "sequence", "expert", "pipeline", "params", "grads", "optimizer", "partial"
  context::ParallelMode mode = context::ParallelMode::kData;
  // The communicator name the tracing decorator records: the mode's name, or
  // a data sub-group's ("data.shard1-2", "data.replica2", "pipeline.tied").
  std::string group;
  comm::OpType op = comm::OpType::kAllReduce;
  int size = 1;  // ranks in the group
  double calls = 0;
  double bytes = 0;
  double bus_bytes = 0;
  // Hidden behind compute by the executor (gradient reduction during
  // backward, prefetched gathers); the rest is on the critical path.
  bool overlapped = false;
  // Where the group lies: nodes it spans and its ranks in each (place()).
  int nodes = 1;
  int per_node = 1;
};

// Which layers one pipeline stage of the model holds (GPT's sequence:
// "embed", blocks, "head").
struct StageShape {
  int stage = 0;
  int64_t first_block = 0, blocks = 0;
  bool embed = true, head = true;
};

// The stage shapes of pipeline rank `pp_rank` under the plan's partition
// by layer count (interleaved: every chunk of the rank).
std::vector<StageShape> stages_of(const ModelDesc& model, const Plan& plan, int pp_rank);

class Traffic {
 public:
  // Adds `calls` calls of `elements` each (traced size, in elements of
  // `element_bytes`), merging into an item of the same component, group and op.
  void add(const std::string& component, context::ParallelMode mode, const std::string& group, int size,
           comm::OpType op, double calls, double elements, double element_bytes, bool overlapped = false);
  const std::vector<Collective>& items() const { return items_; }
  std::vector<Collective>& items() { return items_; }
  // Summed over components.
  double bytes(const std::string& group, comm::OpType op) const;
  double total_bytes() const;
  double total_bus_bytes() const;

 private:
  std::vector<Collective> items_;
};

// What the traffic functions are given.
struct TrafficInput {
  const ModelDesc& model;
  const Plan& plan;
  const StageShape& stage;
  double rows = 1;      // sequences of one micro-batch on this data replica
  double act_bytes = 4;  // bytes per activation element
};

using TrafficFn = void (*)(const TrafficInput& in, Traffic& out);

// Note [One function per mode]: one micro-batch's forward and backward.
void tensor_traffic_1d(const TrafficInput& in, Traffic& out);
void tensor_traffic_2d(const TrafficInput& in, Traffic& out);
void tensor_traffic_2p5d(const TrafficInput& in, Traffic& out);
void tensor_traffic_3d(const TrafficInput& in, Traffic& out);
void sequence_traffic_ulysses(const TrafficInput& in, Traffic& out);
void sequence_traffic_ring(const TrafficInput& in, Traffic& out);
void sequence_traffic_rsa(const TrafficInput& in, Traffic& out);
void sequence_traffic_hybrid(const TrafficInput& in, Traffic& out);
void expert_traffic(const TrafficInput& in, Traffic& out);
TrafficFn tensor_traffic(context::TensorMode mode);
TrafficFn sequence_traffic(context::SequenceMode mode);

// Per step: the pipeline's activation and gradient messages, and the tied
// embedding's gradient sum between the first and last stage.
void pipeline_traffic(const ModelDesc& model, const Plan& plan, int pp_rank, Traffic& out);
// Per step: gathering sharded parameters, reducing gradients into their
// placement, gathering updated optimizer shards back, and the sums of
// gradients that are partial over other groups (docs/data-parallel.md).
void data_traffic(const ModelDesc& model, const Plan& plan, int pp_rank, Traffic& out);

// Parameters one rank of pipeline rank `pp_rank` holds, by the group its
// gradient is reduced over (the data group, or the expert-data group), and
// those whose gradients are also partial sums over a tensor group
// (nn/placement.h): vectors over 2D's col, everything over 2.5D's depth, ...
struct LocalParams {
  double dense = 0;   // reduced over data (× sequence)
  double expert = 0;  // reduced over expert-data
  std::vector<std::pair<context::ParallelMode, double>> partial;  // of `dense`, per group
};
LocalParams local_params(const ModelDesc& model, const Plan& plan, int pp_rank);
// The same for the given stages alone (a tied table counted once where the
// embedding is among them).
LocalParams local_params(const ModelDesc& model, const Plan& plan, const std::vector<StageShape>& stages);

// Everything one rank moves in a step: data_traffic, pipeline_traffic and
// every micro-batch of its stages' mode functions.
Traffic predict_traffic(const ModelDesc& model, const Plan& plan, int global_rank = 0);

// Fills nodes and per_node of every item from the rank grid and the ranks
// per node (global rank r on node r / gpus_per_node).
void place(Traffic& traffic, const Plan& plan, int gpus_per_node, int global_rank = 0);

// Note [Reductions across nodes in the plan]
// What comm::HierarchicalCommunicator does to the collectives of the data
// group and of its splits (ZeRO's shard levels, replica groups; "<group>"
// below) when the group spans nodes, evenly with L >= 2 of its n >= 4 ranks on
// each of H nodes: a call of m >= its kMinElements elements becomes a
// reduce-scatter and an all-gather of the padded tensor (m rounded up to a
// multiple of n) on "<group>.host" (L ranks, inside the node) and a ring of
// 2(H - 1) sends and receives of m/n elements on "<group>.cross" (H ranks,
// one per node). Its reduce-scatters and all-gathers of m elements (the
// whole tensor) stay the same collective on "<group>.host" and add H - 1
// sends and receives of m/n elements on "<group>.cross" (Note [Scatters and
// gathers by host]), at any size. All-reduces under the threshold stay
// flat. Reads the nodes place() filled in.
void route_through_hosts(Traffic& traffic, const Plan& plan);

// The ranks of the group a rank's gradients are reduced over (data, or data
// x sequence) on its node: the k of P(host).
int data_ranks_per_node(const Plan& plan, int gpus_per_node, int global_rank = 0);
// The plan with P(host) placements resolved for nodes of gpus_per_node ranks.
Plan on_nodes(Plan plan, int gpus_per_node);

// What one rank puts on the wire for traced `bytes` of op over n ranks
// (Note [Trace byte counts]).
double bus_bytes_of(comm::OpType op, int n, double bytes);

}  // namespace planner
}  // namespace tessera
