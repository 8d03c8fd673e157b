#include "tessera/train/run_plan.h"

#include "tessera/context/hosts.h"
#include "tessera/optim/by_name.h"
#include "tessera/parallel/whole_norms.h"
#include "tessera/planner/report.h"
#include "tessera/planner/search.h"
#include "tessera/train/gpt_run.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace tessera {
namespace train {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

void barrier(comm::Communicator& world) { world.control()->barrier()->wait(); }

}  // namespace

MeasuredRates measure_rates(const planner::ModelDesc& model, TrainModel serial, const OptimizerFactory& make_optimizer,
                            int64_t rows, double clip, bool bf16, comm::Communicator& world) {
  using Clock = std::chrono::steady_clock;
  std::vector<std::pair<std::string, at::Tensor>> params;
  int64_t numel = 0;
  for (const auto& p : serial.layers->named_parameters()) {
    params.emplace_back(p.key(), p.value());
    numel += p.value().numel();
  }
  auto optimizer = make_optimizer(params);
  std::vector<at::Tensor> tensors;
  for (const auto& p : params) tensors.push_back(p.second);
  // Forward + backward at `n` rows, and the optimizer step after it.
  auto time_pass = [&](int64_t n, std::vector<double>* opt, double* mean_pass) {
    // Tokens without the process's generator (as measured_matmul_flops).
    const at::Tensor x =
        at::arange(n * model.seq(), at::kLong).mul_(7919).remainder(model.vocab()).view({n, model.seq()});
    const at::Tensor y = x.roll(1, 1);
    std::vector<double> pass, own;
    for (int i = 0; i < 7; ++i) {
      barrier(world);
      const auto t0 = Clock::now();
      optimizer->zero_grad();
      serial.loss(serial.layers->forward(x), y).backward();
      const auto t1 = Clock::now();
      if (clip > 0) parallel::clip_grad_norm(tensors, clip);
      optimizer->step();
      const auto t2 = Clock::now();
      const double mine = std::chrono::duration<double>(t1 - t0).count();
      // Both times of the slowest rank (the step's collectives wait for it).
      const auto slowest = max_over_ranks({mine, std::chrono::duration<double>(t2 - t1).count()}, world);
      if (i < 2) continue;  // warm-up
      pass.push_back(slowest[0]);
      own.push_back(mine);
      if (opt) opt->push_back(slowest[1]);
    }
    if (mean_pass) *mean_pass = mean_over_ranks(median(own), world);
    return median(pass);
  };
  // Two sizes separate the part of a pass that grows with the rows (the
  // rate) from the part that does not (the overhead per block).
  const int64_t big = std::max<int64_t>(2, rows);
  std::vector<double> opt;
  double mean_big = 0;
  const double t_big = time_pass(big, &opt, &mean_big), t_one = time_pass(1, nullptr, nullptr);
  const double per_row = std::max((t_big - t_one) / static_cast<double>(big - 1), 1e-12);
  const double e = bf16 ? 2.0 : 4.0, states = bf16 ? 12.0 : 8.0;
  MeasuredRates r;
  r.flops = model.flops_per_sequence() / per_row;
  r.block_overhead = std::max(0.0, t_one - per_row) / static_cast<double>(model.layers());
  r.slowest_over_mean = mean_big > 0 ? t_big / mean_big : 1.0;
  r.optimizer_bytes_s = (2 * states + 3 * e) * static_cast<double>(numel) / median(opt);
  barrier(world);
  r.peak_flops = measured_matmul_flops();
  return r;
}

