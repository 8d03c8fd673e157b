// gpt_step: time of one training step (forward, loss, backward, AdamW) of
// tessera's GPT over one tensor-parallel group (by default all ranks), for
// the layers make_layer_factory gives the context's tensor mode and for
// their sequence-parallel variant, against a plain LibTorch GPT of the same
// shape (bench/baseline_gpt.h) timed in the same run on every rank. Prints
// one JSON object per configuration.
//
//   mpirun -np N gpt_step [--layers 4] [--hidden 256] [--heads 8] [--seq 128]
//       [--batch 8] [--vocab 8192] [--steps 4] [--warmup 2] [--rounds 3]
//       [--tp N] [--tp-mode 1d] [--order ...] (the grid flags of
//       context::config_from_args; data, pipeline, sequence and expert must be 1)
#include "baseline_gpt.h"
#include "bench_util.h"

#include <tessera/models/gpt.h>
#include <tessera/tessera.h>

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace {

struct Args {
  int64_t layers = 4, hidden = 256, heads = 8, seq = 128, batch = 8, vocab = 8192;
  int64_t steps = 4, warmup = 2, rounds = 3;
  bench::Timing timing() const { return {int(steps), int(warmup), int(rounds)}; }
};

Args parse(int argc, char** argv, tessera::context::ParallelConfig* grid) {
  Args a;
  *grid = bench::parse_flags(argc, argv,
                     {{"--layers", &a.layers},
                      {"--hidden", &a.hidden},
                      {"--heads", &a.heads},
                      {"--seq", &a.seq},
                      {"--batch", &a.batch},
                      {"--vocab", &a.vocab},
                      {"--steps", &a.steps},
                      {"--warmup", &a.warmup},
                      {"--rounds", &a.rounds}},
                     {}, "the comment at the top of bench/gpt_step.cpp", *grid);
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  return bench::run_main(&argc, &argv, "gpt_step", [&](int rank) {
    auto world = tessera::comm::make_world_communicator();
    tessera::context::ParallelConfig grid = tessera::context::ParallelConfig().tensor(world->size());
    const Args a = parse(argc, argv, &grid);
    auto ctx = tessera::context::ParallelContext::create(world, grid);
    const auto& c = ctx->config();
    TORCH_CHECK(c.data() == 1 && c.pipeline() == 1, "gpt_step times one tensor-parallel group, but the grid has data ",
                c.data(), " and pipeline ", c.pipeline(), "; set --tp to the number of ranks (bench/dp_step and ",
                "bench/pipeline time the other dimensions)");
    const int n = c.tensor();
    tessera::models::GPTConfig config;
    config.vocab = a.vocab;
    config.context = a.seq;
    config.layers = a.layers;
    config.heads = a.heads;
    config.hidden = a.hidden;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    torch::Tensor ids = torch::randint(a.vocab, {a.batch, a.seq}, gen, torch::kLong);
    torch::Tensor targets = torch::randint(a.vocab, {a.batch, a.seq}, gen, torch::kLong);

    for (bool sp : {false, true}) {
      // The variant is the same model at size 1, and belongs to 1D.
      if (sp && (n == 1 || c.tensor_mode() != tessera::context::TensorMode::k1D)) continue;
      torch::manual_seed(0);
      tessera::models::GPT gpt(config, tessera::nn::make_layer_factory(ctx, sp));
      torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(1e-4));
      auto tessera_step = [&] {
        opt.zero_grad();
        at::Tensor loss = gpt->loss(gpt->forward(ids), targets);
        loss.backward();
        gpt->reduce_partial_gradients();
        opt.step();
      };
      baseline::GPT base(a.vocab, a.seq, a.layers, a.heads, a.hidden);
      base->load(gpt->full_state());
      const double base_first = base->loss(ids, targets).item<double>();
      const double first = gpt->loss(gpt->forward(ids), targets).item<double>();
      torch::optim::AdamW base_opt(base->parameters(), torch::optim::AdamWOptions(1e-4));
      auto base_step = [&] {
        base_opt.zero_grad();
        torch::Tensor loss = base->loss(ids, targets);
        loss.backward();
        base_opt.step();
      };
      // Alternate so that neither profits from running second.
      std::vector<double> ours, theirs;
      for (int r = 0; r < 2; ++r) {
        ours.push_back(bench::time_ms(tessera_step, a.timing()));
        theirs.push_back(bench::time_ms(base_step, a.timing()));
      }
      const double step_ms = std::min(ours[0], ours[1]), base_ms = std::min(theirs[0], theirs[1]);
      if (rank == 0) {
        fmt::print(
            "{{\"config\": \"L{}-h{}-a{}-s{}-b{}-v{}\", \"tp\": {}, \"tp_mode\": \"{}\", \"sp_variant\": {}, \"step_ms\": {:.3f}, "
            "\"tokens_per_s\": {:.1f}, \"baseline_step_ms\": {:.3f}, \"ratio\": {:.4f}, "
            "\"initial_loss\": {:.6f}, \"baseline_initial_loss\": {:.6f}}}\n",
            a.layers, a.hidden, a.heads, a.seq, a.batch, a.vocab, n,
            tessera::context::tensor_mode_name(c.tensor_mode()), sp ? "true" : "false", step_ms,
            a.batch * a.seq / (step_ms / 1000.0), base_ms, step_ms / base_ms, first, base_first);
        std::fflush(stdout);
      }
    }
  });
}
