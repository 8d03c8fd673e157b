// ShardedModule + ShardedOptimizer against single-process training on the
// same global batch, for every preset and mixed AMSP specs, on modules
// written here (an MLP with its own forward and a Sequential conv net): ten
// AdamW steps, model-state memory against the formula, bytes moved against
// the analytical volume, micro-batch accumulation, offload, bad specs.
#include "counting_allocator.h"
#include "test_util.h"

#include "tessera/comm/factory.h"
#include "tessera/comm/hierarchical_communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/parallel/bucket_size.h"
#include "tessera/parallel/flat_bucket.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/spec_on_hosts.h"

#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <iostream>
#include <torch/torch.h>

namespace tessera {
namespace {

using parallel::ShardedModule;
using parallel::ShardedModuleOptions;
using parallel::ShardedOptimizer;
using parallel::ShardedOptimizerOptions;
using parallel::ShardingSpec;

constexpr double kRelTolerance = 1e-5;  // fp32, relative to the norm of the serial tensor
constexpr int64_t kGlobalBatch = 48;  // every data size tested (1, 2, 3, 4, 8) divides it, twice at 8
constexpr int kSteps = 10;

// TESSERA_TEST_DEVICE=cuda runs this file's tests on the GPU (test::device()).

// Sizes chosen so that no bucket divides evenly: padding is always exercised.
struct MLPImpl : torch::nn::Module {
  MLPImpl()
      : fc1(register_module("fc1", torch::nn::Linear(11, 13))),
        fc2(register_module("fc2", torch::nn::Linear(13, 7))),
        fc3(register_module("fc3", torch::nn::Linear(7, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return fc3(torch::tanh(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(MLP);

torch::nn::Sequential conv_net() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 5, 3).padding(1)), torch::nn::ReLU(),
                               torch::nn::MaxPool2d(2), torch::nn::Conv2d(5, 6, 3), torch::nn::ReLU(),
                               torch::nn::Flatten(), torch::nn::Linear(6 * 2 * 2, 3));
}

enum class Net { kMLP, kConv };

std::shared_ptr<torch::nn::Module> make_net(Net net) {
  torch::manual_seed(0);
  std::shared_ptr<torch::nn::Module> m;
  if (net == Net::kMLP) {
    m = MLP().ptr();
  } else {
    m = conv_net().ptr();
  }
  m->to(test::device());
  return m;
}

at::Tensor inputs(Net net, int step) {
  return (net == Net::kMLP ? test::seeded_randn({kGlobalBatch, 11}, 100 + step)
                           : test::seeded_randn({kGlobalBatch, 3, 8, 8}, 100 + step))
      .to(test::device());
}
at::Tensor targets(int step) { return test::seeded_randn({kGlobalBatch, 3}, 200 + step).to(test::device()); }

at::Tensor forward(Net net, torch::nn::Module& m, const at::Tensor& x) {
  if (net == Net::kMLP) return dynamic_cast<MLPImpl&>(m).forward(x);
  return dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x);
}

context::ParallelContextPtr data_context(comm::CommunicatorPtr world = test::world()) {
  return context::ParallelContext::create(world, context::ParallelConfig());
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.05); }

enum class Opt { kAdamW, kAdam, kSGD };

// AdamW is the case the issue names; SGD with momentum is not invariant to
// the scale of the gradient, so it also catches a wrong average.
std::shared_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, const std::vector<at::Tensor>& params) {
  switch (opt) {
    case Opt::kAdam:
      return std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    case Opt::kSGD:
      return std::make_shared<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
    default:
      return std::make_shared<torch::optim::AdamW>(params, adamw());
  }
}

// The serial run: losses of each step and the final parameters.
struct SerialRun {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
};

SerialRun serial_run(Net net, int steps, Opt which) {
  auto model = make_net(net);
  auto optimizer = make_optimizer(which, model->parameters());
  torch::optim::Optimizer& opt = *optimizer;
  SerialRun run;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    at::Tensor loss = torch::mse_loss(forward(net, *model, inputs(net, step)), targets(step));
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item<double>());
  }
  for (auto& p : model->parameters()) run.params.push_back(p.detach().clone());
  return run;
}

struct Case {
  std::string spec;
  Net net;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.spec + (info.param.net == Net::kMLP ? "_mlp" : "_conv");
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
}

