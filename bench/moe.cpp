// moe: the GPT with mixture-of-experts blocks trained by train::Trainer at
// each expert size that divides the world (data = world, experts split over
// the expert group), against the dense GPT with the same active parameters
// per token at top-1 (the experts are the dense MLP's shape) on the same
// ranks. One JSON line per model with:
//   step_ms, tokens_per_s   one training step (forward, loss, backward,
//                           gradient reduction, AdamW), the slowest rank,
//                           median of rounds
//   a2a_calls, a2a_bytes    all-to-alls over the expert group in one step,
//                           per rank, in traced sizes (inputs: Note [Trace
//                           byte counts]), against a2a_balanced_bytes: the
//                           same routing with every rank receiving as many
//                           rows as it sends, 4 row exchanges and one
//                           exchange of 8·E-byte counts per MoE layer
//                           (docs/expert-parallel.md)
//   max_over_mean           the most assignments routed to one expert over
//                           the mean, worst layer, in the timed steps' last
//   expert_compute          grouped (each expert over exactly its rows) or
//                           padded (every local expert to the busiest);
//                           each expert size runs both by default
//   rows_routed, rows_computed  rows the experts were routed and ran in the
//                           timed steps' last forward, all ranks and layers
//   busiest_rows_routed, busiest_rows_computed  the same for the rank that
//                           ran the most rows: the step waits for it, so
//                           its computed over routed is what padding costs
//   expert_gflop            the experts' matmul FLOPs of one step (forward
//                           and backward, 6 per weight and row computed),
//                           padding included, against expert_gflop_routed
//   params, active_params   parameters in all, and used per token
// Then --train-steps of training at the largest expert size with and
// without the load-balancing loss, one line every 5 steps: loss, max/mean
// and the tokens per expert of the first MoE layer.
//
//   mpirun -np 4 moe --eps 1,2,4 --experts 8 --top-k 1 --capacity 125
//
// Every option and its default: moe --help (docs/cli.md). It chooses the
// grid itself (data = world, the expert sizes of --eps), so it has no grid
// options.
#include "bench_util.h"
#include "example_main.h"

#include <tessera/comm/tracing_communicator.h>
#include <tessera/models/gpt.h>
#include <tessera/tessera.h>
#include <torch/optim/adamw.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <vector>

namespace {

using tessera::context::ParallelConfig;
using tessera::context::ParallelMode;

struct Args {
  int64_t experts = 8, top_k = 1, moe_every = 2, capacity = 0, skew = 0;
  int64_t layers = 4, hidden = 128, heads = 4, seq = 64, batch = 16, vocab = 512, train_steps = 40;
  int64_t steps = 3, warmup = 1, rounds = 3;
  std::string eps = "1,2,4", computes = "grouped,padded";
  bench::Timing timing() const { return {int(steps), int(warmup), int(rounds)}; }
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("moe",
                          "the mixture-of-experts GPT at each expert-parallel size against the dense GPT: step time, "
                          "all-to-all bytes, balance");
  c.group("Experts");
  c.add("eps", &a.eps, "expert-parallel sizes, comma-separated; those dividing the world and --experts are run");
  c.add("experts", &a.experts, "experts per MoE block");
  c.add("top-k", &a.top_k, "experts per token");
  c.add("moe-every", &a.moe_every, "every n-th block has experts");
  c.add("capacity", &a.capacity,
        "capacity factor in percent, e.g. 125 for 1.25 x an even share of the tokens; 0: dropless");
  c.add("skew", &a.skew,
        "skewed routing: the router rows of experts >= K are zeroed, so experts 0..K-1 and expert K (the tie) take "
        "the tokens; 0: the router as initialized");
  c.add("expert-compute", &a.computes, "expert computes to run at each expert size: grouped, padded or both");
  c.add("train-steps", &a.train_steps, "training steps of the balance runs, with and without the balancing loss");
  c.group("Model");
  c.add("layers", &a.layers, "GPT blocks");
  c.add("hidden", &a.hidden, "hidden size");
  c.add("heads", &a.heads, "attention heads");
  c.add("seq", &a.seq, "tokens per sequence");
  c.add("batch", &a.batch, "sequences per step, split over the data ranks");
  c.add("vocab", &a.vocab, "vocabulary");
  bench::add_timing_options(c, &a.steps, &a.warmup, &a.rounds);
  return c;
}

tessera::models::GPTConfig gpt_config(const Args& a, int64_t experts, tessera::nn::MoEExpertCompute compute) {
  tessera::models::GPTConfig c;
  c.vocab(a.vocab);
  c.context(a.seq);
  c.layers(a.layers);
  c.heads(a.heads);
  c.hidden(a.hidden);
  c.experts(experts);
  if (experts == 0) return c;  // the dense model: MoE options on it are refused
  c.top_k(a.top_k);
  c.moe_every(a.moe_every);
  c.expert_compute(compute);
  if (a.capacity > 0) c.capacity_factor() = static_cast<double>(a.capacity) / 100.0;
  return c;
}

// Token windows with structure a router can learn: each row walks the
// vocabulary with its own stride from a random start.
std::pair<at::Tensor, at::Tensor> batch(const Args& a, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor start = at::randint(a.vocab, {a.batch, 1}, gen, at::kLong);
  const at::Tensor stride = at::randint(1, 8, {a.batch, 1}, gen, at::kLong);
  const at::Tensor walk = (start + stride * at::arange(a.seq + 1, at::kLong)) % a.vocab;
  return {walk.narrow(1, 0, a.seq), walk.narrow(1, 1, a.seq)};
}

struct Run {
  std::shared_ptr<tessera::models::GPTImpl> gpt;
  std::unique_ptr<tessera::train::Trainer> trainer;
  tessera::context::ParallelContextPtr ctx;
};

Run make_run(const tessera::comm::CommunicatorPtr& world, const Args& a, int64_t ep, int64_t experts, double aux_coef,
             tessera::nn::MoEExpertCompute compute = tessera::nn::MoEExpertCompute::kGrouped) {
  Run r;
  r.ctx = tessera::context::ParallelContext::create(world, ParallelConfig().expert(static_cast<int>(ep)));
  torch::manual_seed(0);
  auto config = gpt_config(a, experts, compute);
  config.aux_loss_coef(aux_coef);
  r.gpt = std::make_shared<tessera::models::GPTImpl>(config, tessera::nn::make_layer_factory(r.ctx));
  if (a.skew > 0) {
    at::NoGradGuard no_grad;
    for (auto& p : r.gpt->named_parameters())
      if (p.key().find("router.weight") != std::string::npos) p.value().narrow(0, a.skew, experts - a.skew).zero_();
  }
  auto adamw = [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
    std::vector<at::Tensor> params;
    for (const auto& p : named) params.push_back(p.second);
    return std::shared_ptr<torch::optim::Optimizer>(
        std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3)));
  };
  r.trainer = std::make_unique<tessera::train::Trainer>(r.ctx, tessera::train::gpt_train_model(r.gpt), adamw);
  return r;
}

