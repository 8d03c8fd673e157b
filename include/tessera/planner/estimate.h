#pragma once
// Step time, memory and MFU of one plan on one cluster (docs/planner.md):
// compute from FLOPs at the cluster's rate, each collective at its link's
// bandwidth and latency, the pipeline's bubble from the schedule simulator,
// and only the overlap the executor achieves.
#include "tessera/planner/cluster.h"
#include "tessera/planner/memory.h"
#include "tessera/planner/traffic.h"

#include <map>
#include <string>

namespace tessera {
namespace planner {

struct Estimate {
  Plan plan;
  Traffic traffic;  // of the slowest pipeline rank, placed on the cluster
  MemoryEstimate memory;  // of the first pipeline rank
  double compute_s = 0;   // one rank's forward and backward compute (all micro-batches)
  double pipeline_s = 0;  // the schedule's makespan: compute, blocking tensor/sequence/expert traffic, messages, bubble
  double bubble = 0;      // fraction of the makespan a rank idles
  std::map<std::string, double> comm_s;  // seconds per component (before overlap)
  double data_exposed_s = 0;  // data-parallel communication not hidden behind compute
  double optimizer_s = 0;     // the optimizer step (and offload transfers)
  double step_s = 0;
  double mfu = 0;
  double tokens_per_s = 0;
  bool fits = true;
  std::string why;  // when it does not fit, or is not a valid plan
  // A table row and a JSON object.
  std::string summary() const;
  std::string to_json() const;
};

// Throws c10::Error naming the rule when the plan is not one tessera can
// run (sizes, spec, batch splits).
void check_plan(const ModelDesc& model, const Plan& plan);

// memory_limit: bytes per rank; 0 uses the cluster's memory.
Estimate estimate(const ModelDesc& model, const Plan& plan, const ClusterDesc& cluster, double memory_limit = 0);

}  // namespace planner
}  // namespace tessera