// One data-parallel step on this rank's rows of the global batch; returns
// the global mean loss. With `micro` > 1, the rows are split into micro-batches
// that accumulate without gradient communication until the last.
double parallel_step(Net net, ShardedModule& sharded, ShardedOptimizer& opt, int step, int micro = 1) {
  const auto& group = sharded.group();
  TORCH_CHECK(kGlobalBatch % (group->size() * micro) == 0, "the test's batch does not split over the ranks");
  const int64_t rows = kGlobalBatch / group->size();
  at::Tensor x = inputs(net, step).narrow(0, group->rank() * rows, rows);
  at::Tensor y = targets(step).narrow(0, group->rank() * rows, rows);
  opt.zero_grad();
  double local = 0.0;
  for (int m = 0; m < micro; ++m) {
    const int64_t mrows = rows / micro;
    at::Tensor xm = x.narrow(0, m * mrows, mrows), ym = y.narrow(0, m * mrows, mrows);
    sharded.set_gradient_sync(m == micro - 1);
    at::Tensor out =
        net == Net::kConv ? sharded.forward(xm) : sharded.run([&] { return forward(net, *sharded.module(), xm); });
    at::Tensor loss = torch::mse_loss(out, ym) / micro;
    loss.backward();
    local += loss.item<double>();
  }
  opt.step();
  at::Tensor total = at::tensor({local}, at::kDouble);
  group->all_reduce(total);
  return total.item<double>() / group->size();
}

void expect_matches_serial(Net net, const std::string& spec, ShardedModuleOptions module_options,
                           ShardedOptimizerOptions optimizer_options = {}, int micro = 1, Opt which = Opt::kAdamW) {
  const SerialRun serial = serial_run(net, kSteps, which);
  auto model = make_net(net);
  auto sharded = std::make_shared<ShardedModule>(model, data_context(), module_options.spec(ShardingSpec::parse(spec)));
  ShardedOptimizer opt(sharded, make_optimizer(which, model->parameters()), optimizer_options);
  for (int step = 0; step < kSteps; ++step) {
    const double loss = parallel_step(net, *sharded, opt, step, micro);
    EXPECT_NEAR(loss, serial.losses[step], kRelTolerance * std::abs(serial.losses[step])) << "step " << step;
  }
  auto full = sharded->full_params();
  const auto params = model->parameters();
  ASSERT_EQ(params.size(), serial.params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_LE(test::rel_error(params[i].detach(), serial.params[i]), kRelTolerance) << "parameter " << i;
  }
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.spec << (c.net == Net::kMLP ? " mlp" : " conv"); }

// A spec whose sub-groups do not divide the data size is skipped
// (test::spec_fits); at data size 1 the rest are the serial run.
class DataParallelSpecs : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const int dp = test::world()->size();
    if (!test::spec_fits(GetParam().spec, dp))
      GTEST_SKIP() << GetParam().spec << " has a sub-group that does not divide " << dp;
  }
};

TEST_P(DataParallelSpecs, TenAdamWStepsEqualSingleProcess) {
  const Case c = GetParam();
  expect_matches_serial(c.net, c.spec, ShardedModuleOptions().bucket_bytes(256));
}

// Model-state bytes alive after a step (counted from live storages) equal
// 4Ψ/s_p + 4Ψ/s_g + 8Ψ/s_os for fp32 AdamW, up to the padding of each
// bucket to a multiple of the largest degree (the bytes it adds, not a
// bound per bucket), no other buffer left behind. The counting allocator below measures the same without the
// buckets' bookkeeping.
TEST_P(DataParallelSpecs, ModelStateMemoryEqualsTheFormula) {
  const Case c = GetParam();
  auto model = make_net(c.net);
  int64_t psi = 0;
  for (auto& p : model->parameters()) psi += p.numel();
  auto sharded = std::make_shared<ShardedModule>(
      model, data_context(), ShardedModuleOptions().bucket_bytes(256).spec(ShardingSpec::parse(c.spec)));
  ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(model->parameters(), adamw()));
  parallel_step(c.net, *sharded, opt, 0);
  const auto d = sharded->degrees();
  const auto m = opt.memory();
  const double formula = 4.0 * psi / d.params + 4.0 * psi / d.grads + 8.0 * psi / d.optim;
  double padding = 0;  // fp32 bytes of padding over all buckets
  for (size_t b = 0; b < sharded->num_buckets(); ++b)
    padding += 4.0 * static_cast<double>(sharded->bucket(b).numel() - sharded->bucket(b).used());
  // Parameters and gradients hold it in their flat buffers; a rank's chunk
  // of the two AdamW states covers up to that much less or more than Ψ/s_os.
  EXPECT_LE(std::abs(m.total() - formula), padding * 4)
      << "params " << m.params << " grads " << m.grads << " optim " << m.optim << " formula " << formula;
  EXPECT_LE(std::abs(m.params - 4.0 * psi / d.params), padding);
  EXPECT_LE(std::abs(m.grads - 4.0 * psi / d.grads), padding);
}