// The most assignments to one expert over the mean, worst MoE layer.
double max_over_mean(const tessera::models::GPTImpl& gpt) {
  double worst = 0;
  for (const auto& s : gpt.moe_stats()) {
    double total = 0, most = 0;
    for (int64_t t : s.tokens_per_expert) {
      total += static_cast<double>(t);
      most = std::max(most, static_cast<double>(t));
    }
    if (total > 0) worst = std::max(worst, most * static_cast<double>(s.tokens_per_expert.size()) / total);
  }
  return worst;
}

int run(const Args& a) {
  auto trace = std::make_shared<tessera::comm::CommTrace>();
  tessera::comm::WorldOptions world_options;
  world_options.trace = trace;
  auto world = tessera::comm::make_world_communicator(world_options);
  const int n = world->size(), rank = world->rank();
  TORCH_CHECK(a.batch % n == 0, "--batch ", a.batch, " must divide over the ", n, " data ranks");
  TORCH_CHECK(a.skew >= 0 && a.skew < a.experts, "--skew ", a.skew, " must be in [0, --experts ", a.experts,
              "): the router rows kept (0: all)");
  std::vector<int64_t> eps;
  for (int64_t ep : bench::parse_int_list(a.eps, "--eps"))
    if (n % ep == 0 && a.experts % ep == 0) eps.push_back(ep);
  TORCH_CHECK(!eps.empty(), "no expert size of --eps ", a.eps, " divides both the world (", n, ") and --experts ",
              a.experts);
  const int64_t local = a.batch / n, h = a.hidden, moe_layers = a.layers / a.moe_every;
  const double mlp_params = static_cast<double>(8 * h * h + 5 * h);
  auto local_rows = [&](const at::Tensor& t) { return t.narrow(0, world->rank() * local, local); };

  using tessera::nn::MoEExpertCompute;
  std::vector<std::pair<std::string, MoEExpertCompute>> computes;
  for (const auto& name : bench::split_list(a.computes)) {
    TORCH_CHECK(name == "grouped" || name == "padded", "--expert-compute: '", name,
                "' is not an expert compute; use grouped, padded or grouped,padded");
    computes.emplace_back(name, name == "grouped" ? MoEExpertCompute::kGrouped : MoEExpertCompute::kPadded);
  }
  // ep 0 stands for the dense model.
  std::vector<std::pair<int64_t, std::pair<std::string, MoEExpertCompute>>> runs = {{0, computes.front()}};
  for (int64_t ep : eps)
    for (const auto& c : computes) runs.emplace_back(ep, c);
  for (const auto& [ep, compute] : runs) {
    const bool dense = ep == 0;
    Run r = make_run(world, a, dense ? 1 : ep, dense ? 0 : a.experts, 1e-2, compute.second);
    uint64_t step = 0;
    auto train_step = [&] {
      auto [x, y] = batch(a, 1000 + step++);
      r.trainer->train_step(local_rows(x), local_rows(y));
    };
    auto [x0, y0] = batch(a, 7);
    const double initial = r.trainer->evaluate(local_rows(x0), local_rows(y0));
    trace->reset();
    train_step();
    const std::string expert_group = r.ctx->comm(ParallelMode::kExpert)->name();
    const auto a2a = trace->get(expert_group, tessera::comm::OpType::kAllToAll);
    const double step_ms = bench::time_ms(train_step, a.timing());
    // Balanced: per MoE layer the counts, then 4 exchanges of the rows this
    // rank sends (T·k assignments less the dropped, here none or few).
    const double rows = static_cast<double>(local * a.seq * a.top_k);
    const double balanced =
        dense || ep == 1 ? 0.0 : static_cast<double>(moe_layers) * (8.0 * a.experts + 4.0 * rows * h * 4);
    double params = 0;
    for (const auto& [name, p] : r.gpt->placements()) {
      double numel = 1;
      for (int64_t d : p.full_shape) numel *= static_cast<double>(d);
      params += numel;
    }
    const double active =
        dense ? params
              : params - static_cast<double>(moe_layers) * static_cast<double>(a.experts - a.top_k) * mlp_params;
    // The rows the experts ran in the last forward, summed over layers, per rank.
    at::Tensor expert_rows = at::zeros({2}, at::kDouble);
    for (const auto& st : r.gpt->moe_stats()) {
      expert_rows[0] += static_cast<double>(st.rows_routed);
      expert_rows[1] += static_cast<double>(st.rows_computed);
    }
    at::Tensor rank_rows = at::empty({n, 2}, at::kDouble);
    world->all_gather(rank_rows, expert_rows);
    const at::Tensor all_rows = rank_rows.sum(0);
    const at::Tensor busiest = rank_rows[rank_rows.select(1, 1).argmax().item<int64_t>()];
    const double routed = all_rows[0].item<double>(), computed = all_rows[1].item<double>();
    const double expert_flops_per_row = 6.0 * 8.0 * static_cast<double>(h * h);  // c_fc and c_proj, 4h wide
    if (rank == 0) {
      fmt::print(
          "{{\"bench\": \"moe\", \"model\": \"{}\", \"config\": \"L{}-h{}-a{}-s{}-b{}-v{}\", \"ranks\": {}, "
          "\"ep\": {}, \"experts\": {}, \"top_k\": {}, \"moe_every\": {}, \"capacity\": {}, \"skew\": {}, "
          "\"expert_compute\": "
          "\"{}\", \"step_ms\": {:.2f}, \"tokens_per_s\": {:.1f}, \"a2a_calls\": {}, \"a2a_bytes\": {}, "
          "\"a2a_balanced_bytes\": {:.0f}, \"max_over_mean\": {:.3f}, \"rows_routed\": {:.0f}, \"rows_computed\": "
          "{:.0f}, \"busiest_rows_routed\": {:.0f}, \"busiest_rows_computed\": {:.0f}, \"expert_gflop\": {:.4f}, "
          "\"expert_gflop_routed\": {:.4f}, \"params\": {:.0f}, "
          "\"active_params\": {:.0f}, \"initial_loss\": {:.6f}}}\n",
          dense ? "dense" : "moe", a.layers, a.hidden, a.heads, a.seq, a.batch, a.vocab, n, dense ? 0 : ep,
          dense ? 0 : a.experts, a.top_k, a.moe_every, a.capacity, a.skew, dense ? "" : compute.first, step_ms,
          a.batch * a.seq / (step_ms / 1000.0), a2a.calls, a2a.bytes, balanced, dense ? 0.0 : max_over_mean(*r.gpt),
          routed, computed, busiest[0].item<double>(), busiest[1].item<double>(), computed * expert_flops_per_row / 1e9,
          routed * expert_flops_per_row / 1e9, params, active, initial);
      std::fflush(stdout);
    }
  }

  // Balance over training, with and without the load-balancing loss.
  for (double coef : {1e-2, 0.0}) {
    Run r = make_run(world, a, eps.back(), a.experts, coef);
    for (int64_t step = 0; step < a.train_steps; ++step) {
      auto [x, y] = batch(a, 5000 + static_cast<uint64_t>(step));
      const auto st = r.trainer->train_step(local_rows(x), local_rows(y));
      if (rank == 0 && (step % 5 == 0 || step + 1 == a.train_steps)) {
        const auto stats = r.gpt->moe_stats();
        fmt::print(
            "{{\"bench\": \"moe_balance\", \"ep\": {}, \"aux_loss_coef\": {}, \"step\": {}, \"loss\": {:.4f}, "
            "\"aux_loss\": {:.4f}, \"max_over_mean\": {:.3f}, \"tokens_per_expert\": [{}]}}\n",
            eps.back(), coef, step, st.loss, stats.front().aux_loss, max_over_mean(*r.gpt),
            fmt::join(stats.front().tokens_per_expert, ", "));
        std::fflush(stdout);
      }
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
