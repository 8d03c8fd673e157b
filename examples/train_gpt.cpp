// train_gpt: a GPT trained with every kind of parallelism tessera has, on a
// real text corpus, byte-level by default (docs/train-gpt.md).
//
//   mpirun -np 8 train_gpt --dp 2 --pp 2 --tp 2 --spec zero2 --steps 200
//   mpirun -np 4 train_gpt --config run.json          (the same keys as the flags, without "--")
//   mpirun -np 2 train_gpt --data my.txt | --data tokens.bin (nanoGPT/llm.c uint16 tokens)
//
// Without --data it trains on Debian's `fortunes` corpus. Rank 0 prints a
// line per step and writes --metrics (JSONL; scripts/plot_metrics.py plots
// it); --save DIR writes checkpoints, --resume DIR continues from one (in
// any parallel configuration), --consolidate FILE writes the final weights
// as one safetensors file, and the run ends with text sampled from the model.
// --offload optimizer keeps optimizer states in CPU memory, --offload
// optimizer:disk --offload-dir DIR on a local disk (docs/offload.md).
// --batch-schedule 0:8,50:16,100:32 [--min-rows-per-replica 4] trains
// elastically: the global batch changes at those steps and the data size
// follows it, the trainer moving its state between layouts over the network
// while the ranks it does not use sleep (docs/elastic.md).
// --plan auto --comm-bench FILE [--memory-gb X] [--overlap F] lets the planner
// choose the layout, sharding, micro-batches and checkpointing for this GPT
// on these ranks from this machine's measured rates, printing its choice,
// the next best and why; --plan flags predicts the layout the flags give.
// Either way the run ends with the measured step time beside the predicted
// one (docs/planner.md).
#include <tessera/models/gpt.h>
#include <tessera/nn/layer_factory.h>
#include <tessera/tessera.h>

#include "example_main.h"
#include "gpt_plan.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using tessera::context::ParallelMode;

// Every option with its default; flags and --config override them.
Json defaults() {
  return {{"dp", 0},
          {"pp", 1},
          {"tp", 1},
          {"tp_mode", "1d"},
          {"tp_depth", 1},
          {"sp", 1},
          {"sp_mode", "ulysses"},
          {"sp_split", "contiguous"},
          {"ep", 1},
          {"order", "tp-sp-dp-pp"},
          {"sequence_parallel", false},
          {"spec", "ddp"},
          {"schedule", "1f1b"},
          {"microbatches", 0},
          {"chunks", 1},
          {"precision", "fp32"},
          {"optimizer", "adamw"},
          {"lr", 3e-3},
          {"min_lr_ratio", 0.1},
          {"warmup", 10},
          {"decay", "cosine"},
          {"weight_decay", 0.1},
          {"clip", 1.0},
          {"steps", 100},
          {"batch", 16},
          {"seq", 64},
          {"layers", 4},
          {"heads", 4},
          {"hidden", 128},
          {"dropout", 0.0},
          {"accumulation", 1},
          {"checkpoint_activations", false},
          {"offload", "none"},
          {"offload_dir", ""},
          {"experts", 0},
          {"top_k", 1},
          {"moe_every", 1},
          {"capacity_factor", "dropless"},
          {"drop_policy", "position"},
          {"aux_loss_coef", 1e-2},
          {"z_loss_coef", 1e-3},
          {"data", ""},
          {"save", ""},
          {"save_every", 0},
          {"resume", ""},
          {"metrics", ""},
          {"consolidate", ""},
          {"sample", 200},
          {"eval_every", 25},
          {"log_every", 1},
          {"batch_schedule", ""},
          {"min_rows_per_replica", 1},
          {"plan", ""},
          {"cluster", ""},
          {"comm_bench", ""},
          {"memory_gb", 0.0},
          {"overlap", 0.0},
          {"plan_top", 5},
          {"seed", 1}};
}