// The same measured where memory is allocated: the live bytes of CPU
// storage this rank holds after a step (the model, the wrapper, the
// optimizer and whatever they keep), counted by an allocator wrapped around
// LibTorch's, equal each bucket's parameter, gradient and AdamW state bytes
// at its degrees with the bucket's own padding, exactly. A full copy left
// gathered, a gradient buffer not released, a staging buffer kept, or a
// state unsharded shows up as a difference.
TEST_P(DataParallelSpecs, ModelStateBytesCountedAtTheAllocatorEqualTheFormula) {
  const Case c = GetParam();
  if (test::device().is_cuda()) GTEST_SKIP() << "counts CPU allocations";
  auto ctx = data_context();
  test::CountingScope scope;
  auto& counter = test::CountingAllocator::instance();
  const int64_t base = counter.live();
  const uint64_t mark = counter.mark();
  {
    auto model = make_net(c.net);
    auto sharded = std::make_shared<ShardedModule>(
        model, ctx, ShardedModuleOptions().bucket_bytes(256).spec(ShardingSpec::parse(c.spec)));
    ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(model->parameters(), adamw()));
    parallel_step(c.net, *sharded, opt, 0);
    parallel_step(c.net, *sharded, opt, 1);
    const auto d = sharded->degrees();
    int64_t expected = 0;
    for (size_t b = 0; b < sharded->num_buckets(); ++b) {
      // Flat parameter and gradient buffers hold the padding; AdamW's two
      // states exist for the parameters' elements in this rank's chunk only.
      const auto& bucket = sharded->bucket(b);
      const int64_t n = bucket.numel(), e = bucket.element_size();
      const int64_t begin = bucket.layout().chunk_offset(n, d.optim), length = n / d.optim;
      const int64_t used = std::max<int64_t>(0, std::min(bucket.used(), begin + length) - begin);
      expected += e * (n / d.params + n / d.grads + 2 * used);
    }
    for (const auto& buffer : model->buffers()) expected += buffer.numel() * buffer.element_size();
    // The whole-norm tables of the optimizer's pieces (sharded_optimizer.cpp):
    // a replica count and a mask for its one reduction group, a double each per parameter.
    const int64_t norm_tables = 2 * 8 * static_cast<int64_t>(model->parameters().size());
    const int64_t live = counter.live() - base;
    EXPECT_EQ(live, expected + norm_tables) << "bytes live after two steps; the bookkeeping says "
                                            << opt.memory().total()
                                            << "; live blocks (bytes x count): " << counter.live_since(mark);
    EXPECT_EQ(opt.memory().total(), expected) << "the buckets' bookkeeping";
  }
  EXPECT_EQ(counter.live(), base) << "bytes left after the model, the wrapper and the optimizer are gone";
}

// Bus bytes per rank of one step, from the tracing decorator, equal the
// analytical volume of the spec (Note [Trace byte counts]): per bucket of B
// bytes, gathers before forward and backward 2B(1 - 1/s_p) when parameters
// are sharded; gradients 2B(1 - 1/dp) all-reduced, or reduce-scattered to
// s_g, B(1 - 1/s_g), plus 2(B/s_g)(1 - s_g/dp) across replicas; the
// updated optimizer shards all-gathered to the parameter placement,
// (B/s_p)(1 - s_p/s_os).
TEST_P(DataParallelSpecs, BytesMovedEqualTheAnalyticalVolume) {
  const Case c = GetParam();
  comm::WorldOptions world_options;
  world_options.trace = std::make_shared<comm::CommTrace>();
  auto ctx = data_context(comm::make_world_communicator(world_options));
  auto model = make_net(c.net);
  auto sharded = std::make_shared<ShardedModule>(
      model, ctx, ShardedModuleOptions().bucket_bytes(256).spec(ShardingSpec::parse(c.spec)));
  ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(model->parameters(), adamw()));
  parallel_step(c.net, *sharded, opt, 0);  // warm-up; then count one step without the loss all-reduce
  world_options.trace->reset();
  opt.zero_grad();
  const int64_t rows = kGlobalBatch / sharded->group()->size();
  at::Tensor x = inputs(c.net, 1).narrow(0, 0, rows);
  at::Tensor out = c.net == Net::kConv ? sharded->forward(x) : sharded->run([&] { return forward(c.net, *model, x); });
  torch::mse_loss(out, targets(1).narrow(0, 0, rows)).backward();
  opt.step();

  const auto d = sharded->degrees();
  const double dp = sharded->group()->size();
  double expected = 0;
  for (int64_t n : sharded->bucket_numels()) {
    const double b = 4.0 * n;
    if (d.params > 1) expected += 2 * b * (1 - 1.0 / d.params);
    expected += d.grads == 1 ? 2 * b * (1 - 1 / dp)
                             : b * (1 - 1.0 / d.grads) + (d.grads < dp ? 2 * (b / d.grads) * (1 - d.grads / dp) : 0);
    expected += (b / d.params) * (1 - static_cast<double>(d.params) / d.optim);
  }
  const double measured = world_options.trace->total().bus_bytes;
  EXPECT_NEAR(measured, expected, 1e-6 * expected + 1e-9) << world_options.trace->to_string();
}

