// Mixed precision: half-precision parameters with fp32 master copies in
// ShardedOptimizer (Note [Master copies]), the dynamic loss scaler, and bf16
// training that tracks fp32. The bf16 step and GPT tests run on
// TESSERA_TEST_DEVICE (test::device()); the memory tests count the CPU's
// allocator and stay there.
#include "test_util.h"

#include "counting_allocator.h"
#include "reference_gpt.h"

#include "tessera/context/parallel_context.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/optim/loss_scaler.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace tessera {
namespace {

using optim::LossScaler;
using optim::LossScalerOptions;
using parallel::ShardedModule;
using parallel::ShardedModuleOptions;
using parallel::ShardedOptimizer;
using parallel::ShardingSpec;

context::ParallelContextPtr data_context() {
  return context::ParallelContext::create(test::world(), context::ParallelConfig());
}

struct MLPImpl : torch::nn::Module {
  MLPImpl()
      : fc1(register_module("fc1", torch::nn::Linear(24, 40))), fc2(register_module("fc2", torch::nn::Linear(40, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MLP);

// The scaler's arithmetic, on one rank: back-off after `hysteresis`
// overflows, growth after growth_interval clean steps.
TEST(LossScaler, BacksOffAndGrows) {
  auto self = test::world()->split(test::world()->rank(), 0, "self");
  LossScaler s(self, LossScalerOptions().init_scale(1024).growth_interval(3).hysteresis(2));
  s.update(true);
  EXPECT_EQ(s.current_scale(), 1024);  // the first overflow is tolerated
  s.update(true);
  EXPECT_EQ(s.current_scale(), 512);
  s.update(true);
  EXPECT_EQ(s.current_scale(), 256);  // hysteresis spent until the scale grows
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.current_scale(), 256);
  s.update(false);
  EXPECT_EQ(s.current_scale(), 512);
  s.update(true);
  EXPECT_EQ(s.current_scale(), 512);  // hysteresis restored by the growth
  EXPECT_EQ(s.skipped_steps(), 4);
  EXPECT_ERROR_CONTAINS(LossScaler(self, LossScalerOptions().init_scale(-1)),
                        "init_scale must be a positive number, got -1");
  EXPECT_ERROR_CONTAINS(LossScaler(self, LossScalerOptions().backoff_factor(1.5)),
                        "backoff_factor must be in (0, 1), got 1.5");
  EXPECT_ERROR_CONTAINS(LossScaler(self, LossScalerOptions().hysteresis(0)), "hysteresis must be >= 1, got 0");
}

// fp16 parameters computed in fp32 (LibTorch 1.13 has no fp16 matrix
// product on the CPU): the gradients reach the parameters in fp16.
struct HalfMLPImpl : torch::nn::Module {
  HalfMLPImpl() {
    torch::nn::Linear a(24, 40), b(40, 8);
    w1 = register_parameter("w1", a->weight.detach().to(at::kHalf));
    b1 = register_parameter("b1", a->bias.detach().to(at::kHalf));
    w2 = register_parameter("w2", b->weight.detach().to(at::kHalf));
    b2 = register_parameter("b2", b->bias.detach().to(at::kHalf));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(at::linear(x.to(at::kFloat), w1.to(at::kFloat), b1.to(at::kFloat)));
    return at::linear(h, w2.to(at::kFloat), b2.to(at::kFloat));
  }
  at::Tensor w1, b1, w2, b2;
};
TORCH_MODULE(HalfMLP);

// fp16 parameters, fp32 masters, ZeRO-2: an inf in one rank's gradient
// skips the step on every rank, halves the scale, and leaves the parameters,
// the masters and the optimizer states bit-identical.
TEST(LossScaler, InjectedInfOnOneRankSkipsTheStepEverywhere) {
  torch::manual_seed(0);
  HalfMLP model;
  auto sharded = std::make_shared<ShardedModule>(model.ptr(), data_context(),
                                                 ShardedModuleOptions().spec(ShardingSpec::zero2()).bucket_bytes(512));
  ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(model->parameters()));
  LossScaler scaler(test::world(), LossScalerOptions().init_scale(256).hysteresis(1));
  auto run_step = [&](bool inject) {
    opt.zero_grad();
    at::Tensor x = test::seeded_randn({4, 24}, 1 + test::world()->rank());
    if (inject && test::world()->rank() == 0) x[0][0] = std::numeric_limits<float>::infinity();
    at::Tensor out = sharded->run([&] { return model->forward(x); });
    scaler.scale(out.pow(2).mean()).backward();
    return scaler.step(opt);
  };
  ASSERT_TRUE(run_step(false));
  auto snapshot = [&] {
    std::vector<at::Tensor> s;
    for (const auto& p : opt.pieces_for_step()) s.push_back(p.detach().clone());  // fp32 masters
    for (const auto& t : model->parameters()) s.push_back(t.detach().clone());
    for (const auto& entry : opt.inner().state()) {
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
      s.push_back(st.exp_avg().clone());
      s.push_back(st.exp_avg_sq().clone());
    }
    opt.skip_step();
    return s;
  };
  const auto before = snapshot();
  EXPECT_FALSE(run_step(true)) << "every rank must skip";
  EXPECT_EQ(scaler.current_scale(), 128);
  const auto after = snapshot();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i])) << "tensor " << i;
  EXPECT_TRUE(run_step(false)) << "the next clean step goes through";
}