planner::ClusterDesc this_machine(const RunOptions& run, int world, const MeasuredRates& rates,
                                  const MeasuredLinks& links) {
  planner::ClusterDesc c;
  if (!run.cluster().empty()) c = planner::ClusterDesc::load(run.cluster());
  c.name = run.cluster().empty() ? (links.nodes > 1 ? "these hosts" : "this machine") : run.cluster();
  c.nodes = std::max(1, links.nodes);
  c.gpus_per_node = world / c.nodes;
  // Measured links replace the description's; --comm-bench's (one host's)
  // replace the measured ones inside a node.
  if (!links.intra.empty()) {
    c.intra = links.intra;
    c.intra_default = links.intra.at(comm::OpType::kAllReduce);
  }
  if (!links.inter.empty()) {
    c.inter = links.inter;
    c.inter_default = links.inter.at(comm::OpType::kAllReduce);
  }
  if (!run.comm_bench().empty()) c = planner::ClusterDesc::from_comm_bench_file(run.comm_bench(), c);
  c.host_reductions = context::host_reductions_from_env();
  // CPU ranks share this machine's cores (Note [Shared compute] in src/planner/estimate.cpp).
  c.compute_units = static_cast<int>(std::thread::hardware_concurrency());
  c.achieved_flops = rates.flops;
  c.block_overhead = rates.block_overhead;
  c.peak_flops = rates.peak_flops;
  c.memory_bandwidth = rates.optimizer_bytes_s;
  c.host_flops = rates.optimizer_bytes_s;  // the optimizer runs on this host either way
  if (run.memory_gb() > 0) c.memory_bytes = run.memory_gb() * 1e9;
  // --overlap, else the --cluster description's, else none (CPU ranks: docs/planner.md).
  if (run.was_given("overlap") || run.cluster().empty()) c.overlap = run.overlap();
  // Pipeline messages over MPI move only inside its calls (Note [Messages
  // nothing moves] in src/planner/estimate.cpp); NCCL's keep the cluster's.
  if (run.device() == "cpu" || run.backend() == comm::Backend::kMpi) c.message_overlap = 0;
  return c;
}

planner::Plan plan_of(const RunOptions& run, int world) {
  planner::Plan p;
  p.grid = context::resolve(run.grid(), world);
  p.spec = run.spec();
  p.global_batch = run.batch();
  TORCH_CHECK(p.grid.pipeline() == 1 || run.accumulation() == 1,
              "--plan flags: the planner describes a pipeline's micro-batches or gradient accumulation, not both; "
              "drop --accumulation with --pp > 1");
  p.micro_batches = p.grid.pipeline() > 1 ? run.pipeline_microbatches() : run.accumulation();
  p.schedule = run.schedule();
  p.chunks = run.chunks();
  p.checkpoint_activations = run.model().checkpoint_activations();
  TORCH_CHECK(run.offload() != parallel::Offload::kDisk,
              "--plan: the planner does not model disk offload; use --offload host");
  p.offload = run.offload();
  p.bf16 = run.bf16();
  p.expert_tensor_parallel = run.expert_tensor_parallel();
  return p;
}

void apply_plan(const planner::Plan& p, RunOptions& run) {
  const uint64_t seed = run.grid().seed();
  run.grid(context::ParallelConfig(p.grid).seed(seed));
  run.spec(p.spec);
  run.schedule(p.schedule);
  run.chunks(p.chunks);
  run.microbatches(p.grid.pipeline() > 1 ? p.micro_batches : 0);
  run.accumulation(p.grid.pipeline() > 1 ? int64_t{1} : p.micro_batches);
  run.model().checkpoint_activations(p.checkpoint_activations);
  run.offload(p.offload);
  run.expert_tensor_parallel(p.expert_tensor_parallel);
}