const Case kCases[] = {
    {"ddp", Net::kMLP},
    {"zero1", Net::kMLP},
    {"zero2", Net::kMLP},
    {"zero3", Net::kMLP},
    {"{P(2),S,S}", Net::kMLP},
    {"{R,P(2),S}", Net::kMLP},
    {"mics:2", Net::kMLP},
    {"{R,R,P(2)}", Net::kMLP},
    {"ddp", Net::kConv},
    {"zero1", Net::kConv},
    {"zero2", Net::kConv},
    {"zero3", Net::kConv},
    {"{P(2),S,S}", Net::kConv},
    {"{R,P(2),S}", Net::kConv},
    {"mics:2", Net::kConv},
    // k = the data ranks on each host (on one host, the whole group).
    {"hpz", Net::kMLP},
    {"mics", Net::kConv},
    // Three levels at dp 8 (1 < 2 < 4 < 8).
    {"{P(2),P(4),S}", Net::kMLP},
    {"{P(2),P(4),S}", Net::kConv},
};
INSTANTIATE_TEST_SUITE_P(Specs, DataParallelSpecs, ::testing::ValuesIn(kCases), case_name);

class DataParallelOptions : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::world()->size() % 2 != 0) GTEST_SKIP() << "P(2) needs an even data-parallel size";
  }
};

TEST_F(DataParallelOptions, MicroBatchesAccumulateWithoutCommunicationUntilTheLast) {
  for (const char* spec : {"ddp", "zero2", "zero3", "{P(2),S,S}"}) {
    SCOPED_TRACE(spec);
    expect_matches_serial(Net::kMLP, spec, ShardedModuleOptions().bucket_bytes(256), {}, /*micro=*/2);
  }
  // Nothing moves in a backward with synchronization off.
  comm::WorldOptions world_options;
  world_options.trace = std::make_shared<comm::CommTrace>();
  auto model = make_net(Net::kMLP);
  auto sharded = std::make_shared<ShardedModule>(model, data_context(comm::make_world_communicator(world_options)),
                                                 ShardedModuleOptions().spec(ShardingSpec::zero2()));
  world_options.trace->reset();
  sharded->set_gradient_sync(false);
  for (int m = 0; m < 3; ++m) {
    sharded->run([&] { return forward(Net::kMLP, *model, inputs(Net::kMLP, m)); }).sum().backward();
  }
  EXPECT_EQ(world_options.trace->total().calls, 0) << world_options.trace->to_string();
}

TEST_F(DataParallelOptions, AdamAndSGDWithMomentumGiveTheSameSteps) {
  for (const char* spec : {"ddp", "zero1", "zero3", "{R,P(2),S}"}) {
    SCOPED_TRACE(spec);
    expect_matches_serial(Net::kConv, spec, ShardedModuleOptions().bucket_bytes(256), {}, 1, Opt::kSGD);
    expect_matches_serial(Net::kMLP, spec, ShardedModuleOptions().bucket_bytes(256), {}, 1, Opt::kAdam);
  }
}

TEST_F(DataParallelOptions, UnitsPrefetchAndOverlapOffGiveTheSameSteps) {
  expect_matches_serial(Net::kConv, "zero3", ShardedModuleOptions().prefetch(false));
  expect_matches_serial(Net::kConv, "{P(2),S,S}", ShardedModuleOptions().overlap(false));
  expect_matches_serial(Net::kMLP, "zero3", ShardedModuleOptions().units({"fc1", "fc2"}));
}

TEST_F(DataParallelOptions, OffloadedOptimizerAndParametersGiveTheSameSteps) {
  const auto offload = ShardedOptimizerOptions().offload(parallel::Offload::kHost).offload_threads(2);
  expect_matches_serial(Net::kMLP, "zero2", ShardedModuleOptions(), offload);
  expect_matches_serial(Net::kConv, "zero3", ShardedModuleOptions(), offload);
  expect_matches_serial(Net::kMLP, "{R,P(2),S}", ShardedModuleOptions().offload_params(true), offload);
}

// Tiles of 64 bytes cut every parameter's piece into a tile of its own, so
// the swapper walks many tiles through 1, 2 and 3 buffers.
parallel::DiskOffloadOptions disk(int64_t tile_bytes = 64, int buffers = 3) {
  return parallel::DiskOffloadOptions().dir(::testing::TempDir()).tile_bytes(tile_bytes).buffers(buffers);
}

