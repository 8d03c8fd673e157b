// The large-batch study (docs/large-batch.md): an MLP on Fashion-MNIST,
// data-parallel over the ranks with ZeRO-2 (ShardedModule +
// ShardedOptimizer), trained for a fixed number of epochs with AdamW, LAMB
// or LARS at a given batch size, learning rate warmed up linearly and then
// decayed (cosine for AdamW and LAMB, polynomial of power 2 for LARS, as the
// papers do). Prints one JSON object per epoch: train loss, test accuracy.
//
//   mpirun -np 2 large_batch_fmnist --data DIR --optimizer lamb --batch 8192 --lr 0.02
//       [--epochs 15] [--warmup-epochs 2] [--weight-decay 0.01] [--seed 1]
// DIR holds the uncompressed idx files (train-images-idx3-ubyte, ...);
// scripts/large-batch-study.sh prepares them from Debian's dataset-fashion-mnist.
#include <tessera/tessera.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <string>

namespace {

struct Args {
  std::string data, optimizer = "adamw";
  int64_t batch = 128, epochs = 15, seed = 1;
  double lr = 1e-3, warmup_epochs = 0, weight_decay = 0.01;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string f = argv[i];
    TORCH_CHECK(i + 1 < argc, "flag ", f,
                " needs a value; see the comment at the top of examples/large_batch_fmnist.cpp");
    const std::string v = argv[i + 1];
    if (f == "--data")
      a.data = v;
    else if (f == "--optimizer")
      a.optimizer = v;
    else if (f == "--batch")
      a.batch = std::stoll(v);
    else if (f == "--epochs")
      a.epochs = std::stoll(v);
    else if (f == "--seed")
      a.seed = std::stoll(v);
    else if (f == "--lr")
      a.lr = std::stod(v);
    else if (f == "--warmup-epochs")
      a.warmup_epochs = std::stod(v);
    else if (f == "--weight-decay")
      a.weight_decay = std::stod(v);
    else
      TORCH_CHECK(false, "unknown flag ", f, "; see the comment at the top of examples/large_batch_fmnist.cpp");
  }
  TORCH_CHECK(!a.data.empty(), "--data DIR is required (the uncompressed Fashion-MNIST idx files)");
  TORCH_CHECK(std::ifstream(a.data + "/train-images-idx3-ubyte").good(), "no file ", a.data,
              "/train-images-idx3-ubyte; run scripts/large-batch-study.sh, which prepares it");
  TORCH_CHECK(a.optimizer == "adamw" || a.optimizer == "lamb" || a.optimizer == "lars",
              "--optimizer must be adamw, lamb or lars, got '", a.optimizer, "'");
  TORCH_CHECK(a.batch >= 1 && a.epochs >= 1, "--batch and --epochs must be >= 1");
  return a;
}

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 256))),
        fc2(register_module("fc2", torch::nn::Linear(256, 256))),
        fc3(register_module("fc3", torch::nn::Linear(256, 10))) {}
  at::Tensor forward(const at::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x.view({x.size(0), 784})))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Net);

// Warm-up from 0 to the peak over `warmup` steps, then cosine (or, for LARS,
// (1 - progress)^2) down to 0 at `total`.
double lr_at(int64_t step, int64_t warmup, int64_t total, double peak, bool polynomial) {
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double p = static_cast<double>(step - warmup) / std::max<int64_t>(1, total - warmup);
  return polynomial ? peak * (1 - p) * (1 - p) : peak * 0.5 * (1 + std::cos(M_PI * p));
}

}  // namespace

