// offload_step: one data-parallel AdamW training step of a large MLP with the
// optimizer states (and masters) in memory, in CPU memory (offload) or on
// disk, for the memory each keeps and the time each costs. One mode per run,
// so that the resident set size is the mode's own:
//
//   mpirun -np 2 offload_step --offload disk --dir /scratch --direct 1
//
// Every option and its default: offload_step --help (docs/cli.md).
//
// Prints one JSON object: step time (median of the timed steps, the slowest
// rank), the resident set size after the steps and its peak (VmRSS, VmHWM),
// the CPU bytes live after the steps by the counting allocator, the
// optimizer's own count of its state bytes in memory and on disk, and a
// checksum of the final parameters (an integer sum of their bits), which is
// equal across modes when the steps are bit for bit the same.
#include "bench_util.h"
#include "counting_allocator.h"
#include "example_main.h"

#include <tessera/core/process_memory.h>
#include <tessera/parallel/sharded_module.h>
#include <tessera/parallel/sharded_optimizer.h>
#include <tessera/tessera.h>

#include <fmt/format.h>
#include <torch/torch.h>

namespace {

using tessera::parallel::DiskOffloadOptions;
using tessera::parallel::ShardedModule;
using tessera::parallel::ShardedModuleOptions;
using tessera::parallel::ShardedOptimizer;
using tessera::parallel::ShardedOptimizerOptions;
using tessera::parallel::ShardingSpec;

struct Args {
  int64_t hidden = 4096, layers = 6, batch = 8, steps = 5, tile_mb = 16, buffers = 3, direct = 0;
  tessera::parallel::Offload offload = tessera::parallel::Offload::kNone;
  std::string dir = "/tmp", spec = "zero2";
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("offload_step",
                          "one data-parallel AdamW step with the optimizer states in memory, in CPU memory or on disk: "
                          "time and memory");
  c.group("Offload");
  c.add("offload", &a.offload, "where the optimizer states and masters live", "none|host|disk",
        tessera::parallel::parse_offload, tessera::parallel::offload_name);
  c.add("dir", &a.dir, "directory of the state files (--offload disk)");
  c.add("direct", &a.direct, "1: the state files with O_DIRECT, past the page cache; 0: buffered (--offload disk)");
  c.add("tile-mb", &a.tile_mb, "master bytes per tile, the unit read, stepped and written, in MiB (--offload disk)");
  c.add("buffers", &a.buffers, "host buffers of one tile each; 3 overlaps a read, a step and a write (--offload disk)");
  c.add("spec", &a.spec, "sharding spec");
  c.group("Model");
  c.add("hidden", &a.hidden, "width of every Linear layer");
  c.add("layers", &a.layers, "Linear + Tanh layers of the MLP");
  c.add("batch", &a.batch, "rows per step, split over the ranks");
  c.add("steps", &a.steps, "steps; the first (which creates the states) is not timed");
  return c;
}

int64_t max_over_ranks(int64_t v) {
  int64_t out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

int run(const Args& a) {
  const int64_t hidden = a.hidden, layers = a.layers, batch = a.batch, steps = a.steps, tile_mb = a.tile_mb,
                buffers = a.buffers, direct = a.direct;
  const tessera::parallel::Offload offload = a.offload;
  const std::string& dir = a.dir;
  const std::string& spec = a.spec;
  auto& memory = tessera::test::CountingAllocator::instance();
  tessera::test::CountingScope counting;
  auto world = tessera::comm::make_world_communicator();
  const int rank = world->rank();
  auto ctx = tessera::context::ParallelContext::create(world, tessera::context::ParallelConfig());

  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < layers; ++i) {
    net->push_back(torch::nn::Linear(hidden, hidden));
    net->push_back(torch::nn::Tanh());
  }
  int64_t psi = 0;
  for (const auto& p : net->parameters()) psi += p.numel();
  auto sharded =
      std::make_shared<ShardedModule>(net.ptr(), ctx, ShardedModuleOptions().spec(ShardingSpec::parse(spec)));
  auto options = ShardedOptimizerOptions().offload(offload);
  if (offload == tessera::parallel::Offload::kDisk)
    options.disk(DiskOffloadOptions()
                     .dir(dir)
                     .tile_bytes(tile_mb << 20)
                     .buffers(static_cast<int>(buffers))
                     .direct_io(direct != 0));
  ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(net->parameters()), options);
  const int64_t rows = batch / world->size();
  TORCH_CHECK(rows * world->size() == batch, "--batch ", batch, " must split over ", world->size(), " ranks");
  std::vector<double> times;
  for (int64_t step = 0; step < steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(step));
    at::Tensor x = at::randn({batch, hidden}, gen).narrow(0, world->rank() * rows, rows);
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = bench::now_ms();
    opt.zero_grad();
    sharded->forward(x).pow(2).mean().backward();
    opt.step();
    double mine = bench::now_ms() - start, worst = 0;
    MPI_Allreduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (step > 0) times.push_back(worst);  // the first step creates the states
  }
  std::sort(times.begin(), times.end());
  const int64_t live = max_over_ranks(memory.live()), peak_live = max_over_ranks(memory.peak());
  const int64_t rss = max_over_ranks(tessera::resident_bytes()), hwm = max_over_ranks(tessera::peak_resident_bytes());
  const auto m = opt.memory();
  int64_t checksum = 0;
  {
    auto full = sharded->full_params();
    for (const auto& p : net->parameters()) checksum += p.detach().view(at::kInt).to(at::kLong).sum().item<int64_t>();
  }
  if (rank == 0)
    fmt::print(
        "{{\"offload\": \"{}\", \"direct\": {}, \"spec\": \"{}\", \"ranks\": {}, \"params\": {}, "
        "\"step_ms\": {:.1f}, \"rss_bytes\": {}, \"rss_peak_bytes\": {}, \"counted_live_bytes\": {}, "
        "\"counted_peak_bytes\": {}, \"param_bytes\": {}, \"grad_bytes\": {}, \"optim_bytes_in_memory\": {}, "
        "\"optim_bytes_on_disk\": {}, \"params_checksum\": {}}}\n",
        tessera::parallel::offload_name(offload), direct, spec, world->size(), psi, times.empty() ? 0.0 : times[times.size() / 2], rss, hwm, live,
        peak_live, m.params, m.grads, m.optim, opt.disk_bytes(), checksum);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a); });
}