// Flags (--name value; --flag alone for booleans), after --config FILE.
Json parse_args(int argc, char** argv) {
  Json args = defaults();
  Json given = Json::array();  // the keys the user set, so that a default is not mistaken for a choice
  auto set = [&](const std::string& key, const Json& value) {
    TORCH_CHECK(args.contains(key), "unknown option '", key, "'; see the comment at the top of examples/train_gpt.cpp");
    given.push_back(key);
    const Json& d = args[key];
    if (d.is_boolean()) {
      TORCH_CHECK(value.is_boolean() || value.is_string(), "option '", key, "' takes true or false");
      args[key] = value.is_boolean() ? value.get<bool>() : value.get<std::string>() != "false";
    } else if (d.is_number()) {
      double v = 0;
      try {
        v = value.is_number() ? value.get<double>() : std::stod(value.get<std::string>());
      } catch (const std::exception&) {
        TORCH_CHECK(false, "option '", key, "' takes a number, got ", value.dump());
      }
      args[key] = d.is_number_integer() ? Json(static_cast<int64_t>(v)) : Json(v);
    } else {
      args[key] = value.is_string() ? value.get<std::string>() : value.dump();
    }
  };
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    TORCH_CHECK(flag.rfind("--", 0) == 0, "expected a flag, got '", flag, "'");
    std::string key = flag.substr(2);
    std::replace(key.begin(), key.end(), '-', '_');
    if (key == "config") {
      TORCH_CHECK(i + 1 < argc, "--config needs a file");
      std::ifstream in(argv[++i]);
      TORCH_CHECK(in.good(), "--config: cannot read ", argv[i]);
      Json file;
      try {
        file = Json::parse(in);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "--config ", argv[i], " is not valid JSON: ", e.what());
      }
      for (auto it = file.begin(); it != file.end(); ++it) set(it.key(), it.value());
      continue;
    }
    TORCH_CHECK(args.contains(key), "unknown flag ", flag, "; see the comment at the top of examples/train_gpt.cpp");
    if (args[key].is_boolean() && (i + 1 == argc || std::string(argv[i + 1]).rfind("--", 0) == 0)) {
      args[key] = true;
      given.push_back(key);
      continue;
    }
    TORCH_CHECK(i + 1 < argc, "flag ", flag, " needs a value");
    set(key, Json(std::string(argv[++i])));
  }
  args["given"] = given;
  return args;
}

bool was_given(const Json& args, const std::string& key) {
  const auto& g = args["given"];
  return std::find(g.begin(), g.end(), Json(key)) != g.end();
}

// The grid's dimensions go through the library's one flag parser
// (context::config_from_args), whichever way they were given here.
tessera::context::ParallelConfig parallel_config(const Json& a) {
  std::vector<std::string> words = {"train_gpt"};
  for (const char* key : {"dp", "pp", "tp", "tp_mode", "tp_depth", "sp", "sp_mode", "sp_split", "ep", "order"}) {
    std::string flag = std::string("--") + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    words.push_back(flag);
    words.push_back(a[key].is_string() ? a[key].get<std::string>() : a[key].dump());
  }
  std::vector<const char*> argv;
  for (const auto& w : words) argv.push_back(w.c_str());
  return tessera::context::config_from_args(static_cast<int>(argv.size()), argv.data());
}

// Load balance of the last step's MoE layers: the largest number of
// assignments routed to one expert over the mean (1: perfect balance), worst
// layer; and, averaged over layers, the auxiliary loss and the assignments
// dropped over capacity. A layer's statistics are global already, but each
// pipeline stage holds its own layers: sums over the world divided by the
// number of (rank, layer) pairs count every layer's replicas alike.
struct MoEBalance {
  double max_over_mean = 0, aux_loss = 0, dropped = 0;
};

MoEBalance moe_balance(const tessera::models::GPTImpl& gpt, tessera::comm::Communicator& world) {
  MoEBalance b;
  if (gpt.config().experts == 0) return b;
  double layers = 0;
  for (const auto& s : gpt.moe_stats()) {
    if (s.tokens_per_expert.empty()) continue;  // a block of another pipeline stage
    double total = 0, most = 0;
    for (int64_t t : s.tokens_per_expert) {
      total += static_cast<double>(t);
      most = std::max(most, static_cast<double>(t));
    }
    const double mean = total / static_cast<double>(s.tokens_per_expert.size());
    b.max_over_mean = std::max(b.max_over_mean, mean > 0 ? most / mean : 0.0);
    b.aux_loss += s.aux_loss;
    b.dropped += static_cast<double>(s.dropped);
    layers += 1;
  }
  at::Tensor sums = at::tensor({b.aux_loss, b.dropped, layers}, at::kDouble);
  at::Tensor most = at::tensor({b.max_over_mean}, at::kDouble);
  world.all_reduce(sums);
  tessera::comm::AllReduceOptions max;
  max.op = tessera::comm::ReduceOp::kMax;
  world.all_reduce(most, max);
  const double pairs = std::max(1.0, sums[2].item<double>());
  b.aux_loss = sums[0].item<double>() / pairs;
  b.dropped = sums[1].item<double>() / pairs;
  b.max_over_mean = most[0].item<double>();
  return b;
}

// The token stream: bytes of a text (vocabulary 256) or uint16 tokens.
struct Corpus {
  at::Tensor tokens;  // int64
  int64_t vocab = 256;
  std::string source;
};

