#pragma once
// train_gpt --plan (docs/planner.md, "train_gpt --plan"): the planner's
// description of this run (the GPT, the batch, the ranks and this machine's
// measured rates), its choice of layout when asked for `auto`, its
// prediction for the layout the flags give when asked for `flags`, and the
// measured step time beside the predicted one at the end.
#include <tessera/planner/report.h>
#include <tessera/parallel/whole_norms.h>
#include <tessera/train/metrics.h>
#include <tessera/train/trainer.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tessera_examples {

// The flags --plan auto chooses; giving one beside it is refused.
inline const std::vector<std::string>& planned_keys() {
  static const std::vector<std::string> keys = {"dp",     "pp",       "tp",          "tp_mode",
                                                "tp_depth", "sp",     "sp_mode",     "ep",
                                                "spec",   "schedule", "microbatches", "chunks",
                                                "accumulation", "checkpoint_activations", "offload"};
  return keys;
}

// The plan the layout flags describe (for --plan flags).
inline tessera::planner::Plan plan_of_flags(const nlohmann::json& a, const tessera::context::ParallelConfig& layout,
                                            int world) {
  tessera::planner::Plan p;
  p.grid = tessera::context::resolve(layout, world);
  p.spec = tessera::parallel::ShardingSpec::parse(a["spec"].get<std::string>());
  p.global_batch = a["batch"].get<int64_t>();
  const int64_t micro = a["microbatches"].get<int64_t>();
  TORCH_CHECK(p.grid.pipeline() == 1 || a["accumulation"].get<int64_t>() == 1,
              "--plan flags: the planner describes a pipeline's micro-batches or gradient accumulation, not both; "
              "drop --accumulation with --pp > 1");
  p.micro_batches = p.grid.pipeline() > 1 ? (micro > 0 ? micro : 2 * p.grid.pipeline())
                                          : a["accumulation"].get<int64_t>();
  p.schedule = tessera::parallel::parse_schedule_kind(a["schedule"].get<std::string>());
  p.chunks = a["chunks"].get<int>();
  p.checkpoint_activations = a["checkpoint_activations"].get<bool>();
  TORCH_CHECK(a["offload"] != "optimizer:disk", "--plan: the planner does not model disk offload; use --offload optimizer");
  p.offload = a["offload"] == "optimizer";
  p.bf16 = a["precision"] == "bf16";
  return p;
}

// Writes the plan into the flags train_gpt reads.
inline void apply_plan(const tessera::planner::Plan& p, nlohmann::json& a) {
  const auto& g = p.grid;
  a["dp"] = g.data();
  a["pp"] = g.pipeline();
  a["tp"] = g.tensor();
  a["tp_mode"] = tessera::context::tensor_mode_name(g.tensor_mode());
  a["tp_depth"] = g.tensor_depth();
  a["sp"] = g.sequence();
  a["sp_mode"] = tessera::context::sequence_mode_name(g.sequence_mode());
  a["ep"] = g.expert();
  a["spec"] = p.spec.to_string();
  a["schedule"] = tessera::parallel::to_string(p.schedule);
  a["chunks"] = p.chunks;
  a["microbatches"] = g.pipeline() > 1 ? p.micro_batches : 0;
  a["accumulation"] = g.pipeline() > 1 ? int64_t{1} : p.micro_batches;
  a["checkpoint_activations"] = p.checkpoint_activations;
  a["offload"] = p.offload ? "optimizer" : "none";
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// The mean over ranks of a time each rank measured while all ran at once.
inline double mean_over_ranks(double seconds) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return seconds / size;
}

// Note [Rates for the planner]
// The planner needs what this machine does with this model, not its peak:
// every rank trains a serial copy of the GPT at once (so that the ranks
// share the cores as they will in training) on one sequence and on `rows`;
// the median forward + backward times give the FLOP rate (the planner's
// FLOPs of the extra rows over the extra time) and the time per block that
// does not grow with the rows (dispatch; what is left of one row's pass);
// the median optimizer step (gradient clipping included, as
// the trainer runs it) gives the rate at which the planner's optimizer
// bytes (Ψ times the states, gradient and parameter read and written) move.
// The collectives' rates come from comm_bench (--comm-bench), the overlap
// from the flag, the cores the ranks share from the machine: none of them
// is fitted to the steps it predicts.
struct MeasuredRates {
  double flops = 0;             // per rank
  double optimizer_bytes_s = 0;  // per rank
  double peak_flops = 0;         // a dense matmul's, per rank (for MFU)
  double block_overhead = 0;     // seconds per block and pass that do not grow with the rows
};

