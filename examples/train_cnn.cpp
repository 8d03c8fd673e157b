// train_cnn: the custom CNN of fashion_cnn.h trained on Fashion-MNIST with
// tessera: data-parallel over the ranks with any sharding spec (ddp, zero2,
// zero3, ...), BatchNorm's running statistics broadcast from rank 0. The
// training loop is train_cnn_single's with a few lines changed
// (docs/data-parallel.md shows the diff).
//
//   mpirun -np 4 train_cnn --data DIR --spec zero3 [--epochs 2] [--batch 128] [--lr 0.05] [--limit N]
// --batch is the global batch: each rank takes batch / ranks rows of it.
#include "example_main.h"
#include "fashion_cnn.h"

#include <tessera/tessera.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>

namespace {

int train(const fashion_cnn::Args& a) {
  fashion_cnn::check(a);
  auto world = tessera::comm::make_world_communicator();
  auto ctx = tessera::context::ParallelContext::create(world, tessera::context::ParallelConfig());
  TORCH_CHECK(a.batch % world->size() == 0, "--batch ", a.batch, " must be divisible by the number of ranks ",
              world->size());
  const int64_t local = a.batch / world->size();
  const auto [train_x, train_y] = fashion_cnn::load(a, true);
  const auto [test_x, test_y] = fashion_cnn::load(a, false);
  torch::manual_seed(a.seed);
  fashion_cnn::Net net(a.width);
  namespace tp = tessera::parallel;
  auto sharded = std::make_shared<tp::ShardedModule>(
      net.ptr(), ctx,
      tp::ShardedModuleOptions().spec(tp::ShardingSpec::parse(a.spec)).units({"block1", "block2", "block3"}));
  tp::ShardedOptimizer opt(sharded, std::make_shared<torch::optim::SGD>(
                                        net->parameters(), torch::optim::SGDOptions(a.lr).momentum(0.9).weight_decay(5e-4)));
  torch::optim::StepLR schedule(opt, 1, 0.5);
  const int64_t steps = train_x.size(0) / a.batch;
  const auto start = std::chrono::steady_clock::now();
  // --- training loop ---
  for (int64_t epoch = 1; epoch <= a.epochs; ++epoch) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * a.seed + epoch);
    const at::Tensor order = at::randperm(train_x.size(0), gen);
    double loss_sum = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const at::Tensor idx = order.narrow(0, s * a.batch + world->rank() * local, local);
      opt.zero_grad();
      at::Tensor out = net->forward(train_x.index_select(0, idx));
      at::Tensor loss = torch::nn::functional::cross_entropy(out, train_y.index_select(0, idx));
      loss.backward();
      opt.step();
      loss_sum += sharded->global_mean(loss);
    }
    schedule.step();
    const double acc = fashion_cnn::accuracy(net, test_x, test_y);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (world->rank() == 0)
      fmt::print("{{\"epoch\": {}, \"train_loss\": {:.4f}, \"test_accuracy\": {:.4f}, \"seconds\": {:.1f}}}\n", epoch,
                 loss_sum / static_cast<double>(steps), acc, seconds);
  }
  // --- end of training loop ---
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fashion_cnn::Args a;
  auto command = fashion_cnn::command(a, "train_cnn", "the custom CNN on Fashion-MNIST, data-parallel with any sharding spec");
  return tessera_examples::run_command(argc, argv, command, [&] { return train(a); });
}
