// A user's own module (not a Sequential: residual blocks, BatchNorm, a stem
// and a head outside every unit) wrapped by ShardedModule, against a plain
// LibTorch model written separately and trained on the whole batch:
// units by name through UnitHost, SyncBatchNorm, buffers, the errors a user
// meets, ShardedOptimizer as a torch::optim::Optimizer under a LibTorch
// learning-rate scheduler.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/context/parallel_context.h"
#include "tessera/nn/sync_batch_norm.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/unit_host.h"
#include "tessera/train/state_pieces.h"

#include <gtest/gtest.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/torch.h>

namespace tessera {
namespace {

using parallel::ShardedModule;
using parallel::ShardedModuleOptions;
using parallel::ShardedOptimizer;
using parallel::ShardingSpec;

constexpr int64_t kBatch = 12;  // divides every data size tested (1, 2, 3, 4)
constexpr double kTolerance = 1e-5;

context::ParallelContextPtr data_context() {
  return context::ParallelContext::create(test::world(), context::ParallelConfig());
}
int rank() { return test::world()->rank(); }
int ranks() { return test::world()->size(); }

at::Tensor images(int step) { return test::device_randn({kBatch, 3, 6, 6}, 300 + step); }
at::Tensor targets(int step) { return test::device_randn({kBatch, 4}, 400 + step); }
at::Tensor my_rows(const at::Tensor& t) {
  const int64_t rows = t.size(0) / ranks();
  return t.narrow(0, rank() * rows, rows);
}

// The serial model: plain LibTorch, BatchNorm over the whole batch.
struct SerialBlockImpl : torch::nn::Module {
  SerialBlockImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(5, 5, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(5))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::relu(x + bn(conv(x))); }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
};
TORCH_MODULE(SerialBlock);

struct SerialNetImpl : torch::nn::Module {
  SerialNetImpl()
      : stem(register_module("stem", torch::nn::Conv2d(3, 5, 1))),
        stem_bn(register_module("stem_bn", torch::nn::BatchNorm2d(5))),
        block1(register_module("block1", SerialBlock())),
        block2(register_module("block2", SerialBlock())),
        head(register_module("head", torch::nn::Linear(5, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(stem_bn(stem(x)));
    h = block2(block1(h));
    return head(h.mean({2, 3}));
  }
  torch::nn::Conv2d stem;
  torch::nn::BatchNorm2d stem_bn;
  SerialBlock block1, block2;
  torch::nn::Linear head;
};
TORCH_MODULE(SerialNet);

// The same network as a user writes it for tessera: SyncBatchNorm over the
// data group, and the blocks run as units through UnitHost.
nn::SyncBatchNorm sync_bn(int64_t c, const comm::CommunicatorPtr& group) {
  return nn::SyncBatchNorm(nn::SyncBatchNormOptions(c).group(group));
}

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const comm::CommunicatorPtr& group)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(5, 5, 3).padding(1)))),
        bn(register_module("bn", sync_bn(5, group))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::relu(x + bn(conv(x))); }
  torch::nn::Conv2d conv;
  nn::SyncBatchNorm bn;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module, parallel::UnitHost {
  explicit NetImpl(const comm::CommunicatorPtr& group)
      : stem(register_module("stem", torch::nn::Conv2d(3, 5, 1))),
        stem_bn(register_module("stem_bn", sync_bn(5, group))),
        block1(register_module("block1", Block(group))),
        block2(register_module("block2", Block(group))),
        head(register_module("head", torch::nn::Linear(5, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(stem_bn(stem(x)));  // the root unit
    h = unit("block1", [&] { return block1(h); });
    h = unit("block2", [&] { return block2(h); });
    return head(h.mean({2, 3}));
  }
  torch::nn::Conv2d stem;
  nn::SyncBatchNorm stem_bn;
  Block block1, block2;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

void copy_state(torch::nn::Module& from, torch::nn::Module& to) {
  at::NoGradGuard no_grad;
  auto dst = to.named_parameters();
  for (const auto& p : from.named_parameters()) dst[p.key()].copy_(p.value());
  auto dst_buffers = to.named_buffers();
  for (const auto& b : from.named_buffers()) dst_buffers[b.key()].copy_(b.value());
}

std::shared_ptr<torch::optim::Optimizer> sgd(const std::vector<at::Tensor>& params) {
  return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

class CustomModule : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!test::spec_fits(GetParam(), ranks())) GTEST_SKIP() << GetParam() << " has a sub-group that does not divide " << ranks();
  }
};

// Four steps of SGD with momentum, a StepLR halving the learning rate after
// each: losses, weights and running statistics equal the serial model's.
TEST_P(CustomModule, TrainsLikeTheSerialModelWithSchedulerAndSyncBatchNorm) {
  torch::manual_seed(0);
  SerialNet serial;
  serial->to(test::device());
  auto serial_opt = sgd(serial->parameters());
  torch::optim::StepLR serial_lr(*serial_opt, 1, 0.5);

  auto ctx = data_context();
  Net net(ctx->comm(context::ParallelMode::kData));
  net->to(test::device());
  copy_state(*serial, *net);
  auto sharded = std::make_shared<ShardedModule>(
      net.ptr(), ctx, ShardedModuleOptions().spec(ShardingSpec::parse(GetParam())).units({"block1", "block2"}));
  EXPECT_EQ(sharded->units(), (std::vector<std::string>{"block1", "block2"}));
  ShardedOptimizer opt(sharded, sgd(net->parameters()));
  torch::optim::StepLR lr(opt, 1, 0.5);  // a LibTorch scheduler on the sharded optimizer

  for (int step = 0; step < 4; ++step) {
    serial_opt->zero_grad();
    at::Tensor serial_loss = torch::mse_loss(serial->forward(images(step)), targets(step));
    serial_loss.backward();
    const double rate = serial_opt->param_groups()[0].options().get_lr();
    serial_opt->step();
    serial_lr.step();

    opt.zero_grad();
    at::Tensor loss = torch::mse_loss(net->forward(my_rows(images(step))), my_rows(targets(step)));
    loss.backward();
    opt.step();
    EXPECT_DOUBLE_EQ(opt.inner().param_groups()[0].options().get_lr(), rate)
        << "the scheduler's rate did not reach the inner optimizer at step " << step;
    lr.step();
    EXPECT_NEAR(sharded->global_mean(loss), serial_loss.item<double>(), kTolerance * serial_loss.item<double>())
        << "step " << step;
  }
  auto full = sharded->full_params();
  auto serial_params = serial->named_parameters();
  for (const auto& p : net->named_parameters())
    EXPECT_LE(test::rel_error(p.value().detach(), serial_params[p.key()]), kTolerance) << p.key();
  auto serial_buffers = serial->named_buffers();
  for (const auto& b : net->named_buffers()) {
    if (b.value().is_floating_point()) {
      EXPECT_LE(test::rel_error(b.value(), serial_buffers[b.key()]), kTolerance) << b.key();
    } else {
      EXPECT_TRUE(b.value().equal(serial_buffers[b.key()])) << b.key();
    }
  }
}

// Two steps, a checkpoint (parameters, momentum, running statistics),
// two more steps; a differently initialised net that loads the checkpoint
// then takes the same two steps bit for bit: losses, parameters, buffers.
TEST_P(CustomModule, CheckpointWithBuffersResumesBitExactly) {
  // Bit for bit needs deterministic convolution backward kernels on CUDA.
  if (test::device().is_cuda()) at::globalContext().setDeterministicCuDNN(true);
  auto ctx = data_context();
  const auto data = ctx->comm(context::ParallelMode::kData);
  struct Run {
    Net net;
    std::shared_ptr<ShardedModule> sharded;
    std::unique_ptr<ShardedOptimizer> opt;
  };
  auto make = [&](uint64_t seed) {
    torch::manual_seed(seed);
    Run r{Net(data), nullptr, nullptr};
    r.net->to(test::device());
    r.sharded = std::make_shared<ShardedModule>(
        r.net.ptr(), ctx, ShardedModuleOptions().spec(ShardingSpec::parse(GetParam())).units({"block1", "block2"}));
    r.opt = std::make_unique<ShardedOptimizer>(r.sharded, sgd(r.net->parameters()));
    return r;
  };
  auto step = [&](Run& r, int i) {
    r.opt->zero_grad();
    at::Tensor loss = torch::mse_loss(r.net->forward(my_rows(images(i))), my_rows(targets(i)));
    loss.backward();
    r.opt->step();
    return loss.item<double>();
  };
  std::string dir = "custom_module_checkpoint_" + GetParam() + "_" + std::to_string(ranks());
  for (char& c : dir)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';

  Run first = make(0);
  for (int i = 0; i < 2; ++i) step(first, i);
  auto pieces = train::optimizer_pieces(*first.opt, train::named_placements(*first.net));
  for (auto& b : train::buffer_pieces(*first.net, data->rank() == 0)) pieces.push_back(std::move(b));
  train::save_checkpoint(dir, pieces, "{}", test::world());
  std::vector<double> losses;
  for (int i = 2; i < 4; ++i) losses.push_back(step(first, i));

  Run resumed = make(1);
  const infer::CheckpointReader reader(dir);
  train::load_optimizer_pieces(reader, *resumed.opt, train::named_placements(*resumed.net));
  train::load_buffer_pieces(reader, *resumed.net);
  for (int i = 2; i < 4; ++i) EXPECT_EQ(step(resumed, i), losses[i - 2]) << "step " << i;
  const auto first_full = first.sharded->full_params();
  const auto resumed_full = resumed.sharded->full_params();
  auto expected = first.net->named_parameters();
  for (const auto& p : resumed.net->named_parameters())
    EXPECT_TRUE(p.value().equal(expected[p.key()])) << p.key();
  auto expected_buffers = first.net->named_buffers();
  for (const auto& b : resumed.net->named_buffers())
    EXPECT_TRUE(b.value().equal(expected_buffers[b.key()])) << b.key();

  // A checkpoint without buffers is refused with the buffer named.
  const std::string bare = dir + "_bare";
  train::save_checkpoint(bare, train::optimizer_pieces(*first.opt, train::named_placements(*first.net)), "{}",
                         test::world());
  EXPECT_ERROR_CONTAINS(train::load_buffer_pieces(infer::CheckpointReader(bare), *resumed.net),
                        "has no buffer 'stem_bn.running_mean'");
}

INSTANTIATE_TEST_SUITE_P(Specs, CustomModule, ::testing::Values("ddp", "zero2", "zero3", "{P(2),S,S}"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

// With broadcast_buffers, every rank ends with rank 0's running statistics,
// which are rank 0's own updates from its rows; without it, they differ.
TEST(Buffers, BroadcastBuffersLeavesRankZerosStatisticsEverywhere) {
  for (bool broadcast : {true, false}) {
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Conv2d(3, 4, 1), torch::nn::BatchNorm2d(4), torch::nn::Flatten(),
                                torch::nn::Linear(4 * 36, 4));
    model->to(test::device());
    torch::manual_seed(0);
    torch::nn::BatchNorm2d rank0_bn(4);  // rank 0's statistics, updated from its rows alone
    rank0_bn->to(test::device());
    torch::nn::Conv2d rank0_conv(3, 4, 1);
    rank0_conv->to(test::device());
    copy_state(*model[0], *rank0_conv);
    auto sharded = std::make_shared<ShardedModule>(
        model.ptr(), data_context(), ShardedModuleOptions().spec(ShardingSpec::zero3()).broadcast_buffers(broadcast));
    ShardedOptimizer opt(sharded, sgd(model->parameters()));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      // Rows differ per rank, so local statistics differ.
      at::Tensor x = my_rows(images(step));
      {
        at::NoGradGuard no_grad;
        auto full = sharded->full_params();
        const int64_t rows = kBatch / ranks();
        rank0_conv->weight.copy_(model[0]->named_parameters()["weight"]);
        rank0_conv->bias.copy_(model[0]->named_parameters()["bias"]);
        rank0_bn(rank0_conv(images(step).narrow(0, 0, rows)));
      }
      torch::mse_loss(sharded->forward(x), my_rows(targets(step))).backward();
      opt.step();
    }
    at::Tensor mine = model[1]->named_buffers()["running_mean"].clone();
    at::Tensor all = at::empty({ranks(), 4}, test::device_options());
    test::world()->all_gather(all, mine);
    if (broadcast || ranks() == 1) {
      for (int r = 0; r < ranks(); ++r) EXPECT_TRUE(all[r].equal(all[0])) << "rank " << r;
      EXPECT_LE(test::rel_error(mine, rank0_bn->running_mean), 1e-6);
      EXPECT_LE(test::rel_error(model[1]->named_buffers()["running_var"], rank0_bn->running_var), 1e-6);
    } else {
      EXPECT_FALSE(all[1].equal(all[0])) << "the test's ranks see the same rows: it cannot tell";
      sharded->broadcast_buffers();  // on demand
      EXPECT_TRUE(model[1]->named_buffers()["running_mean"].equal(all[0]));
    }
  }
}

// SyncBatchNorm alone, uneven rows per rank, 2-D and 3-D inputs: outputs,
// input gradients, parameter gradients summed over ranks, running statistics
// and evaluation against LibTorch's BatchNorm on the whole batch.
TEST(SyncBatchNorm, EqualsBatchNormOnTheWholeBatch) {
  for (int64_t dims : {2, 4}) {
    const int64_t batch = 2 * ranks() + 3;
    std::vector<int64_t> shape{batch, 3};
    if (dims == 4) shape.insert(shape.end(), {4, 5});
    torch::manual_seed(1);
    torch::nn::BatchNorm1d serial1(torch::nn::BatchNormOptions(3));
    serial1->to(test::device());
    torch::nn::BatchNorm2d serial2(torch::nn::BatchNormOptions(3));
    serial2->to(test::device());
    torch::nn::Module& serial = dims == 2 ? static_cast<torch::nn::Module&>(*serial1) : *serial2;
    {
      at::NoGradGuard no_grad;
      serial.named_parameters()["weight"].copy_(test::device_randn({3}, 7));
      serial.named_parameters()["bias"].copy_(test::device_randn({3}, 8));
    }
    nn::SyncBatchNorm bn(nn::SyncBatchNormOptions(3).group(test::world()));
    bn->to(test::device());
    copy_state(serial, *bn);
    // Rank r holds rows [begin, end): 2 each, and the 3 left over on rank 0.
    const int64_t begin = rank() == 0 ? 0 : 3 + 2 * rank(), end = 2 * rank() + 5;
    auto run_serial = [&](const at::Tensor& x) { return dims == 2 ? serial1(x) : serial2(x); };
    for (int step = 0; step < 2; ++step) {
      at::Tensor x = test::device_randn(shape, 50 + step).mul_(3).add_(1).requires_grad_(true);
      at::Tensor g = test::device_randn(shape, 60 + step);
      at::Tensor expected = run_serial(x);
      (expected * g).sum().backward();
      at::Tensor mine = x.detach().narrow(0, begin, end - begin).requires_grad_(true);
      at::Tensor out = bn(mine);
      (out * g.narrow(0, begin, end - begin)).sum().backward();
      EXPECT_LE(test::rel_error(out.detach(), expected.detach().narrow(0, begin, end - begin)), kTolerance);
      EXPECT_LE(test::rel_error(mine.grad(), x.grad().narrow(0, begin, end - begin)), kTolerance);
      for (const char* name : {"weight", "bias"}) {
        at::Tensor grad = bn->named_parameters()[name].grad().clone();
        test::world()->all_reduce(grad);
        EXPECT_LE(test::rel_error(grad, serial.named_parameters()[name].grad()), kTolerance) << name;
      }
      bn->zero_grad();
      serial.zero_grad();
    }
    for (const char* name : {"running_mean", "running_var"})
      EXPECT_LE(test::rel_error(bn->named_buffers()[name], serial.named_buffers()[name]), kTolerance) << name;
    bn->eval();
    serial.eval();
    at::Tensor x = test::device_randn(shape, 70);
    EXPECT_LE(test::rel_error(bn(x), run_serial(x)), kTolerance) << "evaluation";
    EXPECT_ERROR_CONTAINS(bn(test::device_randn({2, 5}, 1)), "expects input [N, 3, *]");
  }
}

// A unit that uses another unit's parameter: the error names the parameter,
// the unit it ran in and the rule, on every rank.
struct TiedImpl : torch::nn::Module, parallel::UnitHost {
  TiedImpl() : a(register_module("a", torch::nn::Linear(4, 4))), b(register_module("b", torch::nn::Linear(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = unit("a", [&] { return torch::nn::functional::linear(a(x), b->weight); });
    return unit("b", [&] { return b(h); });
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Tied);

TEST(UnitErrors, AParameterUsedOutsideItsUnitIsNamed) {
  Tied model;
  model->to(test::device());
  EXPECT_EQ(model->forward(at::ones({2, 4}, test::device_options())).size(1), 4) << "unwrapped, unit() runs fn";
  // At one rank nothing is sharded: offloaded parameter shards are gathered per unit too.
  auto options = ShardedModuleOptions().units({"a", "b"});
  if (ranks() == 1)
    options.offload_params(true);
  else
    options.spec(ShardingSpec::zero3());
  auto sharded = std::make_shared<ShardedModule>(model.ptr(), data_context(), options);
  EXPECT_EQ(model->sharded(), sharded.get());
  EXPECT_ERROR_CONTAINS(model->forward(at::ones({2, 4}, test::device_options())),
                        "parameter 'b.weight' (unit 'b') was used inside run_unit('a')",
                        "a unit's parameters exist only while that unit runs");
  EXPECT_ERROR_CONTAINS(sharded->run_unit("c", [] { return at::Tensor(); }), "'c' is not a unit of this module",
                        "its units are 'a', 'b'");
  EXPECT_ERROR_CONTAINS(ShardedModule(model.ptr(), data_context()), "already wrapped by another ShardedModule");
  sharded.reset();
  EXPECT_EQ(model->sharded(), nullptr) << "the wrapper's destructor detaches it";
}

// The root unit (the stem, outside every unit) stays gathered: a forward
// right after a backward, with no step between, may use it.
struct RootedImpl : torch::nn::Module, parallel::UnitHost {
  RootedImpl() : stem(register_module("stem", torch::nn::Linear(4, 4))), a(register_module("a", torch::nn::Linear(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = stem(x);
    return unit("a", [&] { return a(h); });
  }
  torch::nn::Linear stem, a;
};
TORCH_MODULE(Rooted);

TEST(UnitErrors, TheRootUnitStaysGatheredBetweenBackwardAndForward) {
  Rooted model;
  model->to(test::device());
  const at::Tensor expected = model->forward(at::ones({2, 4}, test::device_options())).detach();
  auto options = ShardedModuleOptions().units({"a"});
  if (ranks() == 1)
    options.offload_params(true);
  else
    options.spec(ShardingSpec::zero3());
  auto sharded = std::make_shared<ShardedModule>(model.ptr(), data_context(), options);
  model->forward(at::ones({2, 4}, test::device_options())).sum().backward();
  at::Tensor again;
  EXPECT_NO_THROW(again = model->forward(at::ones({2, 4}, test::device_options())));
  if (again.defined()) EXPECT_TRUE(again.detach().equal(expected));
}

TEST(ShardedOptimizerAsOptimizer, StepsThroughTheBaseAndRefusesLibTorchArchives) {
  torch::manual_seed(0);
  torch::nn::Linear model(3, 2);
  model->to(test::device());
  auto sharded = std::make_shared<ShardedModule>(model.ptr(), data_context());
  ShardedOptimizer sharded_opt(sharded, sgd(model->parameters()));
  torch::optim::Optimizer& opt = sharded_opt;
  at::Tensor before = model->weight.detach().clone();
  at::Tensor loss = opt.step([&] {
    sharded_opt.zero_grad();
    at::Tensor l = model(at::ones({2, 3}, test::device_options())).pow(2).mean();
    l.backward();
    return l;
  });
  EXPECT_TRUE(loss.defined()) << "the closure's loss is returned";
  EXPECT_FALSE(model->weight.detach().equal(before)) << "step() through torch::optim::Optimizer& did not step";
  // Setting the inner optimizer's rate directly still works (the side set last wins).
  sharded_opt.inner().param_groups()[0].options().set_lr(0.01);
  opt.step();
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 0.01);
  torch::serialize::OutputArchive archive;
  EXPECT_ERROR_CONTAINS(opt.save(archive), "train::Trainer::save");
}

TEST(GlobalMean, IsTheMeanOverTheDataRanks) {
  torch::nn::Linear model(2, 2);
  model->to(test::device());
  ShardedModule sharded(model.ptr(), data_context());
  const at::Tensor mine = at::tensor(static_cast<double>(rank() + 1)).to(test::device());
  EXPECT_DOUBLE_EQ(sharded.global_mean(mine), (ranks() + 1) / 2.0);
  EXPECT_ERROR_CONTAINS(sharded.global_mean(at::ones({2}, test::device_options())), "needs a one-element tensor");
}

}  // namespace
}  // namespace tessera