planner::Estimate plan_run(RunOptions& run, const comm::CommunicatorPtr& world, MetricsLog& log) {
  const context::HostMap hosts = context::map_hosts(*world);
  // Across hosts the links are measured (below); one host's come from a file.
  TORCH_CHECK(hosts.hosts() > 1 || !run.comm_bench().empty() || !run.cluster().empty(),
              "--plan needs the collectives' rates on one host: --comm-bench FILE (mpirun -np ", world->size(),
              " comm_bench --json > FILE, on these ranks) or --cluster PRESET|FILE.json");
  const MeasuredLinks links = measure_links(*world, hosts);  // Note [Measuring the links]
  const models::GPTConfig& cfg = run.model();
  const planner::ModelDesc model = planner::ModelDesc::gpt(cfg, cfg.context());
  // A serial copy on every rank measures the rates (Note [Rates for the planner]).
  auto self = world->split(world->rank(), 0, "planner_rates");
  MeasuredRates rates;
  {
    auto serial_cfg = cfg;
    serial_cfg.checkpoint_activations(false);  // the planner adds the recompute itself
    at::manual_seed(run.grid().seed());
    auto serial = std::make_shared<models::GPTImpl>(serial_cfg, nn::make_1d_factory(self, false, 1, 2));
    const auto by_name = optim::OptimizerByName().name(run.optimizer()).lr(run.lr()).weight_decay(run.weight_decay());
    const OptimizerFactory make_optimizer = [by_name](const auto& named) {
      return optim::make_optimizer(by_name, named);
    };
    rates = measure_rates(model, gpt_train_model(serial, run.precision()), make_optimizer,
                          std::max<int64_t>(1, run.batch() / world->size()), run.clip(), run.bf16(), *world);
  }
  const planner::ClusterDesc cluster = this_machine(run, world->size(), rates, links);
  if (links.nodes > 1) {
    auto gbs = [](const std::map<comm::OpType, planner::Link>& l, comm::OpType op) {
      return l.count(op) ? fmt::format("{:.3g}", l.at(op).bandwidth / 1e9) : std::string("-");
    };
    log.print(
        fmt::format("planner: {} hosts of {} ranks as nodes, measured: all-reduce {} GB/s inside a host, {} "
                    "GB/s out of a host; the ring across hosts {} GB/s out of a host, {:.3g} ms a step",
                    links.nodes, links.per_node, gbs(links.intra, comm::OpType::kAllReduce),
                    gbs(links.inter, comm::OpType::kAllReduce), gbs(links.inter, comm::OpType::kSend),
                    1e3 * links.inter.at(comm::OpType::kSend).latency));
  }
  // Across hosts the measured links replace --cluster's; --comm-bench's replace them inside a host.
  std::string collectives = run.comm_bench().empty() ? run.cluster() : run.comm_bench();
  if (links.nodes > 1)
    collectives =
        run.comm_bench().empty() ? "measured on these hosts" : collectives + " inside a host, measured across";
  log.print(
      fmt::format("planner: {}, measured: {:.3g} GFLOP/s per rank for this GPT (the slowest rank's passes, "
                  "{:.3g}x the mean rank's), {:.3g} ms per block and pass beside it, optimizer {:.3g} GB/s per "
                  "rank, {} cores; collectives {}; overlap {}, of pipeline messages across hosts {}",
                  links.nodes > 1 ? "these hosts" : "this machine", rates.flops / 1e9, rates.slowest_over_mean,
                  1e3 * rates.block_overhead, rates.optimizer_bytes_s / 1e9, cluster.compute_units,
                  links.nodes > 1 || collectives.empty() ? collectives : "from " + collectives, cluster.overlap,
                  cluster.message_overlap));
  if (run.plan() == PlanMode::kFlags) {
    const planner::Plan p = planner::on_nodes(plan_of(run, world->size()), cluster.gpus_per_node);
    planner::check_plan(model, p);
    const planner::Estimate chosen = planner::estimate(model, p, cluster);
    log.print(fmt::format("planner: the flags' plan\n{}\n{}{}", chosen.summary(), planner::breakdown(chosen),
                          chosen.to_json()));
    return chosen;
  }
  const auto o = planner::SearchOptions()
                     .global_batch(run.batch())
                     .memory_limit(cluster.memory_bytes)
                     .bf16(run.bf16())
                     .top(static_cast<int>(run.plan_top()))
                     .offload(true);
  const planner::SearchResult r = planner::search(model, cluster, o);
  if (r.best.empty()) {
    std::string msg = fmt::format("--plan auto: no plan of this GPT fits in {:.4g} GB per rank on {} ranks",
                                  cluster.memory_bytes / 1e9, world->size());
    if (!r.over.empty())
      msg += fmt::format("; the closest, {}, {}", r.over.front().plan.to_string(), r.over.front().why);
    TORCH_CHECK(false, msg, ". Raise --memory-gb or use more ranks");
  }
  log.print(planner::search_report(model, cluster, o, r, false));
  log.print(planner::search_report(model, cluster, o, r, true));
  apply_plan(r.best.front().plan, run);
  return r.best.front();
}

double median_step(std::vector<double> seconds) {
  seconds.erase(seconds.begin(), seconds.begin() + static_cast<std::ptrdiff_t>(seconds.size() / 4));
  return median(std::move(seconds));
}

}  // namespace train
}  // namespace tessera