TEST_F(DataParallelOptions, DiskOffloadedOptimizerGivesTheSameSteps) {
  for (int buffers : {1, 2, 3}) {
    SCOPED_TRACE(buffers);
    expect_matches_serial(Net::kMLP, "zero2", ShardedModuleOptions(), ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk(64, buffers)));
  }
  expect_matches_serial(Net::kConv, "zero3", ShardedModuleOptions(), ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk(256)));
  expect_matches_serial(Net::kMLP, "{R,P(2),S}", ShardedModuleOptions().bucket_bytes(256),
                        ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk(128)), 1, Opt::kSGD);
  expect_matches_serial(Net::kConv, "ddp", ShardedModuleOptions(), ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk(1 << 20)), 1,
                        Opt::kAdam);
}

// Per-element optimizers stepped tile by tile do exactly what one step over
// every piece does; between steps no optimizer state holds memory.
TEST_F(DataParallelOptions, DiskOffloadIsBitExactAndKeepsNoStateInMemory) {
  struct Run {
    std::vector<double> losses;
    std::vector<at::Tensor> params;
    int64_t state_elements = 0;
    int64_t state_bytes_in_memory = 0;
    int64_t disk_bytes = 0;
  };
  auto run = [](ShardedOptimizerOptions options) {
    auto model = make_net(Net::kMLP);
    auto sharded =
        std::make_shared<ShardedModule>(model, data_context(), ShardedModuleOptions().spec(ShardingSpec::zero2()));
    ShardedOptimizer opt(sharded, make_optimizer(Opt::kAdamW, model->parameters()), options);
    Run r;
    for (int step = 0; step < 5; ++step) r.losses.push_back(parallel_step(Net::kMLP, *sharded, opt, step));
    {
      auto full = sharded->full_params();
      for (const auto& p : model->parameters()) r.params.push_back(p.detach().clone());
    }
    for (const auto& entry : opt.inner().state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
      r.state_elements += s.exp_avg().numel() + s.exp_avg_sq().numel();
      r.state_bytes_in_memory += static_cast<int64_t>(s.exp_avg().storage().nbytes() + s.exp_avg_sq().storage().nbytes());
    }
    r.disk_bytes = opt.disk_bytes();
    return r;
  };
  const Run plain = run({});
  const Run in_cpu_memory = run(ShardedOptimizerOptions().offload(parallel::Offload::kHost));
  const Run on_disk = run(ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk()));
  // On CUDA the offloaded steps run on the CPU and the plain one on the GPU,
  // whose AdamW rounds differently: there the two offloads are bit-exact with
  // each other and within 1e-5 of the plain run.
  const bool cuda = test::device().is_cuda();
  const Run& exact = cuda ? in_cpu_memory : plain;
  for (const Run* other : {&in_cpu_memory, &on_disk}) {
    ASSERT_EQ(other->params.size(), plain.params.size());
    if (other != &exact) EXPECT_EQ(other->losses, exact.losses);
    for (size_t i = 0; i < plain.params.size(); ++i) {
      if (other != &exact) EXPECT_TRUE(at::equal(other->params[i], exact.params[i])) << i;
      if (cuda) EXPECT_REL_CLOSE(other->params[i], plain.params[i], 1e-5) << i;
    }
  }
  EXPECT_GT(plain.state_elements, 0);
  EXPECT_EQ(on_disk.state_elements, plain.state_elements);
  EXPECT_EQ(on_disk.state_bytes_in_memory, 0);
  EXPECT_GE(on_disk.disk_bytes, on_disk.state_elements * 4);
  EXPECT_EQ(plain.disk_bytes, 0);
}

TEST_F(DataParallelOptions, DiskOffloadRefusesWhatItCannotDo) {
  auto model = make_net(Net::kMLP);
  auto sharded = std::make_shared<ShardedModule>(model, data_context(), ShardedModuleOptions().spec(ShardingSpec::zero2()));
  auto adamw_opt = [&] { return make_optimizer(Opt::kAdamW, model->parameters()); };
  EXPECT_ERROR_CONTAINS(
      ShardedOptimizer(sharded, adamw_opt(), ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk().dir("/nonexistent/offload"))),
      "directory '/nonexistent/offload' cannot be used: No such file or directory", "create it first");
  EXPECT_ERROR_CONTAINS(ShardedOptimizer(sharded, adamw_opt(), ShardedOptimizerOptions().offload(parallel::Offload::kHost).disk(disk())),
                        "are both set; choose one");
  EXPECT_ERROR_CONTAINS(ShardedOptimizer(sharded, adamw_opt(), ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk().buffers(0))),
                        "disk.buffers must be >= 1, got 0");
  // A checkpoint must bring the states in first.
  ShardedOptimizer opt(sharded, adamw_opt(), ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk()));
  parallel_step(Net::kMLP, *sharded, opt, 0);
  EXPECT_ERROR_CONTAINS(opt.piece_views(), "call fetch_offloaded() before reading");
  opt.fetch_offloaded();
  const auto views = opt.piece_views();
  ASSERT_FALSE(views.empty());
  EXPECT_GT(views[0].value.storage().nbytes(), 0u);
  opt.park_offloaded();
  parallel_step(Net::kMLP, *sharded, opt, 1);
}

