// tessera_plan: the planner's choice of parallel layout and sharding for a
// model on a cluster, the next best plans, and why (docs/planner.md). No MPI.
//
//   tessera_plan --model llama-7b --seq 4096 --batch 1024 --cluster a800-amsp [--nodes 128]
//       [--gpus-per-node 8] [--memory-gb 80] [--achieved-tflops T] [--comm-bench FILE] [--overlap F]
//       [--top 5] [--json] [--fp32] [--dp-only] [--tp-modes 1d,2d] [--max-tp N] [--max-sp N]
//       [--sp-modes ulysses,ring] [--max-pp N] [--no-checkpointing] [--offload]
//       [--specs ddp,zero3,...] [--compare zero3,mics:8,...] [--fused-attention]
//   tessera_plan --layers 4 --hidden 256 --heads 8 --vocab 8192 --seq 64 ... (a GPT of those shapes)
//
// --cluster takes a preset (a800-amsp, h100-1024) or a JSON file (ClusterDesc::from_json);
// --comm-bench reads comm_bench --json output for the links inside a node.
// --fused-attention: attention keeps no scores for backward (FlashAttention;
// tessera's own attention keeps them), to describe other systems' runs.
// --compare evaluates each spec with data parallelism only, at its fastest
// micro-batch count and checkpointing choice that fits, and prints it beside the search.
#include <tessera/models/gpt.h>
#include <tessera/planner/report.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace tessera;

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    // "{R,P(2),S}" keeps its commas.
    if (!out.empty() && std::count(out.back().begin(), out.back().end(), '{') >
                            std::count(out.back().begin(), out.back().end(), '}')) {
      out.back() += "," + item;
    } else {
      out.push_back(item);
    }
  }
  return out;
}

int64_t to_int(const std::string& flag, const std::string& v) {
  size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == v.size() && !v.empty(), flag, " takes an integer, got '", v, "'");
  return x;
}

double to_double(const std::string& flag, const std::string& v) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == v.size() && !v.empty(), flag, " takes a number, got '", v, "'");
  return x;
}