inline MeasuredRates measure_rates(const tessera::planner::ModelDesc& model, tessera::train::TrainModel serial,
                                   const tessera::train::OptimizerFactory& make_optimizer, int64_t rows,
                                   double clip, bool bf16) {
  using Clock = std::chrono::steady_clock;
  auto named = serial.layers->named_parameters();
  std::vector<std::pair<std::string, at::Tensor>> params;
  int64_t numel = 0;
  for (const auto& p : named) {
    params.emplace_back(p.key(), p.value());
    numel += p.value().numel();
  }
  auto optimizer = make_optimizer(params);
  std::vector<at::Tensor> tensors;
  for (const auto& p : params) tensors.push_back(p.second);
  // Forward + backward at `n` rows, and the optimizer step after it.
  auto time_pass = [&](int64_t n, std::vector<double>* opt) {
    const at::Tensor x = at::randint(model.vocab(), {n, model.seq()}, at::kLong);
    const at::Tensor y = at::randint(model.vocab(), {n, model.seq()}, at::kLong);
    std::vector<double> pass;
    for (int i = 0; i < 7; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = Clock::now();
      optimizer->zero_grad();
      serial.loss(serial.layers->forward(x), y).backward();
      const auto t1 = Clock::now();
      if (clip > 0) tessera::parallel::clip_grad_norm(tensors, clip);
      optimizer->step();
      const auto t2 = Clock::now();
      if (i < 2) continue;  // warm-up
      pass.push_back(std::chrono::duration<double>(t1 - t0).count());
      if (opt) opt->push_back(std::chrono::duration<double>(t2 - t1).count());
    }
    return mean_over_ranks(median(pass));
  };
  // Two sizes separate the part of a pass that grows with the rows (the
  // rate) from the part that does not (the overhead per block).
  const int64_t big = std::max<int64_t>(2, rows);
  std::vector<double> opt;
  const double t_big = time_pass(big, &opt), t_one = time_pass(1, nullptr);
  const double per_row = std::max((t_big - t_one) / static_cast<double>(big - 1), 1e-12);
  const double e = bf16 ? 2.0 : 4.0, states = bf16 ? 12.0 : 8.0;
  MeasuredRates r;
  r.flops = model.flops_per_sequence() / per_row;
  r.block_overhead = std::max(0.0, t_one - per_row) / static_cast<double>(model.layers());
  r.optimizer_bytes_s = (2 * states + 3 * e) * static_cast<double>(numel) / mean_over_ranks(median(opt));
  MPI_Barrier(MPI_COMM_WORLD);
  r.peak_flops = tessera::train::measured_matmul_flops();
  return r;
}

// This machine as the planner sees it: one node of `world` ranks, the
// collectives from comm_bench's lines, the rates measured above.
inline tessera::planner::ClusterDesc this_machine(const nlohmann::json& a, bool overlap_given, int world,
                                                  const MeasuredRates& rates) {
  tessera::planner::ClusterDesc c;
  const std::string base = a["cluster"];
  if (!base.empty()) c = tessera::planner::ClusterDesc::load(base);
  c.name = base.empty() ? "this machine" : base;
  c.nodes = 1;
  c.gpus_per_node = world;
  const std::string bench = a["comm_bench"];
  if (!bench.empty()) c = tessera::planner::ClusterDesc::from_comm_bench_file(bench, c);
  // CPU ranks share this machine's cores (Note [Shared compute] in src/planner/estimate.cpp).
  c.compute_units = static_cast<int>(std::thread::hardware_concurrency());
  c.achieved_flops = rates.flops;
  c.block_overhead = rates.block_overhead;
  c.peak_flops = rates.peak_flops;
  c.memory_bandwidth = rates.optimizer_bytes_s;
  c.host_flops = rates.optimizer_bytes_s;  // the optimizer runs on this host either way
  if (a["memory_gb"].get<double>() > 0) c.memory_bytes = a["memory_gb"].get<double>() * 1e9;
  // --overlap, else the --cluster description's, else none (CPU ranks: docs/planner.md).
  const double overlap = a["overlap"];
  TORCH_CHECK(overlap >= 0 && overlap <= 1, "--overlap is a fraction in [0, 1], got ", overlap);
  if (overlap_given || base.empty()) c.overlap = overlap;
  return c;
}

// The median of the step times after the first quarter (warm-up).
inline double median_step(std::vector<double> seconds) {
  seconds.erase(seconds.begin(), seconds.begin() + static_cast<std::ptrdiff_t>(seconds.size() / 4));
  return median(std::move(seconds));
}

}  // namespace tessera_examples
