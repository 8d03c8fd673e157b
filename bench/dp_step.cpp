// dp_step: one data-parallel training step (forward, backward, AdamW) of an
// MLP wrapped in ShardedModule, for each sharding spec, with what it costs
// apart: the same compute without communication (plain LibTorch on the local
// batch, optimizer over the local shard's size), the same communication
// without compute (the step's collectives on the same buckets), the bytes
// moved (tracing decorator) and the model-state memory (peak and formula).
// A raw MPI_Allreduce of the gradients is timed as the DDP baseline.
// Prints one JSON object per spec.
//
//   mpirun -np 4 dp_step --hidden 1024 --specs ddp,zero1,zero2,zero3,hpz:2,{R,P(2),S},mics:2
//   mpirun -np 2 dp_step --device cuda --backend mpi --offload host [--offload-params]
//
// Every option and its default: dp_step --help (docs/cli.md). Every rank is
// a data rank, so the grid's other dimensions must be 1.
//
// On CUDA every timed call ends with a device synchronization, and the
// caching allocator's bytes (after a step, and the step's peak, relative to
// before the model was built) are reported beside the counted model states.
#include "bench_util.h"
#include "example_main.h"

#include <tessera/parallel/flat_bucket.h>
#include <tessera/parallel/sharded_module.h>
#include <tessera/parallel/sharded_optimizer.h>
#include <tessera/tessera.h>

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#if TESSERA_HAVE_C10_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <functional>
#include <vector>

namespace {

using tessera::parallel::ShardedModule;
using tessera::parallel::ShardedModuleOptions;
using tessera::parallel::ShardedOptimizer;
using tessera::parallel::ShardedOptimizerOptions;
using tessera::parallel::ShardingSpec;

struct Args {
  int64_t hidden = 1024, layers = 4, batch = 64, bucket_mb = 25;
  int64_t steps = 5, warmup = 2, rounds = 3;
  std::string specs = "ddp,zero1,zero2,zero3,hpz:2,{R,P(2),S},mics:2";
  std::string device = "cpu", backend = "auto";
  tessera::parallel::Offload offload = tessera::parallel::Offload::kNone;
  bool offload_params = false;
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

tessera::cli::Command command(Args& a, tessera::context::ParallelConfig& grid) {
  tessera::cli::Command c("dp_step",
                          "one data-parallel MLP step per sharding spec: time, compute and communication apart, bytes "
                          "and memory");
  c.group("Model");
  c.add("hidden", &a.hidden, "width of every Linear layer");
  c.add("layers", &a.layers, "Linear + ReLU layers of the MLP");
  c.add("batch", &a.batch, "rows per rank per step");
  c.group("Sharding");
  c.add("specs", &a.specs, "sharding specs to time, comma-separated (commas inside braces belong to the spec)");
  c.add("bucket-mb", &a.bucket_mb, "bucket size in MiB");
  c.add("offload", &a.offload, "optimizer states and masters: with the parameters, or in host memory", "none|host",
        [](const std::string& t) {
          const auto o = tessera::parallel::parse_offload(t);
          TORCH_CHECK(o != tessera::parallel::Offload::kDisk, "dp_step measures device memory; --offload disk is "
                      "bench/offload_step's");
          return o;
        },
        tessera::parallel::offload_name);
  c.add("offload-params", &a.offload_params, "parameter shards in host memory too (needs --offload host)");
  c.group("Grid");
  tessera::context::add_grid_options(c, grid);
  c.add("seed", &grid.seed(), "base of every mode's seed");
  c.group("Device");
  c.add("device", &a.device, "cpu, cuda (this rank's local GPU) or cuda:N");
  c.add("backend", &a.backend, "communication backend", {"auto", "mpi", "nccl"});
  bench::add_timing_options(c, &a.steps, &a.warmup, &a.rounds);
  return c;
}

void sync(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Bytes the CUDA caching allocator holds for tensors now, and the peak since
// the last reset; -1 without CUDA.
struct DeviceBytes {
  int64_t current = -1, peak = -1;
};
DeviceBytes device_bytes(const c10::Device& device) {
#if TESSERA_HAVE_C10_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};  // [0]: all pools
  }
#endif
  (void)device;
  return {};
}
void reset_device_peak(const c10::Device& device) {
#if TESSERA_HAVE_C10_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  (void)device;
}

torch::nn::Sequential mlp(const Args& a, const c10::Device& device) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < a.layers; ++i) {
    net->push_back(torch::nn::Linear(a.hidden, a.hidden));
    net->push_back(torch::nn::ReLU());
  }
  net->to(device);
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

int run(const Args& a, const tessera::context::ParallelConfig& grid) {
  const std::vector<std::string> specs = split_specs(a.specs);
  TORCH_CHECK(!specs.empty(), "--specs is empty; give at least one sharding spec");
  c10::Device device(a.device);
  if (device.is_cuda() && !device.has_index()) device = tessera::context::local_device();
  tessera::comm::WorldOptions world_options;
  world_options.device = device;
  world_options.backend = a.backend == "mpi"    ? tessera::comm::Backend::kMpi
                          : a.backend == "nccl" ? tessera::comm::Backend::kNccl
                                                : tessera::comm::Backend::kAuto;
  auto world = tessera::comm::make_world_communicator(world_options);
  auto ctx = tessera::context::ParallelContext::create(world, grid);
  TORCH_CHECK(ctx->config().data() == world->size() && ctx->config().expert() == 1,
              "dp_step times data parallelism over all ranks, but the grid is ", tessera::context::to_string(ctx->config()),
              "; leave --pp --tp --sp --ep at 1");
  tessera::comm::WorldOptions traced_options = world_options;
  traced_options.trace = std::make_shared<tessera::comm::CommTrace>();
  auto traced_ctx =
      tessera::context::ParallelContext::create(tessera::comm::make_world_communicator(traced_options), grid);
  const int dp = world->size(), rank = world->rank();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1 + rank);
  const at::Tensor x = at::randn({a.batch, a.hidden}, gen).to(device);

