// tp_modes: the same GPT on the same ranks in every tensor-parallel mode
// that fits the world: 1d (tensor = N), 2d (q² = N, or data N/q² x 2D if N
// is not a square), 2.5d (q²·d = N, the smallest depth d >= 2 that leaves a
// square) and 3d (q³ = N). One JSON line per mode with:
//   step_ms            one training step (forward, loss, backward, gradient
//                      reductions, AdamW), the slowest rank, median of rounds
//   traced_bytes       bytes of one step per rank in traced sizes (Note
//                      [Trace byte counts]), against analytical_bytes, the
//                      mode's formula (docs/tensor-parallel.md) plus the
//                      gradient sums of partial parameters and of the data group
//   wire_bytes         what the rank puts on the wire (bus bytes), against
//                      analytical_wire_bytes
//   peers / peers_bulk distinct ranks this rank exchanges data with in the
//                      step (bulk: groups that move more than a scalar)
//   model_state_bytes  parameters, gradients and AdamW's two moments per rank
//   peak_bytes         the CPU allocator's peak during the step, and its
//                      rise over the bytes live before (activations and
//                      communication buffers)
//   initial_loss       against a plain LibTorch GPT (bench/baseline_gpt.h)
//                      loaded with the same full weights
//
//   mpirun -np 8 tp_modes --layers 4 --hidden 256 --heads 8 --seq 64 --batch 16
//
// Every option and its default: tp_modes --help (docs/cli.md). It chooses
// the grid of every mode itself, so it has no grid options.
#include "baseline_gpt.h"
#include "bench_util.h"
#include "counting_allocator.h"
#include "example_main.h"

#include <tessera/models/gpt.h>
#include <tessera/tessera.h>

#include <fmt/format.h>

#include <cmath>
#include <map>
#include <set>
#include <vector>

