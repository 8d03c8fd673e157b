// sequence: the GPT with its tokens split over every rank in each sequence
// mode (ulysses, ring with the zigzag split, rsa, hybrid: Ulysses over
// --ulysses adjacent ranks and a zigzag ring across them), against the 1D
// tensor-parallel GPT on the same ranks, as the sequence grows. One JSON line
// per (mode, sequence length) with:
//   step_ms            one training step (forward, loss, backward, gradient
//                      reduction, AdamW), the slowest rank, median of rounds
//   traced_bytes       bytes of one step per rank in traced sizes (Note
//                      [Trace byte counts]), against analytical_bytes
//                      (docs/sequence-parallel.md)
//   peak_rise_bytes    the CPU allocator's peak during the step over what
//                      was live before: activations and buffers
//   largest_alloc      the largest single allocation during the step
// and one line per mode with the longest sequence of the list whose peak
// stays within --budget-mb per rank.
//
// At one rank every mode is the serial GPT: `--modes 1d` gives the
// single-rank figures.
//
//   mpirun -np 4 sequence --seqs 1024,2048,4096,8192 --modes 1d,ulysses,ring,rsa,hybrid --budget-mb 512
//   mpirun -np 1 sequence --modes 1d --budget-mb 100000
//
// Every option and its default: sequence --help (docs/cli.md). It chooses
// the grid of every mode itself, so it has no grid options.
#include "bench_util.h"
#include "counting_allocator.h"
#include "example_main.h"

#include <tessera/models/gpt.h>
#include <tessera/tessera.h>
#include <torch/optim/adamw.h>

#include <fmt/format.h>

#include <algorithm>
#include <sstream>
#include <vector>

