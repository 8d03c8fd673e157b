// train_fashion_mnist: large-batch training on Fashion-MNIST through
// train::Trainer: an MLP, data-parallel over the ranks with any sharding
// spec, AdamW, LAMB or LARS, learning rate warmed up linearly and then
// decayed (cosine for AdamW and LAMB, polynomial of power 2 for LARS, as the
// papers do). Prints one JSON object per epoch (train loss, test accuracy);
// scripts/large-batch-study.sh runs the study of docs/large-batch.md with it.
//
//   mpirun -np 2 train_fashion_mnist --data DIR --optimizer lamb --batch 8192 --lr 0.02
//       [--epochs 15] [--warmup-epochs 2] [--weight-decay 0.01] [--seed 1] [--spec zero2]
//       [--batch-schedule 0:512,2:1024,4:2048,6:4096,8:8192 --min-rows-per-replica 1024]
// DIR holds the uncompressed idx files (train-images-idx3-ubyte, ...);
// scripts/large-batch-study.sh prepares them from Debian's dataset-fashion-mnist.
// --batch-schedule sets the batch per epoch (the keys count the epochs done)
// and trains elastically: the data size follows the batch (the largest that
// gives each replica --min-rows-per-replica rows) and the ranks it leaves
// out sleep (docs/elastic.md); without it, every rank trains every step.
#include <tessera/tessera.h>

#include "example_main.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Args {
  std::string data, optimizer = "adamw", spec = "zero2", batch_schedule;
  int64_t batch = 128, epochs = 15, seed = 1, min_rows_per_replica = 1;
  double lr = 1e-3, warmup_epochs = 0, weight_decay = 0.01;
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("train_fashion_mnist", "large-batch training of an MLP on Fashion-MNIST through train::Trainer");
  c.add("data", &a.data, "directory of the uncompressed Fashion-MNIST idx files (required)");
  c.add("optimizer", &a.optimizer, "the optimizer", {"adamw", "lamb", "lars"});
  c.add("spec", &a.spec, "sharding spec");
  c.add("batch", &a.batch, "global batch");
  c.add("batch-schedule", &a.batch_schedule, "elastic: EPOCH:BATCH,... sets the batch from each epoch on");
  c.add("min-rows-per-replica", &a.min_rows_per_replica, "elastic: the fewest rows a data replica trains");
  c.add("epochs", &a.epochs, "passes over the training set");
  c.add("seed", &a.seed, "initial weights and data order");
  c.add("lr", &a.lr, "peak learning rate");
  c.add("warmup-epochs", &a.warmup_epochs, "linear warm-up, in epochs");
  c.add("weight-decay", &a.weight_decay, "weight decay");
  return c;
}

void check(const Args& a, const tessera::cli::Command& c) {
  TORCH_CHECK(!a.data.empty(), "--data DIR is required (the uncompressed Fashion-MNIST idx files)");
  TORCH_CHECK(std::ifstream(a.data + "/train-images-idx3-ubyte").good(), "no file ", a.data,
              "/train-images-idx3-ubyte; run scripts/large-batch-study.sh, which prepares it");
  TORCH_CHECK(a.batch_schedule.empty() || !c.given("batch"),
              "--batch and --batch-schedule both given; the schedule sets the batch of every epoch");
  TORCH_CHECK(!a.batch_schedule.empty() || !c.given("min-rows-per-replica"),
              "--min-rows-per-replica is only read with --batch-schedule");
  TORCH_CHECK(a.batch >= 1 && a.epochs >= 1 && a.min_rows_per_replica >= 1,
              "--batch, --epochs and --min-rows-per-replica must be >= 1");
}

// 784-256-256-10 with ReLU, as a Sequential so that the trainer can unit it.
// Layers are made one statement each: the order of their random
// initialisation must not depend on the compiler's argument order.
torch::nn::Sequential make_net() {
  torch::nn::Sequential net;
  net->push_back(torch::nn::Flatten());
  net->push_back(torch::nn::Linear(784, 256));
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Linear(256, 256));
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Linear(256, 10));
  return net;
}