Corpus load_corpus(const std::string& path) {
  Corpus c;
  std::string bytes;
  auto read_file = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    TORCH_CHECK(in.good(), "cannot read the data file ", p.string());
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  if (path.empty()) {
    const fs::path dir = "/usr/share/games/fortunes";
    TORCH_CHECK(fs::is_directory(dir), "no --data given and no default corpus at ", dir.string(),
                ": install Debian's 'fortunes' package (apt-get install fortunes) or pass --data FILE");
    std::set<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file() && !e.is_symlink() && e.path().extension().empty()) files.insert(e.path());
    for (const auto& f : files) bytes += read_file(f);
    c.source = fmt::format("{} ({} files)", dir.string(), files.size());
  } else {
    TORCH_CHECK(fs::exists(path), "the data file ", path, " does not exist");
    bytes = read_file(path);
    c.source = path;
    if (fs::path(path).extension() == ".bin") {
      // llm.c's files start with a 256-int32 header whose first word is 20240520; nanoGPT's have none.
      size_t skip = 0;
      int32_t magic = 0;
      if (bytes.size() >= 1024) std::memcpy(&magic, bytes.data(), 4);
      if (magic == 20240520) skip = 1024;
      const int64_t n = static_cast<int64_t>((bytes.size() - skip) / 2);
      at::Tensor t = at::empty({n}, at::kShort);
      std::memcpy(t.data_ptr(), bytes.data() + skip, static_cast<size_t>(n) * 2);
      c.tokens = t.to(at::kInt).bitwise_and(0xFFFF).to(at::kLong);
      c.vocab = std::max<int64_t>(50257, c.tokens.max().item<int64_t>() + 1);
      return c;
    }
  }
  TORCH_CHECK(bytes.size() > 1000, "the corpus ", c.source, " has only ", bytes.size(), " bytes");
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  c.tokens = t.to(at::kLong);
  return c;
}

// `rows` windows of seq + 1 tokens from [begin, end), drawn from (seed, step):
// the same on every rank, and the data position of a run is just its step.
std::pair<at::Tensor, at::Tensor> windows(const at::Tensor& tokens, int64_t begin, int64_t end, int64_t rows,
                                          int64_t seq, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor starts = at::randint(begin, end - seq - 1, {rows, 1}, gen, at::kLong);
  at::Tensor idx = starts + at::arange(seq + 1, at::kLong).view({1, -1});
  at::Tensor w = tokens.index_select(0, idx.view({-1})).view({rows, seq + 1});
  return {w.narrow(1, 0, seq).contiguous(), w.narrow(1, 1, seq).contiguous()};
}

std::string printable(int64_t token) {
  if (token == '\n' || token == '\t') return std::string(1, static_cast<char>(token));
  if (token >= 32 && token < 127) return std::string(1, static_cast<char>(token));
  return "?";
}

std::string human_bytes(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  return fmt::format("{:.1f} kB", b / 1e3);
}

// The GPT as the trainer takes it; in bf16 the loss is taken in fp32.
tessera::train::TrainModel train_model(const std::shared_ptr<tessera::models::GPTImpl>& gpt, bool bf16) {
  if (bf16) gpt->to(at::kBFloat16);
  auto model = tessera::train::gpt_train_model(gpt);
  if (bf16) {
    auto inner = model.loss;
    model.loss = [inner](const at::Tensor& logits, const at::Tensor& y) { return inner(logits.to(at::kFloat), y); };
  }
  return model;
}