// Model states after a step with bf16 parameters and fp32 AdamW:
// 2Ψ/s_p + 2Ψ/s_g + 12Ψ/s_os, up to the padding of each bucket, both as
// ShardedOptimizer counts them and as the allocator does: the bytes of CPU
// storage live after the step beyond those live before the model was built.
TEST(MixedPrecision, Bf16ModelStateMemoryEqualsTheFormula) {
  const int dp = test::world()->size();
  auto& counter = test::CountingAllocator::instance();
  for (const char* spec : {"ddp", "zero1", "zero2", "zero3"}) {
    SCOPED_TRACE(spec);
    test::CountingScope counting;
    const int64_t before = counter.live();
    const uint64_t mark = counter.mark();
    torch::manual_seed(0);
    MLP model;
    model->to(at::kBFloat16);
    int64_t psi = 0;
    for (const auto& p : model->parameters()) psi += p.numel();
    auto sharded = std::make_shared<ShardedModule>(
        model.ptr(), data_context(), ShardedModuleOptions().spec(ShardingSpec::parse(spec)).bucket_bytes(1024));
    ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(model->parameters()));
    opt.zero_grad();
    at::Tensor x = test::seeded_randn({4, 24}, 3).to(at::kBFloat16);
    sharded->run([&] { return model->forward(x); }).to(at::kFloat).pow(2).mean().backward();
    opt.step();
    const auto d = sharded->degrees();
    const auto m = opt.memory();
    const double slack = 12.0 * dp * sharded->num_buckets();  // padding: < dp elements per bucket and state
    EXPECT_NEAR(m.params, 2.0 * psi / d.params, slack);
    EXPECT_NEAR(m.grads, 2.0 * psi / d.grads, slack);
    EXPECT_NEAR(m.optim, 12.0 * psi / d.optim, slack);
    x = at::Tensor();
    const double formula = 2.0 * psi / d.params + 2.0 * psi / d.grads + 12.0 * psi / d.optim;
    EXPECT_NEAR(static_cast<double>(counter.live() - before), formula, slack + 1024)
        << "allocated and still live: " << counter.live_since(mark);
  }
}

// bf16 parameters with their fp32 masters on disk, in tiles smaller than a
// parameter's piece: the same steps, bit for bit, as the masters in memory,
// and no optimizer state holds memory between steps: the allocator's live
// bytes after the steps are the parameters and gradients (2Ψ/s_p + 2Ψ/s_g)
// and the tile buffers, where the masters in memory add 12Ψ/s_os.
TEST(MixedPrecision, Bf16MastersOnDiskGiveTheSameSteps) {
  struct Run {
    std::vector<at::Tensor> params;
    int64_t state_bytes_in_memory = 0;
    int64_t live_bytes = 0;            // the allocator's, beyond those before the model
    std::string live_blocks;           // what they are: "bytes x count, ..."
    double params_and_grads = 0;       // 2Ψ/s_p + 2Ψ/s_g
    double optimizer_states = 0;       // 12Ψ/s_os
    double slack = 0;                  // bucket padding
  };
  auto& counter = test::CountingAllocator::instance();
  auto run = [&counter](parallel::ShardedOptimizerOptions options) {
    test::CountingScope counting;
    const int64_t before = counter.live();
    const uint64_t mark = counter.mark();
    torch::manual_seed(0);
    MLP model;
    model->to(at::kBFloat16);
    auto sharded = std::make_shared<ShardedModule>(
        model.ptr(), data_context(), ShardedModuleOptions().spec(ShardingSpec::zero2()).bucket_bytes(1024));
    ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(model->parameters()), options);
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      at::Tensor x = test::seeded_randn({4, 24}, 3 + step).to(at::kBFloat16);
      sharded->run([&] { return model->forward(x); }).to(at::kFloat).pow(2).mean().backward();
      opt.step();
    }
    Run r;
    r.live_bytes = counter.live() - before;
    r.live_blocks = counter.live_since(mark);
    int64_t psi = 0;
    for (const auto& p : model->parameters()) psi += p.numel();
    const auto d = sharded->degrees();
    r.params_and_grads = 2.0 * psi / d.params + 2.0 * psi / d.grads;
    r.optimizer_states = 12.0 * psi / d.optim;
    r.slack = 12.0 * test::world()->size() * sharded->num_buckets() + 1024;
    auto full = sharded->full_params();
    for (const auto& p : model->parameters()) r.params.push_back(p.detach().clone());
    for (const auto& entry : opt.inner().state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
      r.state_bytes_in_memory += static_cast<int64_t>(s.exp_avg().storage().nbytes() + s.exp_avg_sq().storage().nbytes());
    }
    return r;
  };
  const Run in_memory = run({});
  const Run on_disk = run(parallel::ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(
      parallel::DiskOffloadOptions().dir(::testing::TempDir()).tile_bytes(400).buffers(2)));
  ASSERT_EQ(on_disk.params.size(), in_memory.params.size());
  for (size_t i = 0; i < in_memory.params.size(); ++i) {
    EXPECT_EQ(on_disk.params[i].scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(on_disk.params[i], in_memory.params[i])) << "parameter " << i;
  }
  EXPECT_GT(in_memory.state_bytes_in_memory, 0);
  EXPECT_EQ(on_disk.state_bytes_in_memory, 0);
  EXPECT_NEAR(in_memory.live_bytes, in_memory.params_and_grads + in_memory.optimizer_states, in_memory.slack)
      << in_memory.live_blocks;
  // Two slots of a tile (Note [Tiles in slots]): 400 bytes of masters and
  // their two AdamW states, rounded up to the 4 KiB of direct I/O, and
  // 4 KiB to align the slot's start.
  const int64_t direct = 4096;
  const int64_t slots = 2 * ((3 * 400 + direct - 1) / direct * direct + direct);
  EXPECT_NEAR(on_disk.live_bytes, on_disk.params_and_grads + slots, on_disk.slack) << on_disk.live_blocks;
}

