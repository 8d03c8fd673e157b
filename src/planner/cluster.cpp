#include "tessera/planner/cluster.h"

#include "core/json_int.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

namespace tessera {
namespace planner {
namespace {

using Json = nlohmann::json;

const std::vector<comm::OpType>& collective_ops() {
  static const std::vector<comm::OpType> ops = {comm::OpType::kAllReduce,     comm::OpType::kBroadcast,
                                                comm::OpType::kReduce,        comm::OpType::kAllGather,
                                                comm::OpType::kReduceScatter, comm::OpType::kAllToAll,
                                                comm::OpType::kSend};
  return ops;
}

comm::OpType op_from_name(const std::string& name) {
  for (comm::OpType op : collective_ops())
    if (comm::op_type_name(op) == name) return op;
  TORCH_CHECK(false, "cluster: unknown collective '", name,
              "'; use all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, send or default");
}

double number(const Json& j, const std::string& key) {
  TORCH_CHECK(j.is_number(), "cluster: '", key, "' must be a number, got ", j.dump());
  const double v = j.get<double>();
  TORCH_CHECK(v >= 0, "cluster: '", key, "' must not be negative, got ", v);
  return v;
}

Link link_from_json(const Json& j, const std::string& where) {
  TORCH_CHECK(j.is_object(), "cluster: '", where, "' must be an object with bandwidth_gbs and latency_us");
  Link l;
  for (const auto& [key, value] : j.items()) {
    if (key == "bandwidth_gbs") {
      l.bandwidth = number(value, where + ".bandwidth_gbs") * 1e9;
    } else if (key == "latency_us") {
      l.latency = number(value, where + ".latency_us") * 1e-6;
    } else {
      TORCH_CHECK(false, "cluster: unknown key '", where, ".", key, "'; expected bandwidth_gbs, latency_us");
    }
  }
  TORCH_CHECK(l.bandwidth > 0, "cluster: '", where, ".bandwidth_gbs' must be given and positive");
  return l;
}

void links_from_json(const Json& j, const std::string& where, Link& fallback, std::map<comm::OpType, Link>& per_op) {
  TORCH_CHECK(j.is_object(), "cluster: '", where, "' must be an object of collectives");
  for (const auto& [key, value] : j.items()) {
    if (key == "default") {
      fallback = link_from_json(value, where + ".default");
    } else {
      per_op[op_from_name(key)] = link_from_json(value, where + "." + key);
    }
  }
}

Json link_json(const Link& l) { return Json{{"bandwidth_gbs", l.bandwidth / 1e9}, {"latency_us", l.latency * 1e6}}; }

}  // namespace

const Link& ClusterDesc::link(comm::OpType op, bool across_nodes) const {
  const auto& table = across_nodes ? inter : intra;
  auto it = table.find(op == comm::OpType::kRecv ? comm::OpType::kSend : op);
  if (it != table.end()) return it->second;
  return across_nodes ? inter_default : intra_default;
}

double latency_steps(comm::OpType op, int n) {
  if (n <= 1) return 0;
  const double log2n = std::ceil(std::log2(static_cast<double>(n)));
  switch (op) {
    case comm::OpType::kAllReduce:
      return 2 * log2n;
    case comm::OpType::kBroadcast:
    case comm::OpType::kReduce:
    case comm::OpType::kBarrier:
      return log2n;
    case comm::OpType::kSend:
    case comm::OpType::kRecv:
      return 1;
    default:
      return n - 1;
  }
}

double ClusterDesc::seconds(comm::OpType op, int ranks, double calls, double bus_bytes, int nodes_spanned,
                            int per_node) const {
  if (calls <= 0 || ranks <= 1) return 0;
  const double steps = calls * latency_steps(op, ranks);
  const Link& in = link(op, false);
  if (nodes_spanned <= 1) return steps * in.latency + bus_bytes / in.bandwidth;
  const Link& out = link(op, true);
  const double share = out.bandwidth * std::min(1.0, static_cast<double>(per_node) / gpus_per_node);
  return steps * std::max(in.latency, out.latency) + bus_bytes / std::min(in.bandwidth, share);
}

ClusterDesc ClusterDesc::from_json(const std::string& text) {
  Json root;
  try {
    root = Json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cluster: not valid JSON: ", e.what());
  }
  TORCH_CHECK(root.is_object(), "cluster: the description must be a JSON object");
  ClusterDesc c;
  for (const auto& [key, value] : root.items()) {
    if (key == "name") {
      TORCH_CHECK(value.is_string(), "cluster: 'name' must be a string");
      c.name = value.get<std::string>();
    } else if (key == "gpus_per_node" || key == "nodes") {
      TORCH_CHECK(value.is_number_integer() && value.get<int64_t>() >= 1, "cluster: '", key,
                  "' must be an integer >= 1, got ", value.dump());
      (key == "nodes" ? c.nodes : c.gpus_per_node) = value.get<int>();
    } else if (key == "compute_units") {
      TORCH_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0, "cluster: 'compute_units' must be an "
                  "integer >= 0 (0: one per rank), got ", value.dump());
      c.compute_units = value.get<int>();
    } else if (key == "block_overhead_us") {
      c.block_overhead = number(value, key) * 1e-6;
    } else if (key == "memory_gb") {
      c.memory_bytes = number(value, key) * 1e9;
    } else if (key == "peak_tflops") {
      c.peak_flops = number(value, key) * 1e12;
    } else if (key == "achieved_tflops") {
      c.achieved_flops = number(value, key) * 1e12;
    } else if (key == "memory_bandwidth_gbs") {
      c.memory_bandwidth = number(value, key) * 1e9;
    } else if (key == "host_bandwidth_gbs") {
      c.host_bandwidth = number(value, key) * 1e9;
    } else if (key == "host_optimizer_gbs") {
      c.host_flops = number(value, key) * 1e9;
    } else if (key == "overlap") {
      c.overlap = number(value, key);
      TORCH_CHECK(c.overlap <= 1, "cluster: 'overlap' is a fraction in [0, 1], got ", c.overlap);
    } else if (key == "message_overlap") {
      c.message_overlap = number(value, key);
      TORCH_CHECK(c.message_overlap <= 1, "cluster: 'message_overlap' is a fraction in [0, 1], got ",
                  c.message_overlap);
    } else if (key == "host_reductions") {
      TORCH_CHECK(value.is_boolean(), "cluster: 'host_reductions' must be true or false, got ", value.dump());
      c.host_reductions = value.get<bool>();
    } else if (key == "intra") {
      links_from_json(value, key, c.intra_default, c.intra);
    } else if (key == "inter") {
      links_from_json(value, key, c.inter_default, c.inter);
    } else {
      TORCH_CHECK(false, "cluster: unknown key '", key,
                  "'; expected name, gpus_per_node, nodes, compute_units, block_overhead_us, memory_gb, peak_tflops, "
                  "achieved_tflops, memory_bandwidth_gbs, host_bandwidth_gbs, host_optimizer_gbs, overlap, "
                  "message_overlap, host_reductions, intra, inter");
    }
  }
  TORCH_CHECK(c.peak_flops > 0, "cluster: 'peak_tflops' must be positive");
  TORCH_CHECK(c.memory_bytes > 0, "cluster: 'memory_gb' must be positive");
  return c;
}

namespace {
std::string read_text(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "cluster: cannot read '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
}  // namespace

double ClusterDesc::solo_rate() const {
  if (compute_units <= 0 || compute_units >= gpus_per_node) return compute_rate();
  return compute_rate() * gpus_per_node / compute_units;
}

ClusterDesc ClusterDesc::from_json_file(const std::string& path) { return from_json(read_text(path)); }

ClusterDesc ClusterDesc::from_comm_bench_file(const std::string& path, ClusterDesc base) {
  return from_comm_bench(read_text(path), std::move(base));
}

ClusterDesc ClusterDesc::load(const std::string& preset_or_file) {
  return preset_or_file.find(".json") != std::string::npos ? from_json_file(preset_or_file) : preset(preset_or_file);
}

ClusterDesc ClusterDesc::from_comm_bench(const std::string& jsonl, ClusterDesc base) {
  struct Seen {
    int64_t small_bytes = -1, large_bytes = -1;
    double small_us = 0, large_busbw = 0;
  };
  std::map<comm::OpType, Seen> seen;
  std::istringstream lines(jsonl);
  std::string line;
  int ranks = 0;
  int line_number = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    if (line.empty() || line[0] != '{') continue;
    Json j = Json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("op") || !j.contains("busbw_gbps")) continue;
    // A measurement line with a value missing or of the wrong type is
    // refused, not skipped: the plan would rest on the others alone.
    try {
      const comm::OpType op = op_from_name(j.at("op").get<std::string>());
      const int64_t bytes = json_int(j.at("bytes"));
      const double us = j.at("time_us").get<double>(), busbw = j.at("busbw_gbps").get<double>();
      if (j.contains("ranks")) ranks = static_cast<int>(json_int(j.at("ranks")));
      TORCH_CHECK(bytes > 0 && std::isfinite(us) && us >= 0 && std::isfinite(busbw) && busbw >= 0 && ranks >= 0,
                  "cluster: comm_bench line ", line_number, " has bytes ", bytes, ", time_us ", us, ", busbw_gbps ",
                  busbw, " and ranks ", ranks, ": sizes must be positive and times, rates and ranks not negative");
      Seen& s = seen[op];
      if (s.small_bytes < 0 || bytes < s.small_bytes) {
        s.small_bytes = bytes;
        s.small_us = us;
      }
      if (bytes > s.large_bytes) {
        s.large_bytes = bytes;
        s.large_busbw = busbw;
      }
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "cluster: comm_bench line ", line_number, " is not a line comm_bench --json writes (",
                  e.what(), "): ", line.substr(0, 200));
    }
  }
  TORCH_CHECK(!seen.empty(), "cluster: no comm_bench lines (run comm_bench --json)");
  base.intra.clear();
  for (const auto& [op, s] : seen) {
    TORCH_CHECK(s.large_busbw > 0, "cluster: comm_bench reports no bandwidth for ", comm::op_type_name(op));
    base.intra[op] = Link{s.large_busbw * 1e9, s.small_us * 1e-6 / std::max(1.0, latency_steps(op, ranks))};
  }
  base.intra_default = base.intra.count(comm::OpType::kAllReduce) ? base.intra.at(comm::OpType::kAllReduce)
                                                                   : base.intra.begin()->second;
  if (ranks > 0) base.gpus_per_node = std::max(base.gpus_per_node, ranks);
  return base;
}

