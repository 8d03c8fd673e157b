// tessera_plan: the planner's choice of parallel layout and sharding for a
// model on a cluster, the next best plans, and why (docs/planner.md). No MPI.
//
//   tessera_plan --model llama-7b --seq 4096 --batch 1024 --cluster a800-amsp --nodes 128
//   tessera_plan --layers 4 --hidden 256 --heads 8 --vocab 8192 --seq 64 ...   (a GPT of those shapes)
//
// Every option: tessera_plan --help (docs/cli.md).
#include <tessera/core/cli.h>
#include <tessera/models/gpt.h>
#include <tessera/planner/report.h>
#include <tessera/planner/search.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace tessera;

// "a,b,{R,P(2),S}" -> its items; a spec in braces keeps its commas.
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!out.empty() && std::count(out.back().begin(), out.back().end(), '{') >
                            std::count(out.back().begin(), out.back().end(), '}')) {
      out.back() += "," + item;
    } else {
      out.push_back(item);
    }
  }
  return out;
}

template <class T, class Parse>
std::vector<T> list_of(const std::string& s, Parse parse) {
  std::vector<T> out;
  for (const auto& item : split_list(s)) out.push_back(parse(item));
  return out;
}

struct Args {
  std::string model, cluster = "a800-amsp", comm_bench, tp_modes, sp_modes, specs, compare;
  int64_t seq = 1024, nodes = 0, gpus_per_node = 0;
  double memory_gb = 0, achieved_tflops = 0, overlap = -1;
  bool json = false, fp32 = false, dp_only = false, no_checkpointing = false, fused_attention = false;
  models::GPTConfig gpt;
  int64_t ffn = 0;
  planner::SearchOptions search = planner::SearchOptions().global_batch(8);
};

cli::Command command(Args& a) {
  cli::Command c("tessera_plan", "the planner's best parallel layouts and sharding for a model on a cluster");
  c.group("Model");
  c.add("model", &a.model, "a preset (gpt-medium, llama-7b, llama3-8b, mixtral-8x7b, ...) instead of the shapes below");
  c.add("layers", &a.gpt.layers(), "GPT blocks");
  c.add("hidden", &a.gpt.hidden(), "hidden size");
  c.add("heads", &a.gpt.heads(), "attention heads");
  c.add("vocab", &a.gpt.vocab(), "vocabulary");
  c.add("ffn", &a.ffn, "MLP width; 0: 4 x hidden");
  c.add("experts", &a.gpt.experts(), "experts per MoE block; 0: dense");
  c.add("moe-every", &a.gpt.moe_every(), "every n-th block has experts");
  c.add("top-k", &a.gpt.top_k(), "experts per token");
  c.add("seq", &a.seq, "tokens per sequence");
  c.add("fused-attention", &a.fused_attention, "attention keeps no scores for backward (FlashAttention)");
  c.group("Cluster");
  c.add("cluster", &a.cluster, "a preset (a800-amsp, h100-1024) or a JSON file");
  c.add("comm-bench", &a.comm_bench, "comm_bench --json lines for the links inside a node");
  c.add("nodes", &a.nodes, "nodes; 0: the cluster's");
  c.add("gpus-per-node", &a.gpus_per_node, "ranks per node; 0: the cluster's");
  c.add("memory-gb", &a.memory_gb, "memory per rank in GB; 0: the cluster's");
  c.add("achieved-tflops", &a.achieved_tflops, "what the model reaches per rank; 0: the cluster's");
  c.add("overlap", &a.overlap, "fraction of data-parallel traffic hidden behind compute; -1: the cluster's");
  c.group("Search");
  c.add("batch", &a.search.global_batch(), "global batch in sequences");
  c.add("top", &a.search.top(), "plans listed");
  c.add("fp32", &a.fp32, "fp32 states instead of bf16 with fp32 masters");
  c.add("tp-modes", &a.tp_modes, "tensor modes to try, e.g. 1d,2d; empty: 1d");
  c.add("sp-modes", &a.sp_modes, "sequence modes to try, e.g. ulysses,ring; empty: ulysses");
  c.add("max-tp", &a.search.max_tensor(), "largest tensor size; 0: ranks per node");
  c.add("max-sp", &a.search.max_sequence(), "largest sequence size");
  c.add("max-pp", &a.search.max_pipeline(), "largest pipeline size; 0: no limit");
  c.add("dp-only", &a.dp_only, "data parallelism and sharding only");
  c.add("no-checkpointing", &a.no_checkpointing, "never try activation checkpointing");
  c.add("offload", &a.search.offload(), "also try the optimizer in host memory");
  c.add("specs", &a.specs, "only these sharding specs, e.g. zero3,mics:8");
  c.add("compare", &a.compare, "evaluate these specs with data parallelism only, beside the search");
  c.add("json", &a.json, "JSON lines instead of the report");
  return c;
}

