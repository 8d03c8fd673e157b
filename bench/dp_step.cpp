// dp_step: one data-parallel training step (forward, backward, AdamW) of an
// MLP wrapped in ShardedModule, for each sharding spec, with what it costs
// apart: the same compute without communication (plain LibTorch on the local
// batch, optimizer over the local shard's size), the same communication
// without compute (the step's collectives on the same buckets), the bytes
// moved (tracing decorator) and the model-state memory (peak and formula).
// A raw MPI_Allreduce of the gradients is timed as the DDP baseline.
// Prints one JSON object per spec.
//
//   mpirun -np 4 dp_step [--hidden 1024] [--layers 4] [--batch 64] [--steps 5]
//       [--warmup 2] [--rounds 3] [--bucket-mb 25] [--specs ddp,zero1,zero2,zero3,hpz:2,{R,P(2),S},mics:2]
#include "bench_util.h"

#include <tessera/parallel/flat_bucket.h>
#include <tessera/parallel/sharded_module.h>
#include <tessera/parallel/sharded_optimizer.h>
#include <tessera/tessera.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace {

using tessera::parallel::ShardedModule;
using tessera::parallel::ShardedModuleOptions;
using tessera::parallel::ShardedOptimizer;
using tessera::parallel::ShardingSpec;

struct Args {
  int64_t hidden = 1024, layers = 4, batch = 64, bucket_mb = 25;
  int64_t steps = 5, warmup = 2, rounds = 3;
  std::vector<std::string> specs = {"ddp", "zero1", "zero2", "zero3", "hpz:2", "{R,P(2),S}", "mics:2"};
  bench::Timing timing() const { return {int(steps), int(warmup), int(rounds)}; }
};

// Splits "ddp,{R,P(2),S}" at the commas outside braces and parentheses.
std::vector<std::string> split_specs(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  for (char c : text) {
    if (c == '(' || c == '{') ++depth;
    if (c == ')' || c == '}') --depth;
    if (c == ',' && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  std::string specs;
  bench::parse_flags(argc, argv,
                     {{"--hidden", &a.hidden},
                      {"--layers", &a.layers},
                      {"--batch", &a.batch},
                      {"--bucket-mb", &a.bucket_mb},
                      {"--steps", &a.steps},
                      {"--warmup", &a.warmup},
                      {"--rounds", &a.rounds}},
                     {{"--specs", &specs}}, "the comment at the top of bench/dp_step.cpp");
  if (!specs.empty()) a.specs = split_specs(specs);
  return a;
}

torch::nn::Sequential mlp(const Args& a) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < a.layers; ++i) {
    net->push_back(torch::nn::Linear(a.hidden, a.hidden));
    net->push_back(torch::nn::ReLU());
  }
  return net;
}

// The collectives of one step on the module's own buckets, without compute.
void comm_only_step(ShardedModule& m) {
  for (int pass = 0; pass < 2; ++pass) {  // before forward, before backward
    for (size_t b = 0; b < m.num_buckets(); ++b) m.bucket(b).start_gather();
    for (size_t b = 0; b < m.num_buckets(); ++b) m.bucket(b).wait_gather();
    for (size_t b = 0; b < m.num_buckets(); ++b) m.bucket(b).free_params();
  }
  std::vector<tessera::parallel::CommTask> tasks;
  for (size_t b = 0; b < m.num_buckets(); ++b) {
    tasks.push_back(m.bucket(b).reduce_grads());
    tasks.back().start();
  }
  for (size_t b = 0; b < m.num_buckets(); ++b) {
    tasks[b].wait();
    m.bucket(b).release_full_grads();
  }
  m.sync_params_after_step();
}

}  // namespace