namespace {

using tessera::context::ParallelConfig;
using tessera::context::ParallelMode;
using tessera::context::TensorMode;

struct Args {
  int64_t layers = 4, hidden = 256, heads = 8, seq = 64, batch = 16, vocab = 8192;
  int64_t steps = 2, warmup = 1, rounds = 3;
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("tp_modes",
                          "the same GPT step in every tensor-parallel mode that fits the world: time, bytes, peers, "
                          "memory");
  c.group("Model");
  c.add("layers", &a.layers, "GPT blocks");
  c.add("hidden", &a.hidden, "hidden size");
  c.add("heads", &a.heads, "attention heads");
  c.add("seq", &a.seq, "tokens per sequence");
  c.add("batch", &a.batch, "sequences per step, split over the data ranks of each mode");
  c.add("vocab", &a.vocab, "vocabulary");
  bench::add_timing_options(c, &a.steps, &a.warmup, &a.rounds);
  return c;
}

struct Mode {
  std::string name;
  ParallelConfig config;
};

int64_t integer_root(int64_t n, int k) {
  const auto r = static_cast<int64_t>(std::llround(std::pow(static_cast<double>(n), 1.0 / k)));
  int64_t p = 1;
  for (int i = 0; i < k; ++i) p *= r;
  return p == n ? r : 0;
}

std::vector<Mode> modes_for(int64_t n) {
  std::vector<Mode> out{{"1d", ParallelConfig().tensor(static_cast<int>(n))}};
  const auto q = static_cast<int64_t>(std::sqrt(static_cast<double>(n)));
  if (q >= 2) {
    const int tp = static_cast<int>(q * q);
    out.push_back({"2d", ParallelConfig().tensor(tp).tensor_mode(TensorMode::k2D).data(static_cast<int>(n / tp))});
    if (n % tp != 0) out.pop_back();
  }
  for (int64_t d = 2; d <= n / 4; ++d) {
    if (n % d != 0 || integer_root(n / d, 2) < 2) continue;
    out.push_back({"2.5d", ParallelConfig()
                               .tensor(static_cast<int>(n))
                               .tensor_mode(TensorMode::k2p5D)
                               .tensor_depth(static_cast<int>(d))});
    break;
  }
  if (integer_root(n, 3) >= 2) out.push_back({"3d", ParallelConfig().tensor(static_cast<int>(n)).tensor_mode(TensorMode::k3D)});
  return out;
}

// Expected traffic of one step: (group, op) -> elements in traced sizes.
using Volume = std::map<std::pair<std::string, tessera::comm::OpType>, int64_t>;

// The forward and backward of the GPT, per Note [Layer factory contract]'s
// modes (docs/tensor-parallel.md derives each line; the GPT tests check them).
Volume model_volume(const tessera::context::ParallelContextPtr& ctx, const Args& a, int64_t local_batch) {
  using tessera::comm::OpType;
  const auto& c = ctx->config();
  const int64_t L = a.layers, h = a.hidden, s = a.seq;
  auto name = [&](ParallelMode m) { return ctx->comm(m)->name(); };
  Volume v;
  if (c.tensor() == 1) return v;
  if (c.tensor_mode() == TensorMode::k1D) {
    const int64_t T = local_batch * s;
    v[{name(ParallelMode::kTensor), OpType::kAllReduce}] = (4 * L + 2) * T * h + 3 * T;
    return v;
  }
  if (c.tensor_mode() == TensorMode::k3D) {
    const int64_t q = integer_root(c.tensor(), 3), T = local_batch / (q * q) * s;
    const int64_t Vp = (a.vocab + q - 1) / q * q;
    for (OpType op : {OpType::kAllGather, OpType::kReduceScatter}) {
      v[{name(ParallelMode::k3DInput), op}] = (4 * L + 2) * T * h;
      v[{name(ParallelMode::k3DOutput), op}] = 12 * L * T * h + T * Vp;
      v[{name(ParallelMode::k3DWeight), op}] = (12 * L * h * h + 2 * Vp * h) / (q * q);
    }
    v[{name(ParallelMode::k3DInput), OpType::kAllReduce}] = 3 * T;
    v[{name(ParallelMode::k3DOutput), OpType::kAllReduce}] = 4 * (2 * L + 1) * T;
    v[{name(ParallelMode::k3DOutputWeight), OpType::kAllReduce}] = 1;
    return v;
  }
  const bool deep = c.tensor_mode() == TensorMode::k2p5D;
  const int64_t d = deep ? c.tensor_depth() : 1, q = integer_root(c.tensor() / d, 2);
  const int64_t T = local_batch / (q * d) * s, H = h / q, Vq = (a.vocab + q - 1) / q;
  const int64_t acts = 7 * L * T * H + T * Vq, weights = 12 * L * h * h / (q * q) + Vq * H;
  const std::string row = name(deep ? ParallelMode::k2p5DRow : ParallelMode::k2DRow);
  const std::string col = name(deep ? ParallelMode::k2p5DCol : ParallelMode::k2DCol);
  v[{row, OpType::kBroadcast}] = 2 * q * acts;
  v[{row, OpType::kReduce}] = q * acts;
  v[{row, OpType::kAllReduce}] = 4 * (2 * L + 1) * T + 3 * T;
  v[{col, OpType::kBroadcast}] = 2 * q * weights;
  v[{col, OpType::kReduce}] = q * weights;
  v[{col, OpType::kReduceScatter}] = q * T * H;
  v[{col, OpType::kAllGather}] = q * T * H;
  v[{deep ? name(ParallelMode::k2p5DXZ) : col, OpType::kAllReduce}] += 1;
  return v;
}

// What a rank puts on the wire for `bytes` of op over n ranks (Note [Trace byte counts]).
double wire(tessera::comm::OpType op, int n, double bytes) {
  using tessera::comm::OpType;
  if (n == 1) return 0;
  if (op == OpType::kAllReduce) return 2.0 * (n - 1) / n * bytes;
  if (op == OpType::kAllGather || op == OpType::kReduceScatter) return double(n - 1) / n * bytes;
  return bytes;
}

int run(const Args& a) {
  auto trace = std::make_shared<tessera::comm::CommTrace>();
  auto world =
      std::make_shared<tessera::comm::TracingCommunicator>(tessera::comm::make_world_communicator(), trace);
  const int rank = world->rank();
  auto& memory = tessera::test::CountingAllocator::instance();
  tessera::test::CountingScope counting;
  tessera::models::GPTConfig config;
  config.vocab(a.vocab);
  config.context(a.seq);
  config.layers(a.layers);
  config.heads(a.heads);
  config.hidden(a.hidden);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor ids = at::randint(a.vocab, {a.batch, a.seq}, gen, at::kLong);
  const at::Tensor targets = at::randint(a.vocab, {a.batch, a.seq}, gen, at::kLong);

  for (const Mode& mode : modes_for(world->size())) {
    auto ctx = tessera::context::ParallelContext::create(world, mode.config);
    const auto& c = ctx->config();
    auto data = ctx->comm(ParallelMode::kData);
    const int64_t local_batch = a.batch / c.data();
    TORCH_CHECK(a.batch % c.data() == 0, "--batch ", a.batch, " does not split over the data size ", c.data(),
                " of mode ", mode.name);
    const at::Tensor x = ids.narrow(0, data->rank() * local_batch, local_batch);
    const at::Tensor y = targets.narrow(0, data->rank() * local_batch, local_batch);

    torch::manual_seed(0);
    auto gpt = std::make_shared<tessera::models::GPTImpl>(config, tessera::nn::make_layer_factory(ctx));
    const tessera::nn::NamedPlacements placements = gpt->placements();
    baseline::GPT base(a.vocab, a.seq, a.layers, a.heads, a.hidden);
    base->load(gpt->full_state());
    const double base_first = base->loss(x, y).item<double>();
    const double first = gpt->loss(gpt->forward(x), y).item<double>();

    auto sharded = std::make_shared<tessera::parallel::ShardedModule>(
        gpt, ctx, tessera::parallel::ShardedModuleOptions().placements(placements));
    tessera::parallel::ShardedOptimizer opt(
        sharded, std::make_shared<torch::optim::AdamW>(gpt->parameters(), torch::optim::AdamWOptions(1e-4)));
    auto step = [&] {
      opt.zero_grad();
      sharded->run([&] { return gpt->loss(gpt->forward(x), y); }).backward();
      opt.step();
    };
    const double step_ms = bench::time_ms(step, {int(a.steps), int(a.warmup), int(a.rounds)});

    // One more step, traced and counted.
    trace->reset();
    const int64_t live_before = memory.live();
    memory.reset_peak();
    step();
    const int64_t peak = memory.peak();

    Volume expected = model_volume(ctx, a, local_batch);
    int64_t local_numel = 0;
    for (const auto& [name, p] : placements) {
      local_numel += p.param.numel();
      for (const auto& g : p.gradient_groups())
        expected[{g->name(), tessera::comm::OpType::kAllReduce}] += p.param.numel();
    }
    if (c.data() > 1) expected[{data->name(), tessera::comm::OpType::kAllReduce}] += local_numel;
    std::map<std::string, int> group_size;
    std::map<std::string, ParallelMode> mode_of;
    for (ParallelMode m : tessera::context::all_modes()) {
      if (!ctx->has(m)) continue;
      group_size[ctx->comm(m)->name()] = ctx->size(m);
      mode_of.emplace(ctx->comm(m)->name(), m);
    }
    double analytical = 0, analytical_wire = 0;
    for (const auto& [key, elements] : expected) {
      analytical += 4.0 * elements;
      analytical_wire += wire(key.second, group_size.at(key.first), 4.0 * elements);
    }
    std::set<int> peers, bulk;
    std::map<std::string, int64_t> group_bytes;
    for (const auto& [key, record] : trace->snapshot()) group_bytes[key.first] += record.bytes;
    for (const auto& [group, bytes] : group_bytes) {
      auto it = mode_of.find(group);
      if (it == mode_of.end() || bytes == 0) continue;
      for (int r : ctx->grid().group_of(it->second, ctx->global_rank())) {
        if (r == ctx->global_rank()) continue;
        peers.insert(r);
        if (bytes > 8) bulk.insert(r);
      }
    }
    const auto total = trace->total();
    if (rank == 0) {
      fmt::print(
          "{{\"config\": \"L{}-h{}-a{}-s{}-b{}-v{}\", \"ranks\": {}, \"mode\": \"{}\", \"grid\": \"{}\", "
          "\"step_ms\": {:.2f}, \"traced_bytes\": {}, \"analytical_bytes\": {:.0f}, \"wire_bytes\": {:.0f}, "
          "\"analytical_wire_bytes\": {:.0f}, \"peers\": {}, \"peers_bulk\": {}, \"model_state_bytes\": {}, "
          "\"peak_bytes\": {}, \"peak_rise_bytes\": {}, \"initial_loss\": {:.6f}, \"baseline_initial_loss\": {:.6f}}}\n",
          a.layers, a.hidden, a.heads, a.seq, a.batch, a.vocab, world->size(), mode.name,
          tessera::context::to_string(c), step_ms, total.bytes, analytical, total.bus_bytes, analytical_wire,
          peers.size(), bulk.size(), 16 * local_numel, peak, peak - live_before, first, base_first);
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
