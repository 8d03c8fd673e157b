// pipeline: one training step (forward and backward over all micro-batches)
// of tessera's GPT cut into pipeline stages, per schedule, with the bubble
// measured from each rank's time blocked on messages and the bubble the
// simulator predicts from the same run's mean action times. The serial
// baseline is the whole batch's forward and backward in one process, run
// on rank 0 alone in the same program. Prints one JSON object per schedule.
//
//   mpirun -np 4 pipeline --microbatches 8 --chunks 2 --schedules gpipe,1f1b,interleaved
//   mpirun -np 4 pipeline --pp 2 --tp 2
//
// Every option and its default: pipeline --help (docs/cli.md). --pp defaults
// to the number of ranks over --tp; data, sequence and expert must be 1.
#include "bench_util.h"
#include "example_main.h"

#include <tessera/models/gpt.h>
#include <tessera/parallel/pipeline_executor.h>
#include <tessera/parallel/pipeline_simulator.h>
#include <tessera/tessera.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <sstream>

namespace {

using tessera::parallel::PipelineExecutor;
using tessera::parallel::PipelineOptions;
using tessera::parallel::ScheduleKind;

struct Args {
  int64_t layers = 8, hidden = 128, heads = 4, seq = 64, mb_rows = 2, microbatches = 8, chunks = 2;
  int64_t steps = 3, warmup = 1, rounds = 3;
  std::string schedules = "gpipe,1f1b,interleaved,zb-h1,zb-h2,zb-v,dualpipev";
  std::string partition = "count";
  bench::Timing timing() const { return {int(steps), int(warmup), int(rounds)}; }
};

tessera::cli::Command command(Args& a, tessera::context::ParallelConfig& grid) {
  tessera::cli::Command c("pipeline",
                          "one GPT step per pipeline schedule: measured and simulated bubble, against the serial step");
  c.group("Model");
  c.add("layers", &a.layers, "GPT blocks");
  c.add("hidden", &a.hidden, "hidden size");
  c.add("heads", &a.heads, "attention heads");
  c.add("seq", &a.seq, "tokens per sequence");
  c.group("Pipeline");
  c.add("schedules", &a.schedules, "schedules to time, comma-separated");
  c.add("mb-rows", &a.mb_rows, "sequences per micro-batch");
  c.add("partition", &a.partition,
        "how layers are cut into stages: count (equal layers), params (equal parameters: the embedding and the head "
        "weigh little, so the V's stage pairs balance)");
  c.add("microbatches", &a.microbatches, "micro-batches per step");
  c.add("chunks", &a.chunks, "model chunks per stage of the interleaved schedule (zb-v and dualpipev always run 2)");
  c.group("Grid");
  tessera::context::add_grid_options(c, grid);
  c.default_text("pp", "ranks / --tp");
  c.add("seed", &grid.seed(), "base of every mode's seed");
  bench::add_timing_options(c, &a.steps, &a.warmup, &a.rounds);
  return c;
}

tessera::models::GPTConfig gpt_config(const Args& a) {
  tessera::models::GPTConfig c;
  c.vocab(512);
  c.context(a.seq);
  c.layers(a.layers);
  c.heads(a.heads);
  c.hidden(a.hidden);
  return c;
}

int run(const Args& a, tessera::context::ParallelConfig grid, const tessera::cli::Command& command) {
  std::vector<std::string> schedules;
  std::stringstream listed(a.schedules);
  for (std::string s; std::getline(listed, s, ',');) schedules.push_back(s);
  auto world = tessera::comm::make_world_communicator();
  const int rank = world->rank();
  // Without --pp, every rank not taken by the tensor dimension is a stage.
  if (!command.given("pp")) grid.pipeline(world->size() / std::max(1, grid.tensor()));
  auto ctx = tessera::context::ParallelContext::create(world, grid);
  TORCH_CHECK(ctx->config().data() == 1, "pipeline times one pipeline, but the grid has data ", ctx->config().data(),
              "; set --pp and --tp so that pp*tp is the number of ranks (bench/dp_step times data parallelism)");
  const int pp = ctx->config().pipeline();
  // The serial baseline: the whole model in one process, on rank 0.
  auto one = tessera::context::ParallelContext::create(world->split(world->rank(), 0, "self"), {});
  const int64_t rows = a.mb_rows * a.microbatches;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = at::randint(512, {rows, a.seq}, gen, at::kLong);
  const at::Tensor y = at::randint(512, {rows, a.seq}, gen, at::kLong);

  // Baseline: the whole batch in one process (rank 0; the others wait).
  double serial_ms = 0;
  {
    torch::manual_seed(1);
    tessera::models::GPT gpt(gpt_config(a), tessera::nn::make_layer_factory(one));
    if (rank == 0) {
      bench::Timing t = a.timing();
      serial_ms = bench::time_ms(
          [&] {
            gpt->zero_grad();
            gpt->loss(gpt->forward(x), y).backward();
          },
          t, MPI_COMM_SELF);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }

  TORCH_CHECK(a.partition == "count" || a.partition == "params", "--partition ", a.partition,
              " is not a partition of this benchmark; use count or params");
  const auto partition = a.partition == "count" ? tessera::parallel::PartitionMethod::kLayerCount
                                                : tessera::parallel::PartitionMethod::kParameterCount;
  for (const std::string& name : schedules) {
    const ScheduleKind kind = tessera::parallel::parse_schedule_kind(name);
    const int chunks = kind == ScheduleKind::kInterleaved1F1B ? static_cast<int>(a.chunks)
                       : tessera::parallel::runs_in_a_v(kind) ? 2
                                                              : 1;
    torch::manual_seed(1);
    tessera::models::GPT gpt(gpt_config(a), tessera::nn::make_layer_factory(ctx));
    PipelineExecutor pipe(
        gpt->as_sequential(), ctx, [&](const at::Tensor& out, const at::Tensor& t) { return gpt->loss(out, t); },
        PipelineOptions()
            .schedule(kind)
            .microbatches(static_cast<int>(a.microbatches))
            .chunks(chunks)
            .partition(partition));
    auto step = [&] {
      for (auto& p : pipe.parameters()) p.mutable_grad() = at::Tensor();
      pipe.run(x, y);
    };
    const double step_ms = bench::time_ms(step, a.timing());

    // One more step for the breakdown: wait and per-action times.
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = bench::now_ms();
    step();
    const double mine_ms = bench::now_ms() - t0;
    const auto& st = pipe.last_stats();
    double idle_fraction = st.wait_seconds * 1e3 / mine_ms, bubble = 0;
    MPI_Allreduce(&idle_fraction, &bubble, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    bubble /= world->size();
    double sums[8], totals[8];
    for (int k = 0; k < 4; ++k) {
      sums[k] = st.seconds[k];
      sums[4 + k] = st.count[k];
    }
    MPI_Allreduce(sums, totals, 8, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    auto mean_ms = [&](int k) { return totals[4 + k] > 0 ? 1e3 * totals[k] / totals[4 + k] : 0.0; };
    tessera::parallel::ActionCosts costs;
    costs.forward = mean_ms(0);
    costs.backward = mean_ms(1);
    costs.backward_input = mean_ms(2);
    costs.backward_weight = mean_ms(3);
    const auto sim = tessera::parallel::simulate(pipe.schedule(), costs);
    int peak = 0;
    for (int v : sim.peak_inflight) peak = std::max(peak, v);
    if (rank == 0) {
      fmt::print(
          "{{\"schedule\": \"{}\", \"partition\": \"{}\", \"pp\": {}, \"tp\": {}, \"chunks\": {}, \"microbatches\": "
          "{}, \"rows\": {}, \"seq\": {}, "
          "\"hidden\": {}, \"layers\": {}, \"step_ms\": {:.3f}, \"serial_step_ms\": {:.3f}, "
          "\"measured_bubble\": {:.4f}, \"simulated_bubble\": {:.4f}, \"simulated_step_ms\": {:.3f}, "
          "\"peak_inflight\": {}, \"peak_inflight_stages\": {:.2f}, \"forward_ms\": {:.3f}, \"backward_ms\": {:.3f}, "
          "\"backward_input_ms\": {:.3f}, "
          "\"backward_weight_ms\": {:.3f}}}\n",
          name, a.partition, pp, ctx->config().tensor(), chunks, a.microbatches, rows, a.seq, a.hidden, a.layers,
          step_ms, serial_ms, bubble, sim.bubble, sim.makespan, peak, double(peak) / chunks, costs.forward,
          costs.backward, costs.backward_input, costs.backward_weight);
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
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a, grid, c); });
}