// A small tmpfs shared by the ranks (or, where this process may not mount,
// a 64 KiB file size limit)
// fills up at the first step: every rank stops with an error, the ranks
// whose disk is fine name the one whose is not, and the optimizer refuses
// to go on with states it lost.
TEST_F(DataParallelOptions, DiskOffloadOnAFullDiskStopsEveryRank) {
  const auto world = test::world();
  const std::string dir = ::testing::TempDir() + "tessera_full_disk_np" + std::to_string(world->size());
  int mounted = 0;
  if (world->rank() == 0) {
    ::mkdir(dir.c_str(), 0700);
    mounted = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=384k") == 0;
  }
  at::Tensor flag = at::full({1}, mounted, at::kInt);
  world->broadcast(flag);
  mounted = flag.item<int>();
  struct rlimit old_limit {};
  ::getrlimit(RLIMIT_FSIZE, &old_limit);
  if (!mounted) {  // the same failure through the file size limit: posix_fallocate gives EFBIG
    std::cout << "[ INFO     ] cannot mount a tmpfs here; limiting the file size to 64 KiB instead\n";
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old_limit;
    small.rlim_cur = 64 << 10;
    ::setrlimit(RLIMIT_FSIZE, &small);
  }
  {
    torch::manual_seed(0);
    auto model = torch::nn::Sequential(torch::nn::Linear(256, 256));
    auto sharded =
        std::make_shared<ShardedModule>(model.ptr(), data_context(), ShardedModuleOptions().spec(ShardingSpec::zero2()));
    ShardedOptimizer opt(sharded, make_optimizer(Opt::kAdamW, model->parameters()),
                         ShardedOptimizerOptions().offload(parallel::Offload::kDisk).disk(disk(1 << 20).dir(dir)));
    auto step = [&] {
      opt.zero_grad();
      sharded->forward(test::seeded_randn({4, 256}, 1)).pow(2).mean().backward();
      opt.step();
    };
    // 257 KiB of AdamW states per rank at two ranks (514 KiB at one): the
    // 384 KiB tmpfs takes one rank's file, not two.
    const std::string error = test::error_of(step);
    EXPECT_TRUE(error.find(mounted ? "No space left on device" : "File too large") != std::string::npos ||
                error.find("disk offload failed on rank") != std::string::npos)
        << error;
    EXPECT_ERROR_CONTAINS(step(), "disk offload");
  }
  if (!mounted) ::setrlimit(RLIMIT_FSIZE, &old_limit);
  world->barrier();
  if (world->rank() == 0 && mounted) EXPECT_EQ(::umount(dir.c_str()), 0);
}

TEST_F(DataParallelOptions, FullParametersAreFreedOutsideForwardAndBackward) {
  auto model = make_net(Net::kConv);
  auto sharded =
      std::make_shared<ShardedModule>(model, data_context(), ShardedModuleOptions().spec(ShardingSpec::zero3()));
  int64_t full_bytes = 0;
  for (size_t b = 0; b < sharded->num_buckets(); ++b) full_bytes += sharded->bucket(b).numel() * 4;
  const int64_t shard_bytes = full_bytes / sharded->group()->size();
  EXPECT_EQ(sharded->memory().params, shard_bytes);
  at::Tensor out = sharded->forward(inputs(Net::kConv, 0));
  EXPECT_EQ(sharded->memory().params, shard_bytes) << "full parameters kept after forward";
  out.sum().backward();
  EXPECT_EQ(sharded->memory().params, shard_bytes) << "full parameters kept after backward";
  {
    auto full = sharded->full_params();
    EXPECT_EQ(sharded->memory().params, shard_bytes + full_bytes);
  }
  EXPECT_EQ(sharded->memory().params, shard_bytes);
}

// Note [The first bucket]: with the default 25 MiB buckets, the first
// closes once it holds 1 MiB (the last layer's bias and its 1 MiB matrix,
// in backward's order) and the rest share the second.
TEST(ShardedModuleBuckets, TheFirstBucketClosesAtOneMiB) {
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) model->push_back(torch::nn::Linear(512, 512));
  auto sharded = std::make_shared<ShardedModule>(model.ptr(), data_context(), ShardedModuleOptions());
  ASSERT_EQ(sharded->num_buckets(), 2u);
  const int64_t layer = 512 * 512 + 512;
  EXPECT_EQ(sharded->bucket(0).used(), layer) << "the last layer, bias and weight";
  EXPECT_EQ(sharded->bucket(1).used(), 3 * layer);
}

