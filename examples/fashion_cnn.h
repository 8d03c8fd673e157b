#pragma once
// The custom CNN that train_cnn_single (plain LibTorch, one process) and
// train_cnn (tessera, mpirun) train on Fashion-MNIST: not a Sequential, with
// BatchNorm and residual blocks. The blocks run through UnitHost::unit(),
// which is a plain call until a ShardedModule wraps the model; the stem and
// the head are outside every unit (they stay gathered under ZeRO-3).
// docs/data-parallel.md shows the two training loops side by side.
#include <tessera/core/cli.h>
#include <tessera/parallel/unit_host.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>

namespace fashion_cnn {

struct ResidualBlockImpl : torch::nn::Module {
  ResidualBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3)
                                                             .stride(stride).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(out))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(out))) {
    if (stride != 1 || in != out) {
      shortcut = register_module(
          "shortcut", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                                            torch::nn::BatchNorm2d(out)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = bn2(conv2(torch::relu(bn1(conv1(x)))));
    return torch::relu(h + (shortcut ? shortcut->forward(x) : x));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(ResidualBlock);

struct NetImpl : torch::nn::Module, tessera::parallel::UnitHost {
  explicit NetImpl(int64_t width = 8)
      : stem(register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, width, 3).padding(1).bias(false)))),
        stem_bn(register_module("stem_bn", torch::nn::BatchNorm2d(width))),
        block1(register_module("block1", ResidualBlock(width, width, 1))),
        block2(register_module("block2", ResidualBlock(width, 2 * width, 2))),
        block3(register_module("block3", ResidualBlock(2 * width, 4 * width, 2))),
        head(register_module("head", torch::nn::Linear(4 * width, 10))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(stem_bn(stem(x)));
    h = unit("block1", [&] { return block1(h); });
    h = unit("block2", [&] { return block2(h); });
    h = unit("block3", [&] { return block3(h); });
    return head(h.mean({2, 3}));
  }
  torch::nn::Conv2d stem;
  torch::nn::BatchNorm2d stem_bn;
  ResidualBlock block1, block2, block3;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

struct Args {
  std::string data, spec = "ddp";
  int64_t batch = 128, epochs = 2, seed = 1, limit = 0, width = 8;
  double lr = 0.05;
};

// The options both programs take (every one: train_cnn --help).
inline tessera::cli::Command command(Args& a, const std::string& name, const std::string& summary) {
  tessera::cli::Command c(name, summary);
  c.add("data", &a.data, "directory of the uncompressed Fashion-MNIST idx files (required)");
  c.add("epochs", &a.epochs, "passes over the training set");
  c.add("batch", &a.batch, "global batch");
  c.add("lr", &a.lr, "SGD learning rate (momentum 0.9, halved every epoch)");
  c.add("seed", &a.seed, "initial weights and data order");
  c.add("limit", &a.limit, "train on the first N images only; 0: all");
  c.add("width", &a.width, "channels of the first block");
  c.add("spec", &a.spec, "sharding spec (train_cnn)");
  return c;
}

inline void check(const Args& a) {
  TORCH_CHECK(!a.data.empty(), "--data DIR is required (the uncompressed Fashion-MNIST idx files)");
  TORCH_CHECK(a.batch >= 1 && a.epochs >= 1 && a.limit >= 0 && a.width >= 1,
              "--batch, --epochs and --width must be >= 1 and --limit >= 0");
}

// Normalized images [N, 1, 28, 28] and labels.
inline std::pair<at::Tensor, at::Tensor> load(const Args& a, bool train) {
  torch::data::datasets::MNIST ds(a.data, train ? torch::data::datasets::MNIST::Mode::kTrain
                                                : torch::data::datasets::MNIST::Mode::kTest);
  at::Tensor x = (ds.images() - 0.2860) / 0.3530, y = ds.targets();
  if (train && a.limit > 0 && a.limit < x.size(0)) return {x.narrow(0, 0, a.limit), y.narrow(0, 0, a.limit)};
  return {x, y};
}

// Test accuracy in evaluation mode (running statistics), in chunks.
inline double accuracy(Net& net, const at::Tensor& x, const at::Tensor& y) {
  at::NoGradGuard no_grad;
  net->eval();
  int64_t correct = 0;
  for (int64_t i = 0; i < x.size(0); i += 1000) {
    const int64_t n = std::min<int64_t>(1000, x.size(0) - i);
    correct += net->forward(x.narrow(0, i, n)).argmax(1).eq(y.narrow(0, i, n)).sum().item<int64_t>();
  }
  net->train();
  return static_cast<double>(correct) / static_cast<double>(x.size(0));
}

}  // namespace fashion_cnn