  int64_t psi = 0;
  for (auto& p : mlp(a, c10::kCPU)->parameters()) psi += p.numel();

  // Baselines: plain LibTorch forward + backward on the local batch, and a
  // raw MPI_Allreduce of all gradients (what DDP must move).
  auto plain = mlp(a, device);
  auto fwd_bwd = [&] {
    for (auto& p : plain->parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
    plain->forward(x).pow(2).mean().backward();
    sync(device);
  };
  const double fwd_bwd_ms = bench::time_ms(fwd_bwd, a.timing());
  at::Tensor flat = at::randn({psi});
  const double raw_allreduce_ms = bench::time_ms(
      [&] { MPI_Allreduce(MPI_IN_PLACE, flat.data_ptr<float>(), psi, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
      a.timing());

  for (const std::string& text : specs) {
    const ShardingSpec spec = ShardingSpec::parse(text);
    const auto options =
        ShardedModuleOptions().spec(spec).bucket_bytes(a.bucket_mb << 20).offload_params(a.offload_params);
    const auto opt_options = ShardedOptimizerOptions().offload(a.offload);
    sync(device);
    const int64_t device_before = device_bytes(device).current;
    auto net = mlp(a, device);
    auto sharded = std::make_shared<ShardedModule>(net.ptr(), ctx, options);
    ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(net->parameters()), opt_options);
    auto step = [&] {
      opt.zero_grad();
      sharded->forward(x).pow(2).mean().backward();
      opt.step();
      sync(device);
    };
    const double step_ms = bench::time_ms(step, a.timing());
    sharded->reset_peak_bytes();
    reset_device_peak(device);
    step();
    const int64_t peak = sharded->peak_bytes() + opt.state_bytes();
    const int64_t after_step = opt.memory().total();
    const DeviceBytes on_device = device_bytes(device);
    const int64_t device_after_step = device_before < 0 ? -1 : on_device.current - device_before;
    const int64_t device_peak = device_before < 0 ? -1 : on_device.peak - device_before;

    // The same step with every reduction started after backward.
    auto late_net = mlp(a, device);
    auto late = std::make_shared<ShardedModule>(late_net.ptr(), ctx, ShardedModuleOptions(options).overlap(false));
    ShardedOptimizer late_opt(late, std::make_shared<torch::optim::AdamW>(late_net->parameters()), opt_options);
    const double no_overlap_ms = bench::time_ms(
        [&] {
          late_opt.zero_grad();
          late->forward(x).pow(2).mean().backward();
          late_opt.step();
          sync(device);
        },
        a.timing());

    // Compute alone: forward + backward of the plain module on the local
    // batch, and the optimizer on this rank's own pieces.
    const auto d = sharded->degrees();
    const double opt_ms = bench::time_ms(
        [&] {
          opt.inner().step();
          sync(device);
        },
        a.timing());
    const double compute_ms = fwd_bwd_ms + opt_ms;
    const double comm_ms = bench::time_ms(
        [&] {
          comm_only_step(*sharded);
          sync(device);
        },
        a.timing());

    // Bytes of one step, on a traced copy.
    auto traced_net = mlp(a, device);
    auto traced = std::make_shared<ShardedModule>(traced_net.ptr(), traced_ctx, options);
    ShardedOptimizer traced_opt(traced, std::make_shared<torch::optim::AdamW>(traced_net->parameters()), opt_options);
    traced_options.trace->reset();
    traced_opt.zero_grad();
    traced->forward(x).pow(2).mean().backward();
    traced_opt.step();
    const double bus_bytes = traced_options.trace->total().bus_bytes;

    const double formula = 4.0 * psi / d.params + 4.0 * psi / d.grads + 8.0 * psi / d.optim;
    const double overlap = (compute_ms + comm_ms - step_ms) / std::min(compute_ms, comm_ms);
    if (rank == 0) {
      fmt::print(
          "{{\"spec\": \"{}\", \"spec_placements\": \"{}\", \"device\": \"{}\", \"backend\": \"{}\", "
          "\"offload\": \"{}\", \"dp\": {}, \"params\": {}, \"step_ms\": {:.3f}, "
          "\"bytes_per_rank\": {:.0f}, \"peak_model_state_bytes\": {}, \"model_state_bytes_after_step\": {}, "
          "\"formula_model_state_bytes\": {:.0f}, "
          "\"compute_only_ms\": {:.3f}, \"comm_only_ms\": {:.3f}, \"overlap_efficiency\": {:.3f}, "
          "\"step_no_overlap_ms\": {:.3f}, "
          "\"fwd_bwd_ms\": {:.3f}, \"optimizer_ms\": {:.3f}, \"raw_mpi_allreduce_ms\": {:.3f}, "
          "\"device_bytes_after_step\": {}, \"device_peak_bytes\": {}, \"buckets\": {}}}\n",
          text, spec.to_string(), device.str(), world->backend(),
          tessera::parallel::offload_name(a.offload) + (a.offload_params ? "+params" : ""), dp, psi, step_ms, bus_bytes, peak,
          after_step, formula, compute_ms, comm_ms, overlap, no_overlap_ms, fwd_bwd_ms, opt_ms, raw_allreduce_ms,
          device_after_step, device_peak, sharded->num_buckets());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::context::ParallelConfig grid;
  tessera::cli::Command c = command(a, grid);
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a, grid); });
}