int run(int argc, char** argv) {
  std::map<std::string, std::string> a;
  const std::vector<std::string> switches = {"--json", "--fp32", "--dp-only", "--no-checkpointing", "--offload",
                                             "--fused-attention"};
  const std::vector<std::string> valued = {"--model",      "--seq",        "--batch",      "--cluster",   "--nodes",
                                           "--gpus-per-node", "--memory-gb", "--achieved-tflops", "--comm-bench", "--overlap",
                                           "--top",        "--tp-modes",   "--max-tp",     "--max-sp",    "--sp-modes",
                                           "--max-pp",     "--specs",      "--compare",    "--layers",    "--hidden",
                                           "--heads",      "--vocab",      "--ffn",        "--experts",   "--moe-every",
                                           "--top-k"};
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (std::find(switches.begin(), switches.end(), f) != switches.end()) {
      a[f] = "1";
    } else if (std::find(valued.begin(), valued.end(), f) != valued.end()) {
      TORCH_CHECK(i + 1 < argc, f, " needs a value");
      a[f] = argv[++i];
    } else {
      TORCH_CHECK(false, "unknown argument '", f, "'; see the comment at the top of examples/plan.cpp");
    }
  }
  auto get = [&](const std::string& k, const std::string& d) { return a.count(k) ? a.at(k) : d; };
  const int64_t seq = to_int("--seq", get("--seq", "1024"));
  planner::ModelDesc model;
  if (a.count("--model")) {
    for (const char* shape : {"--layers", "--hidden", "--heads", "--vocab", "--ffn", "--experts", "--moe-every", "--top-k"})
      TORCH_CHECK(!a.count(shape), "give --model or the shapes (", shape, " ...), not both: --model ", a.at("--model"),
                  " fixes them");
    model = planner::ModelDesc::preset(a.at("--model"), seq);
  } else {
    models::GPTConfig c;
    c.layers = to_int("--layers", get("--layers", "12"));
    c.hidden = to_int("--hidden", get("--hidden", "768"));
    c.heads = to_int("--heads", get("--heads", "12"));
    c.vocab = to_int("--vocab", get("--vocab", "50257"));
    c.context = seq;
    c.experts = to_int("--experts", get("--experts", "0"));
    c.moe_every = to_int("--moe-every", get("--moe-every", "1"));
    c.top_k = to_int("--top-k", get("--top-k", "1"));
    model = planner::ModelDesc::gpt(c, seq);
    if (a.count("--ffn")) model.ffn(to_int("--ffn", a.at("--ffn")));
  }
  if (a.count("--fused-attention")) model.fused_attention(true);
  planner::ClusterDesc cluster = planner::ClusterDesc::load(get("--cluster", "a800-amsp"));
  if (a.count("--comm-bench")) cluster = planner::ClusterDesc::from_comm_bench_file(a.at("--comm-bench"), cluster);
  if (a.count("--nodes")) cluster.nodes = static_cast<int>(to_int("--nodes", a.at("--nodes")));
  if (a.count("--gpus-per-node")) cluster.gpus_per_node = static_cast<int>(to_int("--gpus-per-node", a.at("--gpus-per-node")));
  if (a.count("--memory-gb")) cluster.memory_bytes = to_double("--memory-gb", a.at("--memory-gb")) * 1e9;
  if (a.count("--achieved-tflops")) cluster.achieved_flops = to_double("--achieved-tflops", a.at("--achieved-tflops")) * 1e12;
  if (a.count("--overlap")) {
    cluster.overlap = to_double("--overlap", a.at("--overlap"));
    TORCH_CHECK(cluster.overlap >= 0 && cluster.overlap <= 1, "--overlap is a fraction in [0, 1], got ", cluster.overlap);
  }
  TORCH_CHECK(cluster.nodes >= 1 && cluster.gpus_per_node >= 1, "--nodes and --gpus-per-node must be >= 1");

  planner::SearchOptions o;
  o.global_batch = to_int("--batch", get("--batch", "8"));
  o.bf16 = !a.count("--fp32");
  o.top = static_cast<int>(to_int("--top", get("--top", "5")));
  o.checkpointing = !a.count("--no-checkpointing");
  o.offload = a.count("--offload") > 0;
  for (const auto& m : split_list(get("--tp-modes", ""))) o.tensor_modes.push_back(context::parse_tensor_mode(m));
  for (const auto& m : split_list(get("--sp-modes", ""))) o.sequence_modes.push_back(context::parse_sequence_mode(m));
  for (const auto& s : split_list(get("--specs", ""))) o.specs.push_back(parallel::ShardingSpec::parse(s));
  o.max_tensor = static_cast<int>(to_int("--max-tp", get("--max-tp", "0")));
  o.max_sequence = static_cast<int>(to_int("--max-sp", get("--max-sp", "1")));
  o.max_pipeline = static_cast<int>(to_int("--max-pp", get("--max-pp", "0")));
  if (a.count("--dp-only")) o.max_tensor = o.max_sequence = o.max_pipeline = 1;
  const bool json = a.count("--json") > 0;

  const planner::SearchResult r = planner::search(model, cluster, o);
  if (r.best.empty()) {
    std::string msg = "no plan fits in the memory limit";
    if (!r.over.empty())
      msg += fmt::format("; the closest, {}, {}", r.over.front().plan.to_string(), r.over.front().why);
    TORCH_CHECK(false, msg, ". Raise --memory-gb, add --offload, or more ranks");
  }
  fmt::print("{}", planner::search_report(model, cluster, o, r, json));
  for (const auto& s : split_list(get("--compare", ""))) {
    planner::SearchOptions one = o;
    one.max_tensor = one.max_sequence = one.max_pipeline = 1;
    one.specs = {parallel::ShardingSpec::parse(s)};
    one.top = 1;
    const planner::SearchResult c = planner::search(model, cluster, one);
    if (json) {
      fmt::print("{{\"compare\": \"{}\", \"estimate\": {}}}\n", s,
                 c.best.empty() ? (c.over.empty() ? std::string("null") : c.over.front().to_json())
                                : c.best.front().to_json());
    } else if (c.best.empty()) {
      fmt::print("compare {}: does not fit{}\n", s, c.over.empty() ? "" : " (" + c.over.front().why + ")");
    } else {
      fmt::print("compare {}: {}\n", s, c.best.front().summary());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "tessera_plan: error: {}\n", e.what_without_backtrace());
    return 1;
  }
}