ClusterDesc ClusterDesc::preset(const std::string& name) {
  ClusterDesc c;
  c.name = name;
  c.nodes = 128;
  c.gpus_per_node = 8;
  c.memory_bytes = 80e9;
  if (name == "a800-amsp") {
    // Note [Cluster presets] in docs/planner.md: NCCL bus bandwidth, not link
    // rates; 65% of peak for a transformer step's matmuls and attention.
    c.peak_flops = 312e12;
    c.achieved_flops = 0.65 * 312e12;
    c.memory_bandwidth = 2.0e12;
    c.host_bandwidth = 25e9;
    c.intra_default = {155e9, 3e-6};
    c.inter_default = {85e9, 6e-6};  // 4 × HDR 200 Gb/s = 100 GB/s per node, 85% of it
    return c;
  }
  if (name == "h100-1024") {
    c.peak_flops = 989e12;
    c.achieved_flops = 0.55 * 989e12;
    c.memory_bandwidth = 3.35e12;
    c.host_bandwidth = 50e9;
    c.intra_default = {360e9, 3e-6};
    c.inter_default = {340e9, 6e-6};  // 8 × NDR 400 Gb/s = 400 GB/s per node, 85% of it
    return c;
  }
  TORCH_CHECK(false, "cluster: unknown preset '", name, "'; presets: a800-amsp, h100-1024 (or a JSON file)");
}

std::string ClusterDesc::to_json() const {
  Json intra_j{{"default", link_json(intra_default)}}, inter_j{{"default", link_json(inter_default)}};
  for (const auto& [op, l] : intra) intra_j[comm::op_type_name(op)] = link_json(l);
  for (const auto& [op, l] : inter) inter_j[comm::op_type_name(op)] = link_json(l);
  Json j{{"name", name},
         {"gpus_per_node", gpus_per_node},
         {"nodes", nodes},
         {"compute_units", compute_units},
         {"block_overhead_us", block_overhead * 1e6},
         {"memory_gb", memory_bytes / 1e9},
         {"peak_tflops", peak_flops / 1e12},
         {"achieved_tflops", compute_rate() / 1e12},
         {"memory_bandwidth_gbs", memory_bandwidth / 1e9},
         {"host_bandwidth_gbs", host_bandwidth / 1e9},
         {"overlap", overlap},
         {"message_overlap", message_overlap},
         {"host_reductions", host_reductions},
         {"intra", intra_j},
         {"inter", inter_j}};
  if (host_flops > 0) j["host_optimizer_gbs"] = host_flops / 1e9;
  return j.dump();
}

}  // namespace planner
}  // namespace tessera