int main(int argc, char** argv) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  tessera::limit_threads(1);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    const Args a = parse(argc, argv);
    auto world = tessera::comm::make_world_communicator();
    auto ctx = tessera::context::ParallelContext::create(world, tessera::context::ParallelConfig());
    tessera::comm::WorldOptions traced_options;
    traced_options.trace = std::make_shared<tessera::comm::CommTrace>();
    auto traced_ctx = tessera::context::ParallelContext::create(tessera::comm::make_world_communicator(traced_options),
                                                                tessera::context::ParallelConfig());
    const int dp = world->size();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1 + rank);
    const at::Tensor x = at::randn({a.batch, a.hidden}, gen);

    int64_t psi = 0;
    for (auto& p : mlp(a)->parameters()) psi += p.numel();

    // Baselines: plain LibTorch forward + backward on the local batch, and a
    // raw MPI_Allreduce of all gradients (what DDP must move).
    auto plain = mlp(a);
    auto fwd_bwd = [&] {
      for (auto& p : plain->parameters())
        if (p.grad().defined()) p.mutable_grad().zero_();
      plain->forward(x).pow(2).mean().backward();
    };
    const double fwd_bwd_ms = bench::time_ms(fwd_bwd, a.timing());
    at::Tensor flat = at::randn({psi});
    const double raw_allreduce_ms = bench::time_ms(
        [&] { MPI_Allreduce(MPI_IN_PLACE, flat.data_ptr<float>(), psi, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
        a.timing());

    for (const std::string& text : a.specs) {
      const ShardingSpec spec = ShardingSpec::parse(text);
      const auto options = ShardedModuleOptions().spec(spec).bucket_bytes(a.bucket_mb << 20);
      auto net = mlp(a);
      auto sharded = std::make_shared<ShardedModule>(net.ptr(), ctx, options);
      ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(net->parameters()));
      auto step = [&] {
        opt.zero_grad();
        sharded->forward(x).pow(2).mean().backward();
        opt.step();
      };
      const double step_ms = bench::time_ms(step, a.timing());
      sharded->reset_peak_bytes();
      step();
      const int64_t peak = sharded->peak_bytes() + opt.state_bytes();

      const int64_t after_step = opt.memory().total();

      // The same step with every reduction started after backward.
      auto late_net = mlp(a);
      auto late = std::make_shared<ShardedModule>(late_net.ptr(), ctx, ShardedModuleOptions(options).overlap(false));
      ShardedOptimizer late_opt(late, std::make_shared<torch::optim::AdamW>(late_net->parameters()));
      const double no_overlap_ms = bench::time_ms(
          [&] {
            late_opt.zero_grad();
            late->forward(x).pow(2).mean().backward();
            late_opt.step();
          },
          a.timing());

      // Compute alone: forward + backward of the plain module on the local
      // batch, and the optimizer on this rank's own pieces.
      const auto d = sharded->degrees();
      const double opt_ms = bench::time_ms([&] { opt.inner().step(); }, a.timing());
      const double compute_ms = fwd_bwd_ms + opt_ms;
      const double comm_ms = bench::time_ms([&] { comm_only_step(*sharded); }, a.timing());

      // Bytes of one step, on a traced copy.
      auto traced_net = mlp(a);
      auto traced = std::make_shared<ShardedModule>(traced_net.ptr(), traced_ctx, options);
      ShardedOptimizer traced_opt(traced, std::make_shared<torch::optim::AdamW>(traced_net->parameters()));
      traced_options.trace->reset();
      traced_opt.zero_grad();
      traced->forward(x).pow(2).mean().backward();
      traced_opt.step();
      const double bus_bytes = traced_options.trace->total().bus_bytes;

      const double formula = 4.0 * psi / d.params + 4.0 * psi / d.grads + 8.0 * psi / d.optim;
      const double overlap = (compute_ms + comm_ms - step_ms) / std::min(compute_ms, comm_ms);
      if (rank == 0) {
        fmt::print(
            "{{\"spec\": \"{}\", \"spec_placements\": \"{}\", \"dp\": {}, \"params\": {}, \"step_ms\": {:.3f}, "
            "\"bytes_per_rank\": {:.0f}, \"peak_model_state_bytes\": {}, \"model_state_bytes_after_step\": {}, "
            "\"formula_model_state_bytes\": {:.0f}, "
            "\"compute_only_ms\": {:.3f}, \"comm_only_ms\": {:.3f}, \"overlap_efficiency\": {:.3f}, "
            "\"step_no_overlap_ms\": {:.3f}, "
            "\"fwd_bwd_ms\": {:.3f}, \"optimizer_ms\": {:.3f}, \"raw_mpi_allreduce_ms\": {:.3f}, "
            "\"buckets\": {}}}\n",
            text, spec.to_string(), dp, psi, step_ms, bus_bytes, peak, after_step, formula, compute_ms, comm_ms,
            overlap, no_overlap_ms, fwd_bwd_ms, opt_ms, raw_allreduce_ms, sharded->num_buckets());
        std::fflush(stdout);
      }
    }
  } catch (const c10::Error& e) {
    if (rank == 0) fmt::print(stderr, "dp_step: error: {}\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
