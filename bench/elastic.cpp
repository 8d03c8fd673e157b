// elastic: the cost of changing the data-parallel size of a running GPT
// trainer (AdamW, fp32) live, over the network (ElasticTrainer::reshape),
// against the way without it: every rank saves a checkpoint, the job is
// started again in the new layout (here: the new trainer is built) and
// loads it. For each spec and each move (--moves 2:4,4:2 by default) it
// prints one JSON object: bytes over the network and kept in place, the
// analytical bytes of the state (parameters x (4 master + 8 AdamW) bytes),
// seconds of the live move (build and exchange apart), and seconds of the
// checkpoint route (save, build, load) with its bytes on disk.
//
//   mpirun -np 4 elastic --specs zero1,zero3 --moves 2:4,4:2
//
// Every option and its default: elastic --help (docs/cli.md).
#include "bench_util.h"
#include "example_main.h"

#include <tessera/tessera.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>

namespace {

using tessera::context::ParallelConfig;

int64_t dir_bytes(const std::string& dir) {
  int64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file()) total += static_cast<int64_t>(e.file_size());
  return total;
}

struct Args {
  int64_t layers = 4, hidden = 512, heads = 8, seq = 64;
  std::string specs = "zero1,zero3", moves = "2:4,4:2", dir = "/tmp/tessera_elastic_bench";
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("elastic",
                          "changing the data-parallel size of a running GPT trainer live against through a checkpoint");
  c.group("Moves");
  c.add("specs", &a.specs, "sharding specs, comma-separated");
  c.add("moves", &a.moves, "FROM:TO data sizes, comma-separated");
  c.add("dir", &a.dir, "directory of the checkpoint route's files (removed after each move)");
  c.group("Model");
  c.add("layers", &a.layers, "GPT blocks");
  c.add("hidden", &a.hidden, "hidden size");
  c.add("heads", &a.heads, "attention heads");
  c.add("seq", &a.seq, "tokens per sequence");
  return c;
}

int run(const Args& a) {
  const int64_t layers = a.layers, hidden = a.hidden, heads = a.heads, seq = a.seq;
  const std::string& specs = a.specs;
  const std::string& moves = a.moves;
  const std::string& dir = a.dir;
  auto world = tessera::comm::make_world_communicator();
  const int rank = world->rank();
  tessera::models::GPTConfig cfg = tessera::models::GPTConfig::preset("tiny");
  cfg.vocab(256);
  cfg.context(seq);
  cfg.layers(layers);
  cfg.hidden(hidden);
  cfg.heads(heads);
  auto build = [&](const tessera::context::ParallelContextPtr& ctx) {
    torch::manual_seed(1);
    return tessera::train::gpt_train_model(
        std::make_shared<tessera::models::GPTImpl>(cfg, tessera::nn::make_layer_factory(ctx, false, true)));
  };
  auto adamw = [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
    std::vector<at::Tensor> params;
    for (const auto& p : named) params.push_back(p.second);
    return std::shared_ptr<torch::optim::Optimizer>(std::make_shared<torch::optim::AdamW>(params));
  };
  const int64_t rows = 8;
  auto step = [&](tessera::train::Trainer& t, int data) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Tensor tokens = at::randint(cfg.vocab(), {rows, seq + 1}, gen, at::kLong);
    const int64_t per = rows / data, first = t.context()->rank(tessera::context::ParallelMode::kData) * per;
    t.train_step(tokens.narrow(1, 0, seq).narrow(0, first, per), tokens.narrow(1, 1, seq).narrow(0, first, per));
  };

  size_t begin = 0;
  while (begin <= specs.size()) {
    const size_t end = std::min(specs.find(',', begin), specs.size());
    const std::string spec = specs.substr(begin, end - begin);
    begin = end + 1;
    for (const std::string& move : [&] {
           std::vector<std::string> out;
           size_t b = 0;
           while (b <= moves.size()) {
             const size_t e = std::min(moves.find(',', b), moves.size());
             out.push_back(moves.substr(b, e - b));
             b = e + 1;
           }
           return out;
         }()) {
      const size_t colon = move.find(':');
      TORCH_CHECK(colon != std::string::npos, "--moves takes FROM:TO data sizes separated by commas, got '", move,
                  "'");
      const int from = std::stoi(move.substr(0, colon)), to = std::stoi(move.substr(colon + 1));
      const auto options = tessera::train::TrainerOptions().spec(tessera::parallel::ShardingSpec::parse(spec));
      // Live.
      tessera::train::ElasticTrainer et(world, build, adamw, ParallelConfig().data(from),
                                        tessera::train::ElasticOptions().trainer(options));
      if (et.active()) step(et.trainer(), from);
      double params = 0;
      if (et.active())
        for (const auto& [name, place] : et.trainer().placements()) {
          double n = 1;
          for (int64_t d : place.full_shape) n *= static_cast<double>(d);
          params += n;
        }
      MPI_Allreduce(MPI_IN_PLACE, &params, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      const auto live = et.reshape(ParallelConfig().data(to));
      et.finish();

      // Through a checkpoint.
      double save_s = 0, build_s = 0, load_s = 0;
      int64_t disk = 0;
      {
        auto group = world->split(rank < from ? 0 : -1, rank, "from");
        double t0 = bench::now_ms();
        if (group) {
          auto ctx = tessera::context::ParallelContext::create(group, ParallelConfig().data(from));
          tessera::train::Trainer t(ctx, build(ctx), adamw, options);
          step(t, from);
          MPI_Barrier(MPI_COMM_WORLD);  // pairs with the one below
          t0 = bench::now_ms();
          t.save(dir);
        } else {
          MPI_Barrier(MPI_COMM_WORLD);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        save_s = (bench::now_ms() - t0) / 1e3;
        if (rank == 0) disk = dir_bytes(dir);
        auto next = world->split(rank < to ? 0 : -1, rank, "to");
        t0 = bench::now_ms();
        std::unique_ptr<tessera::train::Trainer> t;
        if (next) {
          auto ctx = tessera::context::ParallelContext::create(next, ParallelConfig().data(to));
          t = std::make_unique<tessera::train::Trainer>(ctx, build(ctx), adamw, options);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        build_s = (bench::now_ms() - t0) / 1e3;
        t0 = bench::now_ms();
        if (t) t->load(dir);
        MPI_Barrier(MPI_COMM_WORLD);
        load_s = (bench::now_ms() - t0) / 1e3;
      }
      if (rank == 0) {
        tessera::remove_tree(dir);
        fmt::print(
            "{{\"bench\": \"elastic\", \"spec\": \"{}\", \"from_dp\": {}, \"to_dp\": {}, \"parameters\": {:.0f}, "
            "\"state_bytes_formula\": {:.0f}, \"live_bytes_moved\": {}, \"live_bytes_kept\": {}, "
            "\"live_messages\": {}, \"live_s\": {:.4f}, \"live_build_s\": {:.4f}, \"live_exchange_s\": {:.4f}, "
            "\"checkpoint_bytes_on_disk\": {}, \"checkpoint_save_s\": {:.4f}, \"checkpoint_build_s\": {:.4f}, "
            "\"checkpoint_load_s\": {:.4f}, \"checkpoint_total_s\": {:.4f}}}\n",
            spec, from, to, params, 12 * params, live.bytes_moved, live.bytes_kept, live.messages, live.seconds,
            live.build_seconds, live.exchange_seconds, disk, save_s, build_s, load_s, save_s + build_s + load_s);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a); });
}