int train(const Args& a, const tessera::cli::Command& c) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  {
    check(a, c);
    auto world = tessera::comm::make_world_communicator();
    namespace tt = tessera::train;
    const bool elastic = !a.batch_schedule.empty();
    const auto schedule = elastic ? tt::BatchSchedule::parse(a.batch_schedule) : tt::BatchSchedule::constant(a.batch);

    auto load = [&](bool train) {
      torch::data::datasets::MNIST ds(
          a.data, train ? torch::data::datasets::MNIST::Mode::kTrain : torch::data::datasets::MNIST::Mode::kTest);
      return std::make_pair((ds.images() - 0.2860) / 0.3530, ds.targets());
    };
    const auto [train_x, train_y] = load(true);
    const auto [test_x, test_y] = load(false);
    const int64_t n = train_x.size(0);
    // Steps per epoch follow the batch; the learning-rate schedule counts steps.
    std::vector<int64_t> first_step = {0};
    for (int64_t e = 0; e < a.epochs; ++e) {
      TORCH_CHECK(schedule.at(e) <= n, "a batch of ", schedule.at(e), " rows is larger than the ", n,
                  " training examples");
      first_step.push_back(first_step.back() + n / schedule.at(e));
    }
    const int64_t total = first_step.back();
    const auto whole = static_cast<int64_t>(a.warmup_epochs);
    TORCH_CHECK(whole <= a.epochs, "--warmup-epochs ", a.warmup_epochs, " is more than --epochs ", a.epochs);
    const int64_t warmup =
        first_step[whole] +
        (whole < a.epochs ? std::llround((a.warmup_epochs - whole) * (n / schedule.at(whole))) : int64_t(0));

    // The current layout's network: an elastic trainer builds one per layout.
    torch::nn::Sequential net;
    auto build = [&](const tessera::context::ParallelContextPtr&) {
      torch::manual_seed(a.seed);
      net = make_net();
      tt::TrainModel model;
      model.layers = net;
      model.loss = [](const at::Tensor& out, const at::Tensor& y) {
        return torch::nn::functional::cross_entropy(out, y);
      };
      return model;
    };
    const std::string opt = a.optimizer;
    auto make_optimizer = [&](const std::vector<std::pair<std::string, at::Tensor>>& named) {
      std::shared_ptr<torch::optim::Optimizer> o;
      if (opt == "lamb") {
        o = std::make_shared<tessera::optim::Lamb>(
            tessera::optim::param_groups(named, tessera::optim::LambOptions(a.lr).weight_decay(a.weight_decay)));
      } else if (opt == "lars") {
        o = std::make_shared<tessera::optim::Lars>(tessera::optim::param_groups(
            named, tessera::optim::LarsOptions(a.lr).weight_decay(a.weight_decay).momentum(0.9)));
      } else {
        std::vector<at::Tensor> params;
        for (const auto& p : named) params.push_back(p.second);
        o = std::make_shared<torch::optim::AdamW>(params,
                                                  torch::optim::AdamWOptions(a.lr).weight_decay(a.weight_decay));
      }
      return o;
    };
    const auto options = tt::TrainerOptions()
                             .spec(tessera::parallel::ShardingSpec::parse(a.spec))
                             .lr(tt::LrSchedule().peak(a.lr).warmup_steps(warmup).total_steps(total).decay(
                                 opt == "lars" ? tt::LrDecay::kPolynomial : tt::LrDecay::kCosine));
    std::unique_ptr<tt::Trainer> fixed;
    std::unique_ptr<tt::ElasticTrainer> el;
    const int dp = world->size();
    if (elastic) {
      el = std::make_unique<tt::ElasticTrainer>(
          world, build, make_optimizer,
          tessera::context::ParallelConfig().data(tt::data_size_for(schedule.at(0), dp, a.min_rows_per_replica)),
          tt::ElasticOptions().trainer(options).min_rows_per_replica(a.min_rows_per_replica));
    } else {
      TORCH_CHECK(a.batch % dp == 0, "--batch ", a.batch, " must be divisible by the number of ranks ", dp);
      auto ctx = tessera::context::ParallelContext::create(world, tessera::context::ParallelConfig());
      fixed = std::make_unique<tt::Trainer>(ctx, build(ctx), make_optimizer, options);
    }

    const auto start = std::chrono::steady_clock::now();
    double migration_seconds = 0;
    for (int64_t epoch = 1; epoch <= a.epochs; ++epoch) {
      const int64_t batch = schedule.at(epoch - 1), steps = n / batch;
      if (el && el->adapt(batch)) migration_seconds += el->history().back().seconds;
      tt::Trainer* trainer = el ? (el->active() ? &el->trainer() : nullptr) : fixed.get();
      if (trainer == nullptr) continue;  // idle: the next adapt() that moves the layout waits, asleep
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * a.seed + epoch);
      const at::Tensor order = at::randperm(n, gen);
      const auto [first, count] = el ? el->rows_of(batch) : fixed->context()->batch_rows(batch);
      double loss_sum = 0;
      for (int64_t s = 0; s < steps; ++s) {
        const at::Tensor idx = order.narrow(0, s * batch + first, count);
        loss_sum += trainer->train_step(train_x.index_select(0, idx), train_y.index_select(0, idx)).loss;
      }
      double accuracy = 0;
      {
        at::NoGradGuard no_grad;
        at::Tensor pred = trainer->module().run([&] { return net->forward(test_x); }).argmax(1);
        accuracy = pred.eq(test_y).to(at::kDouble).mean().item<double>();
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (rank == 0) {
        fmt::print(
            "{{\"optimizer\": \"{}\", \"batch\": {}, \"ranks\": {}, \"spec\": \"{}\", \"peak_lr\": {}, "
            "\"warmup_epochs\": {}, \"weight_decay\": {}, \"epoch\": {}, \"steps\": {}, \"train_loss\": {:.5f}, "
            "\"test_accuracy\": {:.5f}, \"seconds\": {:.1f}{}}}\n",
            a.optimizer, batch, trainer->context()->world()->size(), a.spec, a.lr, a.warmup_epochs, a.weight_decay,
            epoch, trainer->step(), loss_sum / static_cast<double>(steps), accuracy, seconds,
            el ? fmt::format(", \"batch_schedule\": \"{}\", \"min_rows_per_replica\": {}, \"migration_seconds\": {:.2f}",
                             schedule.to_string(), a.min_rows_per_replica, migration_seconds)
               : std::string());
        std::fflush(stdout);
      }
    }
    if (el) {
      el->finish();
      // How the ranks spent the run: the idle ones asleep, not spinning.
      at::Tensor idle = at::tensor({el->idle_seconds(), el->idle_cpu_seconds()}, at::kDouble);
      world->control()->all_reduce(idle);
      if (rank == 0)
        fmt::print("{{\"elastic\": {{\"moves\": {}, \"migration_seconds\": {:.2f}, \"idle_rank_seconds\": {:.1f}, "
                   "\"idle_cpu_seconds\": {:.2f}}}}}\n",
                   el->history().size(), migration_seconds, idle[0].item<double>(), idle[1].item<double>());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  return tessera_examples::run_command(argc, argv, c, [&] { return train(a, c); });
}
