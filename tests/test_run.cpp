// The run layer of the library: the run configuration from flags and its
// rules, the token data and its windows, optimizers by name, the rows of
// the global batch, the hosts of the world, and a GPT run whose --seed
// reaches the dropout streams (two seeds: different losses; one seed: the
// same loss bit for bit, at tp 2), with the weights and the batch held equal.
#include "test_util.h"

#include "tessera/context/hosts.h"
#include "tessera/context/parallel_context.h"
#include "tessera/optim/by_name.h"
#include "tessera/optim/lamb.h"
#include "tessera/optim/lars.h"
#include "tessera/train/gpt_run.h"
#include "tessera/train/run_options.h"
#include "tessera/train/token_data.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace tessera {
namespace {

using train::RunOptions;

// RunOptions from flags, as a command reads them.
RunOptions parsed(std::vector<const char*> args) {
  RunOptions run;
  cli::Command c = train::run_command("test", "a test command", run);
  args.insert(args.begin(), "test");
  EXPECT_TRUE(c.parse(static_cast<int>(args.size()), args.data()).run);
  return run;
}

std::string temp_file(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + "run_" + std::to_string(test::world()->rank()) + "_" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

TEST(RunOptions, FlagsReachTheirFields) {
  const RunOptions r = parsed({"--seed", "7", "--tp", "2", "--tp-mode", "1d", "--dropout", "0.1", "--steps", "5",
                               "--offload", "host", "--spec", "zero2", "--optimizer", "lamb", "--capacity-factor",
                               "1.5", "--decay", "linear", "--precision", "bf16"});
  EXPECT_EQ(r.grid().seed(), 7u);  // the seed every dropout stream is drawn from
  EXPECT_EQ(r.grid().tensor(), 2);
  EXPECT_DOUBLE_EQ(r.model().dropout(), 0.1);
  EXPECT_EQ(r.offload(), parallel::Offload::kHost);
  EXPECT_EQ(r.spec().to_string(), parallel::ShardingSpec::zero2().to_string());
  EXPECT_EQ(r.optimizer(), "lamb");
  EXPECT_DOUBLE_EQ(*r.model().capacity_factor(), 1.5);
  EXPECT_EQ(r.decay(), train::LrDecay::kLinear);
  EXPECT_TRUE(r.bf16());
  EXPECT_TRUE(r.was_given("seed"));
  EXPECT_FALSE(r.was_given("batch"));
  const train::TrainerOptions t = r.trainer_options();
  EXPECT_EQ(t.offload(), parallel::Offload::kHost);
  EXPECT_EQ(t.lr().total_steps(), 5);
}

// --device and --backend: the CPU by default; a device this process lacks,
// a malformed one, or NCCL without GPU tensors refused by name.
TEST(RunOptions, DeviceAndBackend) {
  EXPECT_EQ(parsed({}).resolved_device(), c10::Device(c10::kCPU));
  EXPECT_EQ(parsed({"--backend", "mpi"}).backend(), comm::Backend::kMpi);
  EXPECT_ERROR_CONTAINS(parsed({"--device", "gpu"}).resolved_device(),
                        "--device must be cpu, cuda or cuda:N, got 'gpu'");
  EXPECT_ERROR_CONTAINS(parsed({"--backend", "nccl"}).resolved_device(), "--backend nccl needs GPU tensors");
  const int gpus = at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
  EXPECT_ERROR_CONTAINS(parsed({"--device", "cuda:99"}).resolved_device(), "--device cuda:99, but this process sees");
  if (gpus == 0) {
    EXPECT_ERROR_CONTAINS(parsed({"--device", "cuda"}).resolved_device(), "sees no CUDA device");
  } else {
    EXPECT_ERROR_CONTAINS(parsed({"--device", "cuda:x"}).resolved_device(), "cuda:N with N a GPU index, got 'cuda:x'");
    EXPECT_TRUE(parsed({"--device", "cuda"}).resolved_device().is_cuda());
    EXPECT_EQ(parsed({"--device", "cuda:0"}).resolved_device(), c10::Device(c10::kCUDA, 0));
  }
}

// Defaults that follow the run: a short run needs no warm-up flag.
TEST(RunOptions, WarmupFollowsTheSteps) {
  EXPECT_EQ(parsed({"--steps", "5"}).warmup_steps(), 0);
  EXPECT_EQ(parsed({"--steps", "100"}).warmup_steps(), 10);
  EXPECT_EQ(parsed({"--steps", "100", "--warmup", "3"}).warmup_steps(), 3);
  for (const char* steps : {"1", "5", "10", "11", "1000"}) {
    const RunOptions r = parsed({"--steps", steps});
    r.trainer_options().lr().validate();  // no extra flags needed
    r.check(test::world()->size());
  }
  EXPECT_EQ(parsed({"--pp", "3"}).pipeline_microbatches(), 6);
}

TEST(RunOptions, RulesBetweenOptions) {
  const int n = test::world()->size();
  EXPECT_ERROR_CONTAINS(parsed({"--offload", "disk"}).check(n), "--offload disk needs --offload-dir");
  EXPECT_ERROR_CONTAINS(parsed({"--offload-dir", "/tmp"}).check(n), "--offload-dir is only read with --offload disk");
  EXPECT_ERROR_CONTAINS(parsed({"--save-every", "2"}).check(n), "--save-every 2 needs --save");
  EXPECT_ERROR_CONTAINS(parsed({"--batch-schedule", "0:4", "--dp", "1"}).check(n), "the schedule chooses the data size");
  EXPECT_ERROR_CONTAINS(parsed({"--min-rows-per-replica", "2"}).check(n), "only read with --batch-schedule");
  EXPECT_ERROR_CONTAINS(parsed({"--plan", "auto", "--cluster", "a800-amsp", "--tp", "1"}).check(n),
                        "--tp with --plan auto: the planner chooses it");
  EXPECT_ERROR_CONTAINS(parsed({"--steps", "0"}).check(n), "--steps must be >= 1, got 0");
  EXPECT_ERROR_CONTAINS(parsed({"--plan", "auto", "--cluster", "a800-amsp", "--device", "cuda"}).check(n),
                        "--plan with --device cuda: the planner measures the step on this machine's CPU cores");
  RunOptions r;
  cli::Command c = train::run_command("test", "a test command", r);
  std::vector<const char*> bad = {"test", "--offload", "optimizer"};
  EXPECT_ERROR_CONTAINS(c.parse(3, bad.data()), "unknown offload 'optimizer'", "none", "host", "disk");
}

TEST(TokenData, FormatsAndWindows) {
  std::string text;
  for (int i = 0; i < 2000; ++i) text += static_cast<char>('a' + i % 26);
  const auto t = train::TokenData::load(temp_file("corpus.txt", text));
  EXPECT_EQ(t.vocab(), 256);
  EXPECT_EQ(t.size(), 2000);
  EXPECT_EQ(t.tokens()[27].item<int64_t>(), 'b');

  std::vector<uint16_t> ids16 = {1, 2, 60000, 3};
  std::vector<uint32_t> ids32 = {1, 2, 100000, 3};
  const auto u16 = train::TokenData::load(
      temp_file("ids.bin", std::string(reinterpret_cast<const char*>(ids16.data()), ids16.size() * 2)));
  EXPECT_EQ(u16.size(), 4);
  EXPECT_EQ(u16.tokens()[2].item<int64_t>(), 60000);
  EXPECT_EQ(u16.vocab(), 60001);
  const auto u32 = train::TokenData::load(
      temp_file("ids32.bin", std::string(reinterpret_cast<const char*>(ids32.data()), ids32.size() * 4)),
      train::TokenFormat::kUint32);
  EXPECT_EQ(u32.tokens()[2].item<int64_t>(), 100000);
  EXPECT_EQ(u32.vocab(), 100001);
  // llm.c's header: 256 int32 words, the first its magic.
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  std::string with_header(reinterpret_cast<const char*>(header.data()), 1024);
  with_header += std::string(reinterpret_cast<const char*>(ids16.data()), ids16.size() * 2);
  const auto llmc = train::TokenData::load(temp_file("llmc.bin", with_header));
  EXPECT_EQ(llmc.size(), 4);
  EXPECT_EQ(llmc.tokens()[0].item<int64_t>(), 1);

  EXPECT_ERROR_CONTAINS(train::TokenData::load("/nonexistent/corpus.txt"), "does not exist");
  EXPECT_ERROR_CONTAINS(train::TokenData::load(temp_file("odd.bin", "abc")), "not a whole number of 2-byte tokens");
  EXPECT_ERROR_CONTAINS(train::TokenData::load(temp_file("short.txt", "abc")), "has only 3 bytes");
  EXPECT_ERROR_CONTAINS(t.check_window(1000), "too small for sequences of 1000");
  // Metadata of the right syntax and the wrong type (found by fuzzing its sibling, the checkpoint index).
  const std::string typed = temp_file("typed.bin", std::string(reinterpret_cast<const char*>(ids16.data()), 8));
  temp_file("typed.bin.json", R"({"vocab_size": 70000, "dtype": 5})");
  EXPECT_ERROR_CONTAINS(train::TokenData::load(typed), "\"dtype\" must be a string", "got 5");

  // Windows: a seed gives the same windows, targets are the inputs shifted.
  const auto a = t.windows(train::Split::kTrain, 3, 8, 11), b = t.windows(train::Split::kTrain, 3, 8, 11);
  EXPECT_TRUE(at::equal(a.inputs, b.inputs));
  EXPECT_TRUE(at::equal(a.inputs.narrow(1, 1, 7), a.targets.narrow(1, 0, 7)));
  EXPECT_FALSE(at::equal(a.inputs, t.windows(train::Split::kTrain, 3, 8, 12).inputs));
  const auto v = t.windows(train::Split::kValidation, 50, 8, 5);
  EXPECT_GE(v.inputs.min().item<int64_t>(), 'a');  // drawn from the last tenth: still letters
  EXPECT_NE(train::window_seed(1, 3, train::Split::kTrain), train::window_seed(2, 3, train::Split::kTrain));
}

TEST(OptimizerByName, EveryNameBothWays) {
  torch::nn::Linear lin(4, 2);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : lin->named_parameters()) named.emplace_back(p.key(), p.value());
  for (const auto& name : optim::optimizer_names()) {
    auto o = optim::make_optimizer(optim::OptimizerByName().name(name).lr(0.1), named);
    EXPECT_EQ(optim::optimizer_name(*o), name);
  }
  EXPECT_NE(dynamic_cast<optim::Lamb*>(optim::make_optimizer(optim::OptimizerByName().name("lamb"), named).get()),
            nullptr);
  auto rms = torch::optim::RMSprop(lin->parameters(), torch::optim::RMSpropOptions(0.1));
  EXPECT_EQ(optim::optimizer_name(rms), "");
  EXPECT_ERROR_CONTAINS(optim::make_optimizer(optim::OptimizerByName().name("adam9"), named),
                        "unknown optimizer 'adam9'", "adamw, adam, sgd, lamb or lars");
}

// Every rank's rows tile the batch, in data-rank order (Note [Rows of the global batch]).
TEST(BatchRows, TileTheGlobalBatch) {
  auto world = test::world();
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig());
  const int64_t batch = 6 * world->size();
  const auto rows = ctx->batch_rows(batch);
  EXPECT_EQ(rows.count, 6);
  EXPECT_EQ(rows.first, 6 * ctx->rank(context::ParallelMode::kData));
  at::Tensor covered = at::zeros({batch}, at::kLong);
  covered.narrow(0, rows.first, rows.count).fill_(1);
  world->all_reduce(covered);
  EXPECT_TRUE(at::equal(covered, at::ones({batch}, at::kLong)));
  if (world->size() > 1) EXPECT_ERROR_CONTAINS(ctx->batch_rows(world->size() + 1), "must be divisible by the data-parallel size");
}

