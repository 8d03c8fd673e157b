// gpt_step: time of one training step (forward, loss, backward, AdamW) of
// tessera's GPT over one tensor-parallel group (by default all ranks), for
// the layers make_layer_factory gives the context's tensor mode and for
// their sequence-parallel variant, against a plain LibTorch GPT of the same
// shape (bench/baseline_gpt.h) timed in the same run on every rank. Prints
// one JSON object per configuration.
//
//   mpirun -np 2 gpt_step --layers 4 --hidden 256 --tp 2 --tp-mode 1d
//   mpirun -np 1 gpt_step --device cuda --dtype bf16 --layers 24 --hidden 1024 --heads 16
//
// Every option and its default: gpt_step --help (docs/cli.md). The grid is
// one tensor-parallel group: --tp defaults to the number of ranks, and data,
// pipeline, sequence and expert must be 1.
//
// --dtype bf16 runs both models with bf16 parameters and activations (AdamW
// on bf16 parameters: the same arithmetic on both sides). On CUDA rank r
// uses GPU r mod the device count, and every step ends with a device
// synchronize. MFU (Note [Model FLOPs]) is measured against the dense
// matmul peak of the same run: an N x N product in the same dtype on the
// same device (N = --matmul, default 1024 on CPU, 8192 on CUDA), timed on
// all ranks at once, as the steps are.
//
// --arch llama times the Llama family's shape instead (RMSNorm, rotary
// positions, grouped-query attention with --kv-heads, SwiGLU of --ffn, an
// untied head) against bench/baseline_llama.h.
//
// Note [Model FLOPs]
// Per step, forward and backward (3x the forward) of the matrix products a
// token passes through: per layer 2 (h·a + 2 h·k + a·h + m h f) with a the
// attention width (heads · head_dim), k the key/value width, m the MLP's
// matrices (GPT: 24 h^2 in all), and 4 s a for the scores and the weighted
// values over the whole sequence (the causal half is not taken off), and
// 2 h V for the head. Embeddings, norms, softmax and the optimizer are not
// counted. Per rank: divided by the tensor size.
#include "baseline_gpt.h"
#include "baseline_llama.h"
#include "bench_util.h"
#include "example_main.h"