int main(int argc, char** argv) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  tessera::limit_threads(1);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    const Args a = parse(argc, argv);
    auto world = tessera::comm::make_world_communicator();
    auto ctx = tessera::context::ParallelContext::create(world, tessera::context::ParallelConfig());
    const int dp = world->size();
    TORCH_CHECK(a.batch % dp == 0, "--batch ", a.batch, " must be divisible by the number of ranks ", dp);

    auto load = [&](bool train) {
      torch::data::datasets::MNIST ds(
          a.data, train ? torch::data::datasets::MNIST::Mode::kTrain : torch::data::datasets::MNIST::Mode::kTest);
      return std::make_pair((ds.images() - 0.2860) / 0.3530, ds.targets());
    };
    const auto [train_x, train_y] = load(true);
    const auto [test_x, test_y] = load(false);
    const int64_t n = train_x.size(0), steps_per_epoch = n / a.batch, total = steps_per_epoch * a.epochs;
    const int64_t warmup = static_cast<int64_t>(std::llround(a.warmup_epochs * steps_per_epoch));

    torch::manual_seed(a.seed);
    Net net;
    namespace tp = tessera::parallel;
    auto sharded =
        std::make_shared<tp::ShardedModule>(net.ptr(), ctx, tp::ShardedModuleOptions().spec(tp::ShardingSpec::zero2()));
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
    std::shared_ptr<torch::optim::Optimizer> inner;
    if (a.optimizer == "lamb") {
      inner = std::make_shared<tessera::optim::Lamb>(
          tessera::optim::param_groups(named, tessera::optim::LambOptions(a.lr).weight_decay(a.weight_decay)));
    } else if (a.optimizer == "lars") {
      inner = std::make_shared<tessera::optim::Lars>(tessera::optim::param_groups(
          named, tessera::optim::LarsOptions(a.lr).weight_decay(a.weight_decay).momentum(0.9)));
    } else {
      inner = std::make_shared<torch::optim::AdamW>(net->parameters(),
                                                    torch::optim::AdamWOptions(a.lr).weight_decay(a.weight_decay));
    }
    tp::ShardedOptimizer opt(sharded, inner);

    const auto start = std::chrono::steady_clock::now();
    int64_t step = 0;
    for (int64_t epoch = 1; epoch <= a.epochs; ++epoch) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * a.seed + epoch);
      const at::Tensor order = at::randperm(n, gen);
      double loss_sum = 0;
      const int64_t local = a.batch / dp;
      for (int64_t s = 0; s < steps_per_epoch; ++s, ++step) {
        const double lr = lr_at(step, warmup, total, a.lr, a.optimizer == "lars");
        for (auto& g : inner->param_groups()) g.options().set_lr(lr);
        const at::Tensor idx = order.narrow(0, s * a.batch + rank * local, local);
        opt.zero_grad();
        at::Tensor loss = sharded->run([&] {
          return torch::nn::functional::cross_entropy(net->forward(train_x.index_select(0, idx)),
                                                      train_y.index_select(0, idx));
        });
        loss.backward();
        opt.step();
        loss_sum += loss.item<double>();
      }
      at::Tensor stats = at::tensor({loss_sum / steps_per_epoch, 0.0}, at::kDouble);
      {
        at::NoGradGuard no_grad;
        at::Tensor pred = sharded->run([&] { return net->forward(test_x); }).argmax(1);
        stats[1] = pred.eq(test_y).to(at::kDouble).mean();
      }
      world->all_reduce(stats);
      stats /= dp;
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (rank == 0) {
        fmt::print(
            "{{\"optimizer\": \"{}\", \"batch\": {}, \"ranks\": {}, \"peak_lr\": {}, \"warmup_epochs\": {}, "
            "\"weight_decay\": {}, \"epoch\": {}, \"steps\": {}, \"train_loss\": {:.5f}, \"test_accuracy\": {:.5f}, "
            "\"seconds\": {:.1f}}}\n",
            a.optimizer, a.batch, dp, a.lr, a.warmup_epochs, a.weight_decay, epoch, step, stats[0].item<double>(),
            stats[1].item<double>(), seconds);
        std::fflush(stdout);
      }
    }
  } catch (const c10::Error& e) {
    if (rank == 0) fmt::print(stderr, "large_batch_fmnist: error: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    if (rank == 0) fmt::print(stderr, "large_batch_fmnist: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