TEST(Hosts, OneHostHere) {
  auto world = test::world();
  const context::HostMap hosts = context::map_hosts(*world);
  ASSERT_EQ(static_cast<int>(hosts.host_of_rank.size()), world->size());
  EXPECT_EQ(hosts.hosts(), 1);
  EXPECT_EQ(hosts.fewest_ranks_per_host(), world->size());
}

// One training step's loss of a GPT run with `flags`, its weights set to
// `weights` first (when given), on a batch that does not depend on the seed.
double first_loss(const std::vector<const char*>& flags, std::map<std::string, at::Tensor>* weights) {
  RunOptions options = parsed(flags);
  const train::TokenData data(at::arange(64 * 40, at::kLong).remainder(61), 64, "counting");
  train::GPTRun run(test::world(), options, data.vocab());
  if (weights->empty()) {
    *weights = run.model()->full_state();
  } else {
    run.model()->load_full_state(*weights);
  }
  const int64_t batch = options.batch();
  const auto w = data.windows(train::Split::kTrain, batch, options.seq(), 99);
  const auto rows = run.rows(batch);
  return run.trainer()->train_step(w.inputs.narrow(0, rows.first, rows.count), w.targets.narrow(0, rows.first, rows.count)).loss;
}

TEST(GPTRun, SeedReachesTheDropoutStreams) {
  if (test::world()->size() != 2) GTEST_SKIP() << "at tp 2: needs 2 ranks";
  auto flags = [](const char* seed, const char* dropout) {
    return std::vector<const char*>{"--tp", "2", "--seed", seed, "--dropout", dropout, "--layers", "2", "--hidden",
                                    "32", "--heads", "2", "--seq", "16", "--batch", "4", "--sample", "0"};
  };
  std::map<std::string, at::Tensor> weights;  // seed 7's initial weights, loaded into every run
  const double a = first_loss(flags("7", "0.1"), &weights);
  const double b = first_loss(flags("7", "0.1"), &weights);
  const double c = first_loss(flags("8", "0.1"), &weights);
  EXPECT_EQ(a, b) << "the same seed must give the same loss bit for bit";
  EXPECT_NE(a, c) << "another seed must draw other dropout masks";
  // Without dropout the seed changes nothing here: the difference above is the dropout streams'.
  const double d = first_loss(flags("7", "0"), &weights);
  const double e = first_loss(flags("8", "0"), &weights);
  EXPECT_EQ(d, e);
  EXPECT_NE(a, d);
}

}  // namespace
}  // namespace tessera