// bf16 parameters and fp32 masters against a reference that keeps the
// masters itself (plain LibTorch): each step the bf16 model's gradient,
// divided by the data size in bf16 as the data-parallel mean is, becomes the
// fp32 masters' gradient; LibTorch's AdamW steps the masters; the model gets
// them rounded to bf16. 20 steps under every ZeRO stage, every parameter
// compared after each. Only rank 0's rows carry a loss (the others' gradients
// are exactly 0), so the reduction's summation order cannot round, and any
// difference is the masters' path: a step taken in bf16 instead loses the
// small updates. At data sizes that are powers of two.
TEST(MixedPrecision, Bf16StepsEqualExplicitFp32Masters) {
  auto ctx = data_context();
  const int dp = ctx->size(context::ParallelMode::kData);
  // Where the mean's 1/dp is applied (loss, gradient, reduction) rounds
  // differently in bf16 unless dividing by dp is exact.
  if ((dp & (dp - 1)) != 0) GTEST_SKIP() << "dividing by a data size of " << dp << " rounds in bf16";
  const int rank = ctx->rank(context::ParallelMode::kData);
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  // Both sides on the test device: bf16 rounds alike there.
  auto batch = [](int step) { return test::device_randn({4, 24}, 100 + step).to(at::kBFloat16); };
  for (const char* spec : {"ddp", "zero1", "zero2", "zero3"}) {
    SCOPED_TRACE(spec);
    torch::manual_seed(0);
    MLP reference;
    reference->to(test::device(), at::kBFloat16);
    std::vector<at::Tensor> masters;
    for (const auto& p : reference->parameters()) masters.push_back(p.detach().to(at::kFloat).requires_grad_());
    torch::optim::AdamW master_opt(masters, adamw);

    torch::manual_seed(0);
    MLP model;
    model->to(test::device(), at::kBFloat16);
    auto sharded = std::make_shared<ShardedModule>(
        model.ptr(), ctx, ShardedModuleOptions().spec(ShardingSpec::parse(spec)).bucket_bytes(1024));
    ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(model->parameters(), adamw));
    for (int step = 0; step < 20; ++step) {
      const at::Tensor x = batch(step);
      // The reference: rank 0's loss, the mean's division in bf16, fp32 masters.
      for (auto& p : reference->parameters()) p.mutable_grad() = at::Tensor();
      reference->forward(x).to(at::kFloat).pow(2).mean().backward();
      {
        at::NoGradGuard no_grad;
        const auto params = reference->parameters();
        for (size_t i = 0; i < params.size(); ++i) masters[i].mutable_grad() = params[i].grad().div(dp).to(at::kFloat);
        master_opt.step();
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
      }
      // Tessera: every rank runs the batch, only rank 0's counts.
      opt.zero_grad();
      const double weight = rank == 0 ? 1.0 : 0.0;
      (sharded->run([&] { return model->forward(x); }).to(at::kFloat).pow(2).mean() * weight).backward();
      opt.step();
      auto full = sharded->full_params();
      const auto got = model->parameters(), want = reference->parameters();
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].scalar_type(), at::kBFloat16);
        EXPECT_LE(test::rel_error(got[i].to(at::kFloat), want[i].to(at::kFloat)), 1e-6)
            << "parameter " << i << " after step " << step;
      }
    }
  }
}