// --plan auto|flags: measures this machine's rates, then either searches
// for the fastest plan that fits --memory-gb and writes it into the flags,
// or predicts the plan the flags give. Prints the report on rank 0.
tessera::planner::Estimate plan_run(Json& a, const tessera::models::GPTConfig& cfg,
                                    const tessera::train::OptimizerFactory& make_optimizer,
                                    tessera::comm::TracingCommunicator& world, tessera::train::MetricsLog& log) {
  namespace planner = tessera::planner;
  const std::string mode = a["plan"];
  TORCH_CHECK(mode == "auto" || mode == "flags", "--plan must be auto (the planner chooses the layout) or flags "
              "(it predicts the flags' layout), got '", mode, "'");
  TORCH_CHECK(a["batch_schedule"].get<std::string>().empty(), "--plan with --batch-schedule: the planner plans one "
              "fixed layout; drop one of them");
  TORCH_CHECK(!a["sequence_parallel"].get<bool>(), "--plan with --sequence-parallel: the planner does not model "
              "Megatron's sequence-parallel variant yet; drop one of them");
  TORCH_CHECK(a["resume"].get<std::string>().empty() || mode == "flags", "--plan auto with --resume: the plan could "
              "differ from the checkpoint's layout; give the layout flags and --plan flags");
  TORCH_CHECK(!a["comm_bench"].get<std::string>().empty() || !a["cluster"].get<std::string>().empty(),
              "--plan needs the collectives' rates: --comm-bench FILE (mpirun -np ", world.size(),
              " comm_bench --json > FILE, on these ranks) or --cluster PRESET|FILE.json");
  if (mode == "auto")
    for (const auto& k : tessera_examples::planned_keys()) {
      std::string flag = "--" + k;
      std::replace(flag.begin(), flag.end(), '_', '-');
      TORCH_CHECK(!was_given(a, k), flag, " with --plan auto: the planner chooses it; drop ", flag,
                  " or use --plan flags to have your layout predicted");
    }
  {
    MPI_Comm host = MPI_COMM_NULL;
    int on_host = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
    MPI_Comm_size(host, &on_host);
    MPI_Comm_free(&host);
    int fewest = on_host;
    MPI_Allreduce(MPI_IN_PLACE, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    TORCH_CHECK(fewest == world.size(), "--plan describes this machine, but the ", world.size(),
                " ranks span more than one host (", fewest, " on the smallest); plan a cluster with tessera_plan "
                "--cluster FILE.json and give train_gpt its layout flags");
  }
  // A serial copy on every rank measures the rates (Note [Rates for the planner]).
  const int world_size = world.size(), rank = world.rank();
  const bool bf16 = a["precision"] == "bf16";
  const planner::ModelDesc model = planner::ModelDesc::gpt(cfg, cfg.context);
  auto self = world.inner()->split(rank, 0, "planner_rates");
  tessera_examples::MeasuredRates rates;
  {
    auto serial_cfg = cfg;
    serial_cfg.checkpoint_activations = false;  // the planner adds the recompute itself
    torch::manual_seed(a["seed"].get<int64_t>());
    auto serial = std::make_shared<tessera::models::GPTImpl>(serial_cfg, tessera::nn::make_1d_factory(self, false, 1, 2));
    auto m = train_model(serial, bf16);
    const int64_t rows = std::max<int64_t>(1, a["batch"].get<int64_t>() / world_size);
    rates = tessera_examples::measure_rates(model, m, make_optimizer, rows, a["clip"], bf16);
  }
  const planner::ClusterDesc cluster = tessera_examples::this_machine(a, was_given(a, "overlap"), world_size, rates);
  log.print(fmt::format("planner: this machine, measured: {:.3g} GFLOP/s per rank for this GPT, {:.3g} ms per block "
                        "and pass beside it, optimizer {:.3g} GB/s per rank, {} cores; collectives from {}; overlap {}",
                        rates.flops / 1e9, 1e3 * rates.block_overhead, rates.optimizer_bytes_s / 1e9,
                        cluster.compute_units,
                        a["comm_bench"].get<std::string>().empty() ? a["cluster"].get<std::string>()
                                                                   : a["comm_bench"].get<std::string>(),
                        cluster.overlap));
  planner::Estimate chosen;
  if (mode == "auto") {
    planner::SearchOptions o;
    o.global_batch = a["batch"];
    o.memory_limit = cluster.memory_bytes;
    o.bf16 = bf16;
    o.top = static_cast<int>(a["plan_top"].get<int64_t>());
    o.offload = true;
    const planner::SearchResult r = planner::search(model, cluster, o);
    if (r.best.empty()) {
      std::string msg = fmt::format("--plan auto: no plan of this GPT fits in {:.4g} GB per rank on {} ranks",
                                    cluster.memory_bytes / 1e9, world_size);
      if (!r.over.empty())
        msg += fmt::format("; the closest, {}, {}", r.over.front().plan.to_string(), r.over.front().why);
      TORCH_CHECK(false, msg, ". Raise --memory-gb or use more ranks");
    }
    log.print(planner::search_report(model, cluster, o, r, false));
    log.print(planner::search_report(model, cluster, o, r, true));
    chosen = r.best.front();
    tessera_examples::apply_plan(chosen.plan, a);
  } else {
    const planner::Plan p = tessera_examples::plan_of_flags(a, parallel_config(a), world_size);
    planner::check_plan(model, p);
    chosen = planner::estimate(model, p, cluster);
    log.print(fmt::format("planner: the flags' plan\n{}\n{}{}", chosen.summary(), planner::breakdown(chosen),
                          chosen.to_json()));
  }
  return chosen;
}

int train(int argc, char** argv) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto started = std::chrono::steady_clock::now();
  {
    Json a = parse_args(argc, argv);
    TORCH_CHECK(a["precision"] == "fp32" || a["precision"] == "bf16", "--precision must be fp32 or bf16, got '",
                a["precision"].get<std::string>(), "'");
    const std::string opt_name = a["optimizer"];
    TORCH_CHECK(opt_name == "adamw" || opt_name == "lamb" || opt_name == "lars" || opt_name == "sgd",
                "--optimizer must be adamw, lamb, lars or sgd, got '", opt_name, "'");
    std::string offload = a["offload"];  // --plan auto may choose it
    const std::string offload_dir = a["offload_dir"];
    TORCH_CHECK(offload == "none" || offload == "optimizer" || offload == "optimizer:disk",
                "--offload must be none, optimizer (CPU memory) or optimizer:disk, got '", offload,
                "'; parameter shards are not offloaded to disk yet (docs/offload.md)");
    TORCH_CHECK((offload == "optimizer:disk") == !offload_dir.empty(),
                offload == "optimizer:disk" ? "--offload optimizer:disk needs --offload-dir DIR (a local disk)"
                                            : "--offload-dir is only read with --offload optimizer:disk");
    for (const char* k : {"steps", "batch", "seq", "layers", "heads", "hidden", "accumulation", "log_every",
                          "min_rows_per_replica"})
      TORCH_CHECK(a[k].get<int64_t>() >= 1, "--", k, " must be >= 1, got ", a[k].get<int64_t>());
    // Elastic training (docs/elastic.md): the schedule sets the batch, the batch the data size.
    const bool elastic = !a["batch_schedule"].get<std::string>().empty();
    if (elastic) {
      TORCH_CHECK(!was_given(a, "dp"), "--dp ", a["dp"].get<int64_t>(),
                  " with --batch-schedule: the schedule chooses the data size (the largest that gives every replica "
                  "--min-rows-per-replica rows); leave --dp out");
      TORCH_CHECK(!was_given(a, "batch"), "--batch ", a["batch"].get<int64_t>(),
                  " with --batch-schedule: the schedule sets the batch of every step; give one of the two");
    } else {
      TORCH_CHECK(!was_given(a, "min_rows_per_replica"), "--min-rows-per-replica is only read with --batch-schedule");
    }
    for (const char* k : {"cluster", "comm_bench", "memory_gb", "overlap", "plan_top"}) {
      std::string flag = std::string("--") + k;
      std::replace(flag.begin(), flag.end(), '_', '-');
      TORCH_CHECK(!was_given(a, k) || !a["plan"].get<std::string>().empty(), flag,
                  " is only read with --plan auto|flags");
    }
    TORCH_CHECK(!was_given(a, "plan_top") || a["plan"] == "auto", "--plan-top is only read with --plan auto");
    const auto schedule = elastic ? tessera::train::BatchSchedule::parse(a["batch_schedule"])
                                  : tessera::train::BatchSchedule::constant(a["batch"]);

    auto trace = std::make_shared<tessera::comm::CommTrace>();
    auto world = std::make_shared<tessera::comm::TracingCommunicator>(tessera::comm::make_world_communicator(), trace);
    tessera::train::MetricsLog log(rank == 0, a["metrics"].get<std::string>());

    const Corpus corpus = load_corpus(a["data"]);
    const int64_t n = corpus.tokens.numel(), split = n * 9 / 10, seq = a["seq"];
    TORCH_CHECK(n - split > seq + 2, "the corpus is too small for --seq ", seq);

    tessera::models::GPTConfig cfg;
    cfg.vocab = corpus.vocab;
    cfg.context = seq;
    cfg.layers = a["layers"];
    cfg.heads = a["heads"];
    cfg.hidden = a["hidden"];
    cfg.dropout = a["dropout"];
    cfg.checkpoint_activations = a["checkpoint_activations"];
    cfg.experts = a["experts"];
    cfg.top_k = a["top_k"];
    cfg.moe_every = a["moe_every"];
    cfg.aux_loss_coef = a["aux_loss_coef"];
    cfg.z_loss_coef = a["z_loss_coef"];
    const std::string capacity = a["capacity_factor"], policy = a["drop_policy"];
    if (capacity != "dropless") {
      try {
        cfg.capacity_factor = std::stod(capacity);
      } catch (const std::exception&) {
        TORCH_CHECK(false, "--capacity-factor must be a positive number or 'dropless', got '", capacity, "'");
      }
    }
    TORCH_CHECK(policy == "position" || policy == "probability",
                "--drop-policy must be position or probability, got '", policy, "'");
    cfg.drop_policy = policy == "position" ? tessera::nn::MoEDropPolicy::kPosition
                                           : tessera::nn::MoEDropPolicy::kProbability;
    const double lr = a["lr"], wd = a["weight_decay"];
    auto make_optimizer = [&](const std::vector<std::pair<std::string, at::Tensor>>& named) {
      std::shared_ptr<torch::optim::Optimizer> o;
      if (opt_name == "lamb") {
        o = std::make_shared<tessera::optim::Lamb>(
            tessera::optim::param_groups(named, tessera::optim::LambOptions(lr).weight_decay(wd)));
      } else if (opt_name == "lars") {
        o = std::make_shared<tessera::optim::Lars>(
            tessera::optim::param_groups(named, tessera::optim::LarsOptions(lr).weight_decay(wd)));
      } else {
        std::vector<at::Tensor> params;
        for (const auto& p : named) params.push_back(p.second);
        if (opt_name == "sgd")
          o = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(lr).momentum(0.9));
        else
          o = std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr).weight_decay(wd));
      }
      return o;
    };
    // --plan: the planner chooses the layout (auto) or predicts the flags' one.
    const std::string plan_mode = a["plan"];
    std::optional<tessera::planner::Estimate> predicted;
    if (!plan_mode.empty()) {
      predicted = plan_run(a, cfg, make_optimizer, *world, log);
      // What the plan chose beside the grid, spec and micro-batches (read below).
      cfg.checkpoint_activations = a["checkpoint_activations"];
      offload = a["offload"].get<std::string>();
    }

    tessera::context::ParallelConfig layout = parallel_config(a);
    // A fixed layout has one context; an elastic one, one per layout it goes through.
    auto ctx = elastic ? nullptr : tessera::context::ParallelContext::create(world, layout);
    const int pp = layout.pipeline();
    const int64_t micro = a["microbatches"].get<int64_t>() > 0 ? a["microbatches"].get<int64_t>() : 2 * pp;

    // The current layout's model; an elastic trainer builds one per layout.
    // Elastic dropout is keyed by the row of the global batch, so that the
    // masks do not depend on the data size (Note [Row-keyed dropout]).
    std::shared_ptr<tessera::models::GPTImpl> gpt;
    auto build = [&](const tessera::context::ParallelContextPtr& c) {
      torch::manual_seed(a["seed"].get<int64_t>());
      // Refuses, on every rank, the modes whose layers do not exist yet.
      auto factory = tessera::nn::make_layer_factory(c, a["sequence_parallel"], elastic && cfg.dropout > 0);
      gpt = std::make_shared<tessera::models::GPTImpl>(cfg, factory);
      return train_model(gpt, a["precision"] == "bf16");
    };

    const int64_t steps = a["steps"];
    // The heads go with the weights: their shapes do not say (tessera_generate reads them).
    auto checkpoint_metadata = [&](int64_t step) {
      return fmt::format(R"({{"step": {}, "gpt": {{"heads": {}}}}})", step, cfg.heads);
    };
    const auto trainer_options = tessera::train::TrainerOptions()
                                        .spec(tessera::parallel::ShardingSpec::parse(a["spec"]))
                                        .pipeline(tessera::parallel::PipelineOptions()
                                                      .schedule(tessera::parallel::parse_schedule_kind(a["schedule"]))
                                                      .microbatches(static_cast<int>(micro))
                                                      .chunks(a["chunks"].get<int>()))
                                        .accumulation(a["accumulation"].get<int64_t>())
                                        .offload(offload == "optimizer")
                                        .disk(tessera::parallel::DiskOffloadOptions().dir(offload_dir))
                                        .clip_grad_norm(a["clip"])
                                        .lr(tessera::train::LrSchedule()
                                                .peak(lr)
                                                .warmup_steps(a["warmup"])
                                                .total_steps(steps)
                                                .decay(tessera::train::lr_decay_from_string(a["decay"]))
                                                .min_ratio(a["min_lr_ratio"]));
    std::unique_ptr<tessera::train::Trainer> fixed;
    std::unique_ptr<tessera::train::ElasticTrainer> el;
    // A resumed elastic run starts in the layout of its step's batch: the
    // checkpoint's, so that the dropout streams are restored too.
    const std::string resume = a["resume"];
    const int64_t resume_step =
        elastic && !resume.empty()
            ? Json::parse(tessera::train::CheckpointReader(resume).metadata()).at("step").get<int64_t>()
            : 0;
    if (elastic) {
      layout.data(tessera::train::data_size_for(schedule.at(resume_step),
                                                world->size() / (pp * layout.tensor() * layout.sequence()),
                                                a["min_rows_per_replica"], a["accumulation"], layout.expert()));
      el = std::make_unique<tessera::train::ElasticTrainer>(
          world, build, make_optimizer, layout,
          tessera::train::ElasticOptions().trainer(trainer_options).min_rows_per_replica(a["min_rows_per_replica"]));
    } else {
      fixed = std::make_unique<tessera::train::Trainer>(ctx, build(ctx), make_optimizer, trainer_options);
    }
    // The trainer of the current layout; none on a rank the layout leaves idle.
    auto current = [&]() -> tessera::train::Trainer* {
      return el ? (el->active() ? &el->trainer() : nullptr) : fixed.get();
    };
    if (!elastic) {
      const int64_t rows = a["batch"], data = ctx->size(ParallelMode::kData);
      TORCH_CHECK(rows % data == 0, "--batch ", rows, " must be divisible by the data-parallel size ", data);
    }
    int64_t start = resume_step;  // idle ranks know it from the checkpoint's metadata
    if (!resume.empty()) {
      if (auto* t = current()) {
        t->load(resume);
        start = t->step();
      }
      log.print(fmt::format("resumed from {} at step {}", resume, start));
    }

    const double flops_per_token = tessera::train::gpt_flops_per_token(cfg, seq);
    double parameters = 0;
    if (gpt)
      for (const auto& [name, place] : gpt->placements()) {
        double numel = 1;
        for (int64_t d : place.full_shape) numel *= static_cast<double>(d);
        parameters += numel;
      }
    world->barrier();
    const double peak_flops = tessera::train::measured_matmul_flops();
    log.print(fmt::format(
        "train_gpt: {} | corpus {} ({} tokens, vocab {}) | GPT {} layers, hidden {}, {} heads, {:.2f} M "
        "parameters | spec {}{}{} | {} | {} | {} steps of {} x {} tokens",
        elastic ? fmt::format("elastic over {} ranks, {}, data size from the batch (>= {} rows per replica)",
                              world->size(), el->layout_name(), a["min_rows_per_replica"].get<int64_t>())
                : tessera::context::to_string(ctx->config()),
        corpus.source, n, corpus.vocab, cfg.layers, cfg.hidden, cfg.heads, parameters / 1e6,
        a["spec"].get<std::string>(), cfg.checkpoint_activations ? ", activation checkpointing" : "",
        offload != "none" ? ", offload " + offload : std::string(),
        pp > 1 ? fmt::format("schedule {} x {} micro-batches", a["schedule"].get<std::string>(), micro)
               : std::string("no pipeline"),
        opt_name, steps, elastic ? "(" + schedule.to_string() + ")" : std::to_string(schedule.at(0)), seq));

    const uint64_t seed = a["seed"].get<uint64_t>();
    const int64_t eval_every = a["eval_every"], save_every = a["save_every"];
    const std::string save_dir = a["save"];
    double last_loss = 0;
    std::vector<double> step_seconds;  // for --plan's measured step time
    for (int64_t step = start; step < steps; ++step) {
      const int64_t rows = schedule.at(step);
      const std::string before = el ? el->layout_name() : std::string();
      if (el && el->adapt(rows)) {
        const auto& m = el->history().back();
        log.record("migration", {{"step", static_cast<double>(step)},
                                 {"data_size", el->data_size()},
                                 {"bytes_moved", static_cast<double>(m.bytes_moved)},
                                 {"bytes_kept", static_cast<double>(m.bytes_kept)},
                                 {"seconds", m.seconds}});
        log.print(fmt::format("step {:4d}/{} | elastic: batch {}, {} -> {} | moved {}, kept {} in place | {:.2f} s "
                              "(build {:.2f}, exchange {:.2f})",
                              step, steps, rows, before, el->layout_name(),
                              human_bytes(static_cast<double>(m.bytes_moved)),
                              human_bytes(static_cast<double>(m.bytes_kept)), m.seconds, m.build_seconds,
                              m.exchange_seconds));
      }
      tessera::train::Trainer* trainer = current();
      if (trainer == nullptr) {  // idle: the next adapt() that moves the layout waits, asleep
        gpt = nullptr;
        continue;
      }
      TORCH_INTERNAL_ASSERT(trainer->step() == step, "train_gpt: the trainer is at step ", trainer->step(),
                            ", the loop at ", step);
      const auto [first, count] =
          el ? el->rows_of(rows)
             : std::pair<int64_t, int64_t>(ctx->rank(ParallelMode::kData) * (rows / ctx->size(ParallelMode::kData)),
                                           rows / ctx->size(ParallelMode::kData));
      auto local = [first = first, count = count](const at::Tensor& t) { return t.narrow(0, first, count); };
      const int active = trainer->context()->world()->size();
      auto [x, y] = windows(corpus.tokens, 0, split, rows, seq, seed * 1000003 + static_cast<uint64_t>(step));
      const double bytes_before = static_cast<double>(trace->total().bytes);
      const auto st = trainer->train_step(local(x), local(y));
      last_loss = st.loss;
      step_seconds.push_back(st.seconds);
      const double tokens = static_cast<double>(rows * seq), tps = tokens / st.seconds;
      const double mfu = flops_per_token * tps / (peak_flops * active);
      const double state = static_cast<double>(trainer->memory().total());
      const double comm = static_cast<double>(trace->total().bytes) - bytes_before;
      const MoEBalance moe = moe_balance(*gpt, *trainer->context()->world());
      log.record("train", {{"step", st.step},
                           {"loss", st.loss},
                           {"lr", st.lr},
                           {"grad_norm", st.grad_norm},
                           {"tokens_per_s", tps},
                           {"mfu", mfu},
                           {"model_state_bytes", state},
                           {"comm_bytes", comm},
                           {"seconds", st.seconds},
                           {"moe_aux_loss", moe.aux_loss},
                           {"moe_max_over_mean", moe.max_over_mean},
                           {"moe_dropped", moe.dropped}});
      if (st.step % a["log_every"].get<int64_t>() == 0 || st.step == steps)
        log.print(
            fmt::format("step {:4d}/{}{} | loss {:.4f} | lr {:.2e} | {:7.0f} tok/s | MFU {:4.1f}% | state {}/rank | "
                        "comm {}/step/rank | {:.0f} ms{}{}",
                        st.step, steps,
                        el ? fmt::format(" | {} | batch {}", el->layout_name(), rows) : std::string(), st.loss, st.lr,
                        tps, 100 * mfu, human_bytes(state), human_bytes(comm),
                        1000 * st.seconds,
                        cfg.experts > 0 ? fmt::format(" | experts max/mean {:.2f}, aux {:.4f}, dropped {:.0f}",
                                                      moe.max_over_mean, moe.aux_loss, moe.dropped)
                                        : std::string(),
                        st.skipped ? " | skipped (overflow)" : ""));
      if (eval_every > 0 && (st.step % eval_every == 0 || st.step == steps)) {
        auto [vx, vy] = windows(corpus.tokens, split, n, rows, seq, 7 + static_cast<uint64_t>(st.step));
        const double val = trainer->evaluate(local(vx), local(vy));
        log.record("eval", {{"step", st.step}, {"val_loss", val}});
        log.print(fmt::format("step {:4d}/{} | validation loss {:.4f}", st.step, steps, val));
      }
      if (!save_dir.empty() && save_every > 0 && st.step % save_every == 0)
        trainer->save(fmt::format("{}/step-{:06d}", save_dir, st.step), checkpoint_metadata(st.step));
    }
    if (el) el->finish();
    if (predicted) {
      const double measured = tessera_examples::median_step(step_seconds);
      log.record("plan", {{"predicted_s", predicted->step_s},
                          {"measured_s", measured},
                          {"predicted_peak_bytes", predicted->memory.peak()}});
      log.print(fmt::format("planner: {} | step predicted {:.4g} s, measured {:.4g} s (median after warm-up), "
                            "measured/predicted {:.2f}",
                            predicted->plan.to_string(), predicted->step_s, measured, measured / predicted->step_s));
    }

    // The final weights, full, through a checkpoint; rank 0 samples from a serial copy.
    const std::string final_dir = (save_dir.empty() ? std::string("train_gpt_out") : save_dir) + "/final";
    if (auto* t = current()) t->save(final_dir, checkpoint_metadata(t->step()));
    // Collective: rank 0 alone gets a communicator for its serial copy.
    auto self = a["sample"].get<int64_t>() > 0 ? world->inner()->split(rank == 0 ? 0 : -1, 0, "sample") : nullptr;
    if (rank == 0) {
      if (!a["consolidate"].get<std::string>().empty()) {
        tessera::train::consolidate_checkpoint(final_dir, a["consolidate"]);
        log.print(fmt::format("consolidated weights: {}", a["consolidate"].get<std::string>()));
      }
      const int64_t sample = a["sample"];
      if (sample > 0) {
        tessera::train::CheckpointReader reader(final_dir);
        std::map<std::string, at::Tensor> full;
        for (const auto& name : reader.names("model/")) full[name.substr(6)] = reader.full(name).to(at::kFloat);
        auto serial_cfg = cfg;
        serial_cfg.dropout = 0;
        tessera::models::GPT serial(serial_cfg, tessera::nn::make_1d_factory(self, false, 1, 2));
        serial->load_full_state(full);
        serial->eval();
        at::NoGradGuard no_grad;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
        at::Tensor ids = at::full({1, 1}, corpus.vocab == 256 ? int64_t('\n') : int64_t(0), at::kLong);
        std::string text;
        for (int64_t i = 0; i < sample; ++i) {
          at::Tensor ctx_ids = ids.size(1) > seq ? ids.narrow(1, ids.size(1) - seq, seq) : ids;
          at::Tensor logits = serial->forward(ctx_ids).select(1, ctx_ids.size(1) - 1).squeeze(0) / 0.8;
          const int64_t next = at::multinomial(at::softmax(logits, 0), 1, false, gen).item<int64_t>();
          ids = at::cat({ids, at::full({1, 1}, next, at::kLong)}, 1);
          text += corpus.vocab == 256 ? printable(next) : fmt::format("<{}>", next);
        }
        log.print(fmt::format("final loss {:.4f}; sampled text (temperature 0.8):\n{}", last_loss, text));
      }
      log.print(fmt::format("train_gpt: done in {:.0f} s",
                            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return tessera_examples::run_example(argc, argv, "train_gpt", train); }
