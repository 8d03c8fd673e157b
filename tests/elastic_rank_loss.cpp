// A rank lost during elastic training (docs/elastic.md, "Losing a rank"):
// rank R kills itself ("kill") or stops, as a hung process would ("stop"),
// before step S of a run whose data size goes 1 -> 2 -> 4 over 4 ranks.
// elastic_rank_loss.sh checks that the job ends, within the communication
// timeout, with a message that names the lost rank or the operation it
// left waiting.
//   elastic_rank_loss kill|stop RANK STEP
#include "example_main.h"

#include <tessera/comm/factory.h>
#include <tessera/context/parallel_context.h>
#include <tessera/train/batch_schedule.h>
#include <tessera/train/elastic.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <csignal>
#include <string>

int main(int argc, char** argv) {
  return tessera_examples::run_example(argc, argv, "elastic_rank_loss", [](int argc, char** argv) {
    TORCH_CHECK(argc == 4, "usage: elastic_rank_loss kill|stop RANK STEP");
    const std::string mode = argv[1];
    const int lost = std::stoi(argv[2]);
    const int64_t at_step = std::stoll(argv[3]);
    TORCH_CHECK(mode == "kill" || mode == "stop", "unknown mode '", mode, "'");
    auto world = tessera::comm::make_world_communicator();
    TORCH_CHECK(world->size() == 4, "run on 4 ranks, got ", world->size());

    namespace tt = tessera::train;
    auto build = [](const tessera::context::ParallelContextPtr&) {
      torch::manual_seed(3);
      torch::nn::Sequential net(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
      tt::TrainModel model;
      model.layers = net;
      model.loss = [](const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); };
      return model;
    };
    auto adamw = [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
      std::vector<at::Tensor> params;
      for (const auto& p : named) params.push_back(p.second);
      return std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
    };
    const auto schedule = tt::BatchSchedule::parse("0:8,3:16,6:32");
    tt::ElasticTrainer et(world, build, adamw, tessera::context::ParallelConfig().data(1),
                          tt::ElasticOptions()
                              .trainer(tt::TrainerOptions().spec(tessera::parallel::ShardingSpec::zero2()))
                              .min_rows_per_replica(8));
    for (int64_t step = 0; step < 12; ++step) {
      if (world->rank() == lost && step == at_step) {
        fmt::print(stderr, "elastic_rank_loss: rank {} {} at step {} ({})\n", lost,
                   mode == "kill" ? "kills itself" : "stops", step, et.active() ? "active" : "idle");
        std::fflush(stderr);
        std::raise(mode == "kill" ? SIGKILL : SIGSTOP);
      }
      const int64_t batch = schedule.at(step);
      et.adapt(batch);
      if (!et.active()) continue;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(step);
      at::Tensor x = at::randn({batch, 16}, gen), y = at::randn({batch, 4}, gen);
      const auto [first, count] = et.rows_of(batch);
      et.trainer().train_step(x.narrow(0, first, count), y.narrow(0, first, count));
    }
    et.finish();
    return 0;
  });
}