#include <tessera/models/gpt.h>
#include <tessera/tessera.h>
#include <torch/cuda.h>

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace {

struct Args {
  int64_t layers = 4, hidden = 256, heads = 8, seq = 128, batch = 8, vocab = 8192;
  std::string arch = "gpt";
  int64_t kv_heads = 0, ffn = 0;  // 0: the arch's default (llama: heads / 4, 3.5 h rounded up to 64)
  int64_t steps = 4, warmup = 2, rounds = 3;
  int64_t matmul = 0;  // 0: 1024 on CPU, 8192 on CUDA
  std::string device = "cpu", dtype = "fp32";
  bench::Timing timing() const { return {int(steps), int(warmup), int(rounds)}; }
};

bool llama(const Args& a) { return a.arch == "llama"; }

// Note [Model FLOPs]
double step_flops(const Args& a) {
  const double h = double(a.hidden), tokens = double(a.batch * a.seq);
  const double k = llama(a) ? h / double(a.heads) * double(a.kv_heads) : h, m = llama(a) ? 3 : 2;
  const double f = double(a.ffn);
  const double per_token =
      double(a.layers) * (2 * (2 * h * h + 2 * h * k + m * h * f) + 4 * double(a.seq) * h) + 2 * h * double(a.vocab);
  return 3 * tokens * per_token;
}

// FLOP/s of an n x n matmul in `options`, the slowest rank's (all ranks at once).
double matmul_peak(const at::TensorOptions& options, int64_t n) {
  at::Tensor x = at::randn({n, n}, options), y = at::randn({n, n}, options);
  const bool cuda = options.device().is_cuda();
  const double ms = bench::time_ms(
      [&] {
        at::Tensor z = at::matmul(x, y);
        if (cuda) torch::cuda::synchronize();
      },
      {3, 1, 5});
  return 2.0 * double(n) * double(n) * double(n) / (ms / 1e3);
}

tessera::cli::Command command(Args& a, tessera::context::ParallelConfig& grid) {
  tessera::cli::Command c("gpt_step",
                          "one GPT training step over a tensor-parallel group against a plain LibTorch GPT, with MFU");
  c.group("Model");
  c.add("layers", &a.layers, "GPT blocks");
  c.add("hidden", &a.hidden, "hidden size");
  c.add("heads", &a.heads, "attention heads");
  c.add("arch", &a.arch, "GPT-2's architecture, or the Llama family's", {"gpt", "llama"});
  c.add("kv-heads", &a.kv_heads, "key/value heads of --arch llama; 0: heads / 4");
  c.add("ffn", &a.ffn, "MLP width; 0: 4 x hidden (gpt), 3.5 x hidden rounded up to 64 (llama)");
  c.add("seq", &a.seq, "tokens per sequence");
  c.add("batch", &a.batch, "sequences per step");
  c.add("vocab", &a.vocab, "vocabulary");
  c.group("Grid");
  tessera::context::add_grid_options(c, grid);
  c.default_text("tp", "the number of ranks");
  c.add("seed", &grid.seed(), "base of every mode's seed");
  c.group("Device");
  c.add("device", &a.device, "where both models run; on CUDA rank r uses GPU r mod the device count",
        {"cpu", "cuda"});
  c.add("dtype", &a.dtype, "parameters and activations of both models", {"fp32", "bf16"});
  c.add("matmul", &a.matmul, "side N of the N x N matmul that measures the peak; 0: 1024 on CPU, 8192 on CUDA");
  bench::add_timing_options(c, &a.steps, &a.warmup, &a.rounds);
  return c;
}

// The checks of the options, and --matmul's default.
void check(Args& a) {
  TORCH_CHECK(a.device == "cpu" || torch::cuda::is_available(),
              "gpt_step: --device cuda, but this LibTorch sees no CUDA device");
  if (a.matmul == 0) a.matmul = a.device == "cuda" ? 8192 : 1024;
  TORCH_CHECK(llama(a) || (a.kv_heads == 0 && a.ffn == 0), "gpt_step: --kv-heads and --ffn are options of --arch "
              "llama; GPT-2's are heads and 4 x hidden");
  if (a.kv_heads == 0) a.kv_heads = llama(a) ? std::max<int64_t>(1, a.heads / 4) : a.heads;
  if (a.ffn == 0) a.ffn = llama(a) ? (a.hidden * 7 / 2 + 63) / 64 * 64 : 4 * a.hidden;
  TORCH_CHECK(a.matmul > 0, "gpt_step: --matmul must be positive, got ", a.matmul);
}

int run(Args& a, tessera::context::ParallelConfig grid, const tessera::cli::Command& command) {
  check(a);
  auto world = tessera::comm::make_world_communicator();
  const int rank = world->rank();
  // Without --tp, every rank is in the one tensor-parallel group.
  if (!command.given("tp")) grid.tensor(world->size());
  auto ctx = tessera::context::ParallelContext::create(world, grid);
  const auto& c = ctx->config();
  TORCH_CHECK(c.data() == 1 && c.pipeline() == 1, "gpt_step times one tensor-parallel group, but the grid has data ",
              c.data(), " and pipeline ", c.pipeline(), "; set --tp to the number of ranks (bench/dp_step and ",
              "bench/pipeline time the other dimensions)");
  const int n = c.tensor();
  tessera::models::GPTConfig config;
  // The baseline's rotation has no frequency scaling.
  if (llama(a))
    config = tessera::models::GPTConfig::preset("llama-tiny").rope_scaling(c10::nullopt).kv_heads(a.kv_heads).ffn(
        a.ffn);
  config.vocab(a.vocab);
  config.context(a.seq);
  config.layers(a.layers);
  config.heads(a.heads);
  config.hidden(a.hidden);
  const bool cuda = a.device == "cuda";
  const at::Device device =
      cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(rank % int(torch::cuda::device_count())))
           : at::Device(at::kCPU);
  const at::ScalarType dtype = a.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  torch::Tensor ids = torch::randint(a.vocab, {a.batch, a.seq}, gen, torch::kLong).to(device);
  torch::Tensor targets = torch::randint(a.vocab, {a.batch, a.seq}, gen, torch::kLong).to(device);
  const double peak = matmul_peak(at::TensorOptions().device(device).dtype(dtype), a.matmul);
  const double flops = step_flops(a) / n;
  auto sync = [&] {
    if (cuda) torch::cuda::synchronize();
  };

  for (bool sp : {false, true}) {
    // The variant is the same model at size 1, and belongs to 1D.
    if (sp && (n == 1 || c.tensor_mode() != tessera::context::TensorMode::k1D)) continue;
    torch::manual_seed(0);
    tessera::models::GPT gpt(config, tessera::nn::make_layer_factory(ctx, sp));
    auto full = gpt->full_state();  // before the cast: the baseline starts from the same values
    gpt->to(device, dtype);
    torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(1e-4));
    auto tessera_step = [&] {
      opt.zero_grad();
      at::Tensor loss = gpt->loss(gpt->forward(ids), targets);
      loss.backward();
      gpt->reduce_partial_gradients();
      opt.step();
      sync();
    };
    std::shared_ptr<torch::nn::Module> base;
    std::function<torch::Tensor()> base_loss;
    if (llama(a)) {
      baseline::Llama l(baseline::LlamaShape{a.vocab, a.layers, a.heads, a.kv_heads, a.hidden, a.ffn});
      l->load(full);
      base = l.ptr();
      base_loss = [l, &ids, &targets]() mutable { return l->loss(ids, targets); };
    } else {
      baseline::GPT g(a.vocab, a.seq, a.layers, a.heads, a.hidden);
      g->load(full);
      base = g.ptr();
      base_loss = [g, &ids, &targets]() mutable { return g->loss(ids, targets); };
    }
    base->to(device, dtype);
    const double base_first = base_loss().item<double>();
    const double first = gpt->loss(gpt->forward(ids), targets).item<double>();
    torch::optim::AdamW base_opt(base->parameters(), torch::optim::AdamWOptions(1e-4));
    auto base_step = [&] {
      base_opt.zero_grad();
      torch::Tensor loss = base_loss();
      loss.backward();
      base_opt.step();
      sync();
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
          "{{\"arch\": \"{}\", \"config\": \"L{}-h{}-a{}-k{}-f{}-s{}-b{}-v{}\", \"tp\": {}, \"tp_mode\": \"{}\", "
          "\"sp_variant\": {}, \"step_ms\": {:.3f}, "
          "\"tokens_per_s\": {:.1f}, \"baseline_step_ms\": {:.3f}, \"ratio\": {:.4f}, "
          "\"initial_loss\": {:.6f}, \"baseline_initial_loss\": {:.6f}, \"device\": \"{}\", \"dtype\": \"{}\", "
          "\"matmul_n\": {}, \"matmul_peak_tflops\": {:.4f}, \"model_tflop_per_step_per_rank\": {:.5f}, "
          "\"mfu\": {:.4f}, \"baseline_mfu\": {:.4f}}}\n",
          a.arch, a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.seq, a.batch, a.vocab, n,
          tessera::context::tensor_mode_name(c.tensor_mode()), sp ? "true" : "false", step_ms,
          a.batch * a.seq / (step_ms / 1000.0), base_ms, step_ms / base_ms, first, base_first,
          cuda ? device.str() : "cpu", a.dtype, a.matmul, peak / 1e12, flops / 1e12,
          flops / (step_ms / 1e3) / peak, step_flops(a) / (base_ms / 1e3) / peak);
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