// Note [Buckets across hosts]: over a group that reduces by host the
// default buckets are a sixteenth of the gradient (32 layers of 263 KB:
// caps of 526 KB); over one host the same model keeps DDP's two.
TEST(ShardedModuleBuckets, AcrossHostsTheDefaultIsASixteenthOfTheGradient) {
  auto world = test::world();
  const int n = world->size();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "two hosts of 2 or more ranks need an even world of 4 or more";
  if (test::device().is_cuda()) GTEST_SKIP() << "the MPI backend's host tensors";
  torch::nn::Sequential model;
  for (int i = 0; i < 32; ++i) model->push_back(torch::nn::Linear(256, 256));
  const int64_t layer = 256 * 256 + 256, total = 32 * layer * 4;
  EXPECT_EQ(parallel::default_bucket_bytes(total, true), total / 16);
  EXPECT_EQ(parallel::default_bucket_bytes(total, false), int64_t(25) << 20);
  EXPECT_EQ(parallel::default_bucket_bytes(1000, true), int64_t(256) << 10) << "at least 256 KiB";
  EXPECT_EQ(parallel::default_bucket_bytes(int64_t(1) << 40, true), int64_t(25) << 20) << "at most DDP's";

  auto one_host = std::make_shared<ShardedModule>(model.ptr(), data_context(), ShardedModuleOptions());
  EXPECT_EQ(one_host->num_buckets(), 2u);
  auto hosts = comm::HierarchicalCommunicator::wrap(world, world->rank() / (n / 2), std::chrono::microseconds(0));
  auto across = std::make_shared<ShardedModule>(model.ptr(), data_context(), ShardedModuleOptions().group(hosts));
  EXPECT_GE(across->num_buckets(), 16u);
  EXPECT_LE(across->num_buckets(), 17u);
  for (size_t b = 0; b < across->num_buckets(); ++b) EXPECT_LE(across->bucket(b).used() * 4, total / 16) << b;
  // An explicit size is carried out as given.
  auto given = std::make_shared<ShardedModule>(model.ptr(), data_context(),
                                               ShardedModuleOptions().group(hosts).bucket_bytes(int64_t(25) << 20));
  EXPECT_EQ(given->num_buckets(), 2u);
}

TEST(ShardingSpec, PresetsParseAndPrint) {
  EXPECT_EQ(ShardingSpec::parse("ddp").to_string(), "{R,R,R}");
  EXPECT_EQ(ShardingSpec::parse("zero1").to_string(), "{R,R,S}");
  EXPECT_EQ(ShardingSpec::parse("zero2").to_string(), "{R,S,S}");
  EXPECT_EQ(ShardingSpec::parse("FSDP").to_string(), "{S,S,S}");
  EXPECT_EQ(ShardingSpec::parse("hsdp:4").to_string(), "{P(4),P(4),P(4)}");
  EXPECT_EQ(ShardingSpec::parse("hpz:2").to_string(), "{P(2),S,S}");
  EXPECT_EQ(ShardingSpec::parse(" { r , p2 , s } ").to_string(), "{R,P(2),S}");
  EXPECT_EQ(ShardingSpec::parse("hpz").to_string(), "{P(host),S,S}");
  EXPECT_EQ(ShardingSpec::parse("mics").to_string(), "{P(host),P(host),P(host)}");
  EXPECT_EQ(ShardingSpec::parse("hsdp:host").to_string(), "{P(host),P(host),P(host)}");
  EXPECT_EQ(ShardingSpec::parse("{R,P(host),S}").on_hosts(4).to_string(), "{R,P(4),S}");
  EXPECT_TRUE(ShardingSpec::parse("hpz").per_host());
  EXPECT_FALSE(ShardingSpec::parse("hpz").on_hosts(2).per_host());
  const auto d = ShardingSpec::parse("{P(2),P(4),S}").resolve(8);
  EXPECT_EQ(d.params, 2);
  EXPECT_EQ(d.grads, 4);
  EXPECT_EQ(d.optim, 8);
}

