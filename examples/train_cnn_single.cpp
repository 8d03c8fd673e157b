// train_cnn_single: the custom CNN of fashion_cnn.h trained on Fashion-MNIST
// in one process with plain LibTorch; train_cnn is the same program on
// tessera (docs/data-parallel.md compares the two training loops).
//
//   train_cnn_single --data DIR [--epochs 2] [--batch 128] [--lr 0.05] [--limit N]   (train_cnn_single --help)
#include "fashion_cnn.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>

namespace {

int train(const fashion_cnn::Args& a) {
  fashion_cnn::check(a);
  const auto [train_x, train_y] = fashion_cnn::load(a, true);
  const auto [test_x, test_y] = fashion_cnn::load(a, false);
  torch::manual_seed(a.seed);
  fashion_cnn::Net net(a.width);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(a.lr).momentum(0.9).weight_decay(5e-4));
  torch::optim::StepLR schedule(opt, 1, 0.5);
  const int64_t steps = train_x.size(0) / a.batch;
  const auto start = std::chrono::steady_clock::now();
  // --- training loop ---
  for (int64_t epoch = 1; epoch <= a.epochs; ++epoch) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * a.seed + epoch);
    const at::Tensor order = at::randperm(train_x.size(0), gen);
    double loss_sum = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const at::Tensor idx = order.narrow(0, s * a.batch, a.batch);
      opt.zero_grad();
      at::Tensor out = net->forward(train_x.index_select(0, idx));
      at::Tensor loss = torch::nn::functional::cross_entropy(out, train_y.index_select(0, idx));
      loss.backward();
      opt.step();
      loss_sum += loss.item<double>();
    }
    schedule.step();
    const double acc = fashion_cnn::accuracy(net, test_x, test_y);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print("{{\"epoch\": {}, \"train_loss\": {:.4f}, \"test_accuracy\": {:.4f}, \"seconds\": {:.1f}}}\n", epoch,
               loss_sum / static_cast<double>(steps), acc, seconds);
  }
  // --- end of training loop ---
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fashion_cnn::Args a;
  auto command = fashion_cnn::command(a, "train_cnn_single", "the custom CNN on Fashion-MNIST in one process, plain LibTorch");
  try {
    const auto parsed = command.parse(argc, argv);
    if (!parsed.run) {
      fmt::print("{}", parsed.text);
      return 0;
    }
    return train(a);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "train_cnn_single: error: {}\n", e.what_without_backtrace());
  }
  return 1;
}