planner::ModelDesc model_of(const Args& a, const cli::Command& c) {
  if (!a.model.empty()) {
    for (const char* shape : {"layers", "hidden", "heads", "vocab", "ffn", "experts", "moe-every", "top-k"})
      TORCH_CHECK(!c.given(shape), "give --model or the shapes (--", shape, " ...), not both: --model ", a.model,
                  " fixes them");
    return planner::ModelDesc::preset(a.model, a.seq);
  }
  planner::ModelDesc m = planner::ModelDesc::gpt(models::GPTConfig(a.gpt).context(a.seq), a.seq);
  if (a.ffn > 0) m.ffn(a.ffn);
  return m;
}

planner::ClusterDesc cluster_of(const Args& a) {
  planner::ClusterDesc cluster = planner::ClusterDesc::load(a.cluster);
  if (!a.comm_bench.empty()) cluster = planner::ClusterDesc::from_comm_bench_file(a.comm_bench, cluster);
  if (a.nodes > 0) cluster.nodes = static_cast<int>(a.nodes);
  if (a.gpus_per_node > 0) cluster.gpus_per_node = static_cast<int>(a.gpus_per_node);
  if (a.memory_gb > 0) cluster.memory_bytes = a.memory_gb * 1e9;
  if (a.achieved_tflops > 0) cluster.achieved_flops = a.achieved_tflops * 1e12;
  if (a.overlap != -1) {
    TORCH_CHECK(a.overlap >= 0 && a.overlap <= 1, "--overlap is a fraction in [0, 1], got ", a.overlap);
    cluster.overlap = a.overlap;
  }
  TORCH_CHECK(a.nodes >= 0 && a.gpus_per_node >= 0, "--nodes and --gpus-per-node must be >= 1");
  return cluster;
}

int run(Args& a, const cli::Command& c) {
  planner::ModelDesc model = model_of(a, c);
  if (a.fused_attention) model.fused_attention(true);
  const planner::ClusterDesc cluster = cluster_of(a);
  planner::SearchOptions o = a.search;
  o.bf16(!a.fp32).checkpointing(!a.no_checkpointing);
  o.tensor_modes(list_of<context::TensorMode>(a.tp_modes, context::parse_tensor_mode));
  o.sequence_modes(list_of<context::SequenceMode>(a.sp_modes, context::parse_sequence_mode));
  o.specs(list_of<parallel::ShardingSpec>(a.specs, parallel::ShardingSpec::parse));
  if (a.dp_only) o.max_tensor(1).max_sequence(1).max_pipeline(1);

  const planner::SearchResult r = planner::search(model, cluster, o);
  if (r.best.empty()) {
    std::string msg = "no plan fits in the memory limit";
    if (!r.over.empty())
      msg += fmt::format("; the closest, {}, {}", r.over.front().plan.to_string(), r.over.front().why);
    TORCH_CHECK(false, msg, ". Raise --memory-gb, add --offload, or more ranks");
  }
  fmt::print("{}", planner::search_report(model, cluster, o, r, a.json));
  for (const auto& s : split_list(a.compare)) {
    planner::SearchOptions one = o;
    one.max_tensor(1).max_sequence(1).max_pipeline(1).specs({parallel::ShardingSpec::parse(s)}).top(1);
    const planner::SearchResult best = planner::search(model, cluster, one);
    if (a.json) {
      fmt::print("{{\"compare\": \"{}\", \"estimate\": {}}}\n", s,
                 best.best.empty() ? (best.over.empty() ? std::string("null") : best.over.front().to_json())
                                   : best.best.front().to_json());
    } else if (best.best.empty()) {
      fmt::print("compare {}: does not fit{}\n", s, best.over.empty() ? "" : " (" + best.over.front().why + ")");
    } else {
      fmt::print("compare {}: {}\n", s, best.best.front().summary());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  cli::Command c = command(a);
  try {
    const cli::Parsed parsed = c.parse(argc, argv);
    if (!parsed.run) {
      fmt::print("{}", parsed.text);
      return 0;
    }
    return run(a, c);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "tessera_plan: error: {}\n", e.what_without_backtrace());
    return 1;
  }
}