TEST(ShardingSpec, BrokenRulesNameTheValues) {
  EXPECT_ERROR_CONTAINS(ShardingSpec::zero3().resolve(0), "data-parallel size must be >= 1, got 0");
  EXPECT_ERROR_CONTAINS(ShardingSpec::parse("{S,R,R}").resolve(4), "{S,R,R}", "shard(params) <= shard(grads)",
                        "degrees 4, 1, 1");
  EXPECT_ERROR_CONTAINS(ShardingSpec::mics(3).resolve(4), "P(3)", "does not divide the data-parallel size 4");
  EXPECT_ERROR_CONTAINS(ShardingSpec::mics(8).resolve(4), "P(8)", "does not divide the data-parallel size 4");
  EXPECT_ERROR_CONTAINS(ShardingSpec::parse("{P(2),P(3),S}").resolve(6), "must each divide the next");
  EXPECT_ERROR_CONTAINS(ShardingSpec::parse("zero4"), "cannot read 'zero4'", "zero3");
  EXPECT_ERROR_CONTAINS(ShardingSpec::parse("{R,Q,S}"), "unknown placement 'q'");
  EXPECT_ERROR_CONTAINS(ShardingSpec::parse("mics:0"), "PartialShard(k) needs k >= 1 (or P(host)), got k = 0");
  EXPECT_ERROR_CONTAINS(ShardingSpec::parse("hpz").resolve(4), "{P(host),S,S}", "shards inside a host",
                        "ShardingSpec::on_hosts");
  EXPECT_ERROR_CONTAINS(ShardingSpec::parse("hpz").on_hosts(0), "ranks per host must be >= 1, got 0");
}

// P(host) over hand-written hosts: ranks filled host by host give k = the
// ranks of a host; hosts interleaved or uneven are refused with the hosts.
TEST(ShardingSpec, PerHostTakesTheRanksOfEachHost) {
  const ShardingSpec hpz = ShardingSpec::parse("hpz");
  context::HostMap two_by_two{{0, 0, 1, 1}, {"a", "b"}};
  EXPECT_EQ(parallel::spec_on_hosts(hpz, two_by_two, "data").to_string(), "{P(2),S,S}");
  context::HostMap one{{0, 0, 0, 0}, {"a"}};
  EXPECT_EQ(parallel::spec_on_hosts(ShardingSpec::parse("mics"), one, "data").to_string(), "{P(4),P(4),P(4)}");
  EXPECT_EQ(parallel::spec_on_hosts(ShardingSpec::zero2(), two_by_two, "data"), ShardingSpec::zero2());
  context::HostMap interleaved{{0, 1, 0, 1}, {"a", "b"}};
  EXPECT_ERROR_CONTAINS(parallel::spec_on_hosts(hpz, interleaved, "data"), "rank 1 is not on the host of its block",
                        "2 hosts: a ranks 0,2, b ranks 1,3", "launch ranks host by host");
  context::HostMap uneven{{0, 0, 0, 1}, {"a", "b"}};
  EXPECT_ERROR_CONTAINS(parallel::spec_on_hosts(hpz, uneven, "data"), "spread unevenly",
                        "2 hosts: a ranks 0-2, b ranks 3");
}

// ShardedModule resolves P(host) over the hosts its group spans: k is the
// number of ranks whose host name is this rank's (on one host, the group).
TEST(ShardingSpec, ShardedModuleShardsInsideEachHost) {
  auto ctx = data_context();
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  int on_my_host = 0;
  for (const std::string& host : comm::all_gather_strings(*test::world(), name)) on_my_host += host == name;
  auto sharded = std::make_shared<ShardedModule>(make_net(Net::kMLP), ctx,
                                                 ShardedModuleOptions().spec(ShardingSpec::parse("hpz")));
  EXPECT_EQ(sharded->degrees().params, on_my_host);
  EXPECT_EQ(sharded->degrees().grads, test::world()->size());
  EXPECT_EQ(sharded->degrees().optim, test::world()->size());
}

TEST(ShardedModuleErrors, EveryRankRejectsABadSpecOrOptimizer) {
  auto model = make_net(Net::kMLP);
  const int dp = test::world()->size();
  EXPECT_ERROR_CONTAINS(ShardedModule(model, data_context(), ShardedModuleOptions().spec(ShardingSpec::mics(dp + 1))),
                        "does not divide the data-parallel size");
  auto sharded = std::make_shared<ShardedModule>(model, data_context());
  auto stepped = std::make_shared<torch::optim::AdamW>(model->parameters(), adamw());
  sharded->run([&] { return forward(Net::kMLP, *model, inputs(Net::kMLP, 0)); }).sum().backward();
  stepped->step();
  EXPECT_ERROR_CONTAINS(ShardedOptimizer(sharded, stepped), "has already stepped");
  auto other = make_net(Net::kMLP);
  EXPECT_ERROR_CONTAINS(ShardedOptimizer(sharded, std::make_shared<torch::optim::SGD>(other->parameters(), 0.1)),
                        "is not a trainable parameter of the sharded module");
  EXPECT_ERROR_CONTAINS(sharded->forward(inputs(Net::kMLP, 0)), "needs a torch::nn::Sequential");
  EXPECT_ERROR_CONTAINS(ShardedModule(model, data_context(), ShardedModuleOptions().units({"fc9"})),
                        "unit 'fc9' is not a submodule name");
}

}  // namespace
}  // namespace tessera
