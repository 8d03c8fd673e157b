#pragma once
// --plan auto|flags of a training run (docs/planner.md, "train_gpt --plan"):
// the planner's description of the run (the GPT, the batch, the ranks and
// this machine's measured rates), its choice of layout when asked for
// auto, its prediction of the options' layout when asked for flags.
#include "tessera/comm/communicator.h"
#include "tessera/planner/estimate.h"
#include "tessera/planner/plan.h"
#include "tessera/train/link_rates.h"
#include "tessera/train/metrics.h"
#include "tessera/train/run_options.h"
#include "tessera/train/trainer.h"

#include <cstdint>
#include <vector>

namespace tessera {
namespace train {

// Note [Rates for the planner]
// The planner needs what this machine does with this model, not its peak:
// every rank trains a serial copy of the GPT at once (so that the ranks
// share the cores as they will in training) on one sequence and on `rows`;
// each pass counts at its slowest rank's time, since in a step the others
// wait for that rank at the first collective (8 ranks on 2 cores: 1.03x
// their mean; train_gpt --plan logs the ratio); the median
// forward + backward times give the FLOP rate (the planner's
// FLOPs of the extra rows over the extra time) and the time per block that
// does not grow with the rows (dispatch; what is left of one row's pass);
// the median optimizer step (gradient clipping included, as the trainer
// runs it) gives the rate at which the planner's optimizer bytes (Ψ times
// the states, gradient and parameter read and written) move. The
// collectives' rates come from comm_bench (--comm-bench), the overlap from
// the option, the cores the ranks share from the machine: none of them is
// fitted to the steps it predicts.
struct MeasuredRates {
  double flops = 0;              // per rank
  double optimizer_bytes_s = 0;  // per rank
  double peak_flops = 0;         // a dense matmul's, per rank (for MFU)
  double block_overhead = 0;     // seconds per block and pass that do not grow with the rows
  double slowest_over_mean = 1;  // the slowest rank's pass over the mean rank's (for the log)
};

// Collective over `world`: times `serial` (a model on this rank alone).
MeasuredRates measure_rates(const planner::ModelDesc& model, TrainModel serial, const OptimizerFactory& make_optimizer,
                            int64_t rows, double clip, bool bf16, comm::Communicator& world);

// The run's machines as the planner sees them: one node of `world` ranks,
// or the hosts of `links` as nodes with the links measured between and
// inside them; the collectives inside a node from --comm-bench or --cluster
// when given; the rates measured.
planner::ClusterDesc this_machine(const RunOptions& run, int world, const MeasuredRates& rates,
                                  const MeasuredLinks& links = {});

// The plan the options describe, and the options a plan gives.
planner::Plan plan_of(const RunOptions& run, int world);
void apply_plan(const planner::Plan& plan, RunOptions& run);

// Collective over `world`: measures the rates (and the links between hosts
// when the ranks span several), then searches (auto: the best plan is written into `run`) or
// estimates the options' plan (flags); the report goes through `log`.
planner::Estimate plan_run(RunOptions& run, const comm::CommunicatorPtr& world, MetricsLog& log);

// The median of step times after the first quarter (warm-up).
double median_step(std::vector<double> seconds);

}  // namespace train
}  // namespace tessera