namespace {

using tessera::context::ParallelConfig;
using tessera::context::ParallelMode;
using tessera::context::SequenceMode;
using tessera::context::SequenceSplit;

struct Args {
  int64_t layers = 2, hidden = 128, heads = 4, batch = 1, vocab = 512, budget_mb = 512;
  int64_t steps = 1, warmup = 1, rounds = 1, ulysses = 2;
  std::string seqs = "1024,2048,4096,8192";
  std::string modes = "1d,ulysses,ring,rsa";
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("sequence",
                          "the GPT step in each sequence-parallel mode against 1D tensor parallelism as the sequence "
                          "grows");
  c.group("Runs");
  c.add("seqs", &a.seqs, "sequence lengths, comma-separated");
  c.add("modes", &a.modes, "modes to run, a comma-separated subset of 1d,ulysses,ring,rsa,hybrid");
  c.add("ulysses", &a.ulysses, "hybrid: the Ulysses group's size (divides the ranks, leaves a ring of 2 or more)");
  c.add("budget-mb", &a.budget_mb, "memory per rank in MiB for the longest sequence that fits");
  c.group("Model");
  c.add("layers", &a.layers, "GPT blocks");
  c.add("hidden", &a.hidden, "hidden size");
  c.add("heads", &a.heads, "attention heads");
  c.add("batch", &a.batch, "sequences per step");
  c.add("vocab", &a.vocab, "vocabulary");
  bench::add_timing_options(c, &a.steps, &a.warmup, &a.rounds);
  return c;
}

struct Mode {
  std::string name;
  ParallelConfig config;
};

// Elements one step moves per rank (docs/sequence-parallel.md): the
// attention's traffic per layer with E = b·h_local·n·d, the loss's
// all-reduce, the vocabulary-parallel cross entropy's 3·b·n (on a tensor
// group of one rank here: traced, nothing moves) and the gradient
// all-reduce over data x sequence; for 1D the tensor group's all-reduces.
int64_t analytical_elements(const ParallelConfig& c, const Args& a, int64_t seq, int64_t params) {
  const int64_t p = c.sequence(), L = a.layers;
  if (p == 1) {
    // One rank: the layers skip their all-reduces; the loss's are traced.
    const int64_t T = a.batch * seq;
    return (c.tensor() > 1 ? (4 * L + 2) * T * a.hidden : 0) + 3 * T;
  }
  const int64_t e = a.batch * a.heads * (seq / p) * (a.hidden / a.heads);
  int64_t per_layer = 0;
  switch (c.sequence_mode()) {
    case SequenceMode::kRing:  // sends and receives: traced on both sides
      per_layer = 2 * 2 * (3 * p - 2) * e;
      break;
    case SequenceMode::kRsa:
      per_layer = 2 * (6 * p - 4) * e;
      break;
    case SequenceMode::kUlysses:
      per_layer = 8 * e;
      break;
    case SequenceMode::kHybrid: {  // Ulysses over U, ring over p/U on the same e
      const int64_t r = p / c.sequence_ulysses();
      per_layer = 8 * e + 2 * 2 * (3 * r - 2) * e;
      break;
    }
  }
  return L * per_layer + 1 + 3 * a.batch * (seq / p) + params;
}

int run(const Args& a) {
  const std::vector<int64_t> seqs = bench::parse_int_list(a.seqs, "--seqs");
  auto trace = std::make_shared<tessera::comm::CommTrace>();
  auto world =
      std::make_shared<tessera::comm::TracingCommunicator>(tessera::comm::make_world_communicator(), trace);
  const int n = world->size(), rank = world->rank();
  auto& memory = tessera::test::CountingAllocator::instance();
  tessera::test::CountingScope counting;
  const std::vector<Mode> modes = {
      {"1d", ParallelConfig().tensor(n)},
      {"ulysses", ParallelConfig().sequence(n).sequence_mode(SequenceMode::kUlysses)},
      {"ring", ParallelConfig().sequence(n).sequence_mode(SequenceMode::kRing).sequence_split(SequenceSplit::kZigzag)},
      {"rsa", ParallelConfig().sequence(n).sequence_mode(SequenceMode::kRsa)},
      {"hybrid", ParallelConfig()
                     .sequence(n)
                     .sequence_mode(SequenceMode::kHybrid)
                     .sequence_ulysses(static_cast<int>(a.ulysses))
                     .sequence_split(SequenceSplit::kZigzag)}};
  std::stringstream listed(a.modes);
  for (std::string name; std::getline(listed, name, ',');) {
    const bool known = std::any_of(modes.begin(), modes.end(), [&](const Mode& m) { return m.name == name; });
    TORCH_CHECK(known, "--modes lists '", name, "', which is not a mode of this benchmark; use a comma-separated ",
                "subset of 1d,ulysses,ring,rsa,hybrid");
  }
  for (const Mode& mode : modes) {
    if (("," + a.modes + ",").find("," + mode.name + ",") == std::string::npos) continue;
    int64_t longest = 0;
    for (int64_t seq : seqs) {
      auto ctx = tessera::context::ParallelContext::create(world, mode.config);
      tessera::models::GPTConfig config;
      config.vocab(a.vocab);
      config.context(seq);
      config.layers(a.layers);
      config.heads(a.heads);
      config.hidden(a.hidden);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
      const at::Tensor x = at::randint(a.vocab, {a.batch, seq}, gen, at::kLong);
      const at::Tensor y = at::randint(a.vocab, {a.batch, seq}, gen, at::kLong);
      torch::manual_seed(0);
      auto gpt = std::make_shared<tessera::models::GPTImpl>(config, tessera::nn::make_layer_factory(ctx));
      const auto placements = gpt->placements();
      int64_t params = 0;
      for (const auto& entry : placements) params += entry.second.param.numel();
      auto sharded = std::make_shared<tessera::parallel::ShardedModule>(
          gpt, ctx, tessera::parallel::ShardedModuleOptions().placements(placements));
      tessera::parallel::ShardedOptimizer opt(
          sharded, std::make_shared<torch::optim::AdamW>(gpt->parameters(), torch::optim::AdamWOptions(1e-4)));
      double loss = 0;
      auto step = [&] {
        opt.zero_grad();
        at::Tensor l = sharded->run([&] { return gpt->loss(gpt->forward(x), y); });
        l.backward();
        opt.step();
        loss = l.item<double>();
      };
      const double step_ms = bench::time_ms(step, {int(a.steps), int(a.warmup), int(a.rounds)});
      trace->reset();
      const int64_t live_before = memory.live();
      memory.reset_peak();
      step();
      int64_t rise = memory.peak() - live_before, largest = memory.largest();
      int64_t worst = 0;
      MPI_Allreduce(&rise, &worst, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
      if (worst <= a.budget_mb << 20) longest = std::max(longest, seq);
      const auto total = trace->total();
      if (rank == 0) {
        fmt::print(
            "{{\"config\": \"L{}-h{}-a{}-b{}-v{}\", \"ranks\": {}, \"mode\": \"{}\", \"seq\": {}, \"step_ms\": {:.1f}, "
            "\"traced_bytes\": {}, \"analytical_bytes\": {}, \"peak_rise_bytes\": {}, \"largest_alloc\": {}, "
            "\"loss\": {:.6f}}}\n",
            a.layers, a.hidden, a.heads, a.batch, a.vocab, n, mode.name, seq, step_ms, total.bytes,
            4 * analytical_elements(ctx->config(), a, seq, params), worst, largest, loss);
        std::fflush(stdout);
      }
    }
    if (rank == 0) {
      fmt::print("{{\"ranks\": {}, \"mode\": \"{}\", \"budget_mb\": {}, \"longest_seq_within_budget\": {}}}\n", n,
                 mode.name, a.budget_mb, longest);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a); });
}