// bf16 GPT with fp32 masters, sharded over the data group, tracks the fp32
// serial reference GPT's loss (tests/reference_gpt.h: plain LibTorch, nothing
// from tessera; the same initial weights): 50 AdamW steps within 2 %
// (relative) at every step.
TEST(MixedPrecision, Bf16GPTTracksFp32Over50Steps) {
  auto ctx = data_context();
  auto data = ctx->comm(context::ParallelMode::kData);
  auto self = test::world()->split(test::world()->rank(), 0, "self");
  auto config = models::GPTConfig::preset("tiny");
  constexpr int64_t kRows = 24, kSeq = 16;  // every data size tested (1, 2, 3, 4, 8) divides kRows
  auto batch = [&](int step, uint64_t salt) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * salt + step % 4);  // 4 batches, repeated: it learns
    return at::randint(config.vocab(), {kRows, kSeq}, gen, at::kLong);
  };
  const auto adamw = torch::optim::AdamWOptions(3e-3).weight_decay(0.01);
  // The fp32 serial reference, from tessera's GPT-2 initialisation with seed 3
  // (tessera's GPT is the source of weights only), plain AdamW.
  auto train_fp32 = [&] {
    std::map<std::string, at::Tensor> initial;
    {
      torch::manual_seed(3);
      models::GPT source(config, nn::make_1d_factory(self, false, 1, 2));
      for (const auto& entry : source->full_state()) initial[entry.first] = entry.second.clone();
    }
    test::ReferenceGPT gpt(test::reference_config(config));
    gpt->load_full_state(initial);
    torch::optim::AdamW opt(gpt->parameters(), adamw);
    std::vector<double> losses;
    for (int step = 0; step < 50; ++step) {
      opt.zero_grad();
      at::Tensor loss = gpt->loss(gpt->forward(batch(step, 1)), batch(step, 2));
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
    return losses;
  };
  // Tessera's GPT in bf16 (the same seed, so the same weights rounded),
  // sharded over the data group with ZeRO-2 and fp32 masters.
  auto train_bf16 = [&] {
    torch::manual_seed(3);
    models::GPT gpt(config, nn::make_1d_factory(self, false, 1, 2));
    gpt->to(test::device(), at::kBFloat16);  // the fp32 reference stays on the CPU
    auto sharded = std::make_shared<ShardedModule>(gpt.ptr(), ctx, ShardedModuleOptions().spec(ShardingSpec::zero2()));
    ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(gpt->parameters(), adamw));
    std::vector<double> losses;
    TORCH_CHECK(kRows % data->size() == 0, "the test's batch does not split over the data ranks");
    const int64_t rows = kRows / data->size();
    for (int step = 0; step < 50; ++step) {
      opt.zero_grad();
      const at::Tensor ids = batch(step, 1).narrow(0, data->rank() * rows, rows).to(test::device());
      const at::Tensor tgt = batch(step, 2).narrow(0, data->rank() * rows, rows).to(test::device());
      at::Tensor loss = sharded->run([&] { return gpt->loss(gpt->forward(ids).to(at::kFloat), tgt); });
      loss.backward();
      opt.step();
      at::Tensor l = at::tensor({loss.item<double>()}, at::kDouble);
      data->all_reduce(l);
      losses.push_back(l.item<double>() / data->size());
    }
    return losses;
  };
  // The bf16 losses are the data group's mean, the same on every rank: one
  // rank trains the reference and compares (the harness fails every rank
  // when one fails), instead of every rank repeating 50 serial steps.
  const auto bf16 = train_bf16();
  if (test::world()->rank() != 0) return;
  const auto fp32 = train_fp32();
  double worst = 0;
  for (size_t i = 0; i < fp32.size(); ++i) {
    const double rel = std::abs(bf16[i] - fp32[i]) / fp32[i];
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 0.02) << "step " << i << ": bf16 " << bf16[i] << " fp32 " << fp32[i];
  }
  EXPECT_LT(fp32.back(), 0.9 * fp32.front()) << "the reference must learn for the comparison to mean anything";
  std::printf(
      "bf16 vs fp32 GPT, 50 steps: largest relative loss difference %.4f (first %.4f, last fp32 %.4f bf16 %.4f)\n",
      worst, fp32.front(), fp32.back(), bf16.back());
}

}  // namespace
}  // namespace tessera
