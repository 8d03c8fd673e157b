#include "tessera/planner/report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace tessera {
namespace planner {

std::string breakdown(const Estimate& e) {
  std::string s = fmt::format(
      "    memory per rank: params {:.4g} GB, grads {:.4g} GB, optimizer {:.4g} GB{}, activations {:.4g} GB "
      "({} micro-batches in flight), buffers {:.4g} GB\n",
      e.memory.params / 1e9, e.memory.grads / 1e9, e.memory.optim / 1e9,
      e.memory.host > 0 ? fmt::format(" (+{:.4g} GB in host memory)", e.memory.host / 1e9) : "",
      e.memory.activations / 1e9, e.memory.inflight, e.memory.buffers / 1e9);
  s += fmt::format("    time: compute {:.4g} s, pipeline makespan {:.4g} s (bubble {:.1f}%), data-parallel exposed "
                   "{:.4g} s, optimizer {:.4g} s\n",
                   e.compute_s, e.pipeline_s, 100 * e.bubble, e.data_exposed_s, e.optimizer_s);
  for (const auto& x : e.traffic.items())
    s += fmt::format("    {:<10} {:<22} {:<15} ranks {:>4} nodes {:>4}  calls {:>6.0f}  {:>10.4g} MB traced  "
                     "{:>10.4g} MB on the wire{}\n",
                     x.component, x.group, comm::op_type_name(x.op), x.size, x.nodes, x.calls, x.bytes / 1e6,
                     x.bus_bytes / 1e6, x.overlapped ? "  (overlaps compute)" : "");
  return s;
}

std::string why_first(const Estimate& first, const Estimate& second) {
  return fmt::format("{:.3g} s less per step ({:+.3g} s pipeline, {:+.3g} s exposed data traffic, {:+.3g} s "
                     "optimizer), {:+.4g} GB memory",
                     second.step_s - first.step_s, first.pipeline_s - second.pipeline_s,
                     first.data_exposed_s - second.data_exposed_s, first.optimizer_s - second.optimizer_s,
                     (first.memory.peak() - second.memory.peak()) / 1e9);
}

std::string search_report(const ModelDesc& model, const ClusterDesc& cluster, const SearchOptions& options,
                          const SearchResult& result, bool json) {
  std::string s;
  if (!json) {
    const double limit = options.memory_limit() > 0 ? options.memory_limit() : cluster.memory_bytes;
    s += fmt::format("model:   {}\ncluster: {} ({} nodes x {} ranks, {:.4g} GB limit, {:.4g} of {:.4g} TFLOPS per "
                     "rank)\n",
                     model.to_string(), cluster.name, cluster.nodes, cluster.gpus_per_node, limit / 1e9,
                     cluster.compute_rate() / 1e12, cluster.peak_flops / 1e12);
    s += fmt::format("batch:   {} sequences ({} tokens) per step, {}\n", options.global_batch(),
                     options.global_batch() * model.seq(), options.bf16() ? "bf16 with fp32 masters" : "fp32");
    s += fmt::format("searched {} plans: {} over the memory limit, {} not runnable\n\n", result.considered,
                     result.over_memory, result.invalid);
  }
  for (size_t i = 0; i < result.best.size(); ++i) {
    const Estimate& e = result.best[i];
    if (json) {
      s += fmt::format("{{\"rank\": {}, \"estimate\": {}}}\n", i + 1, e.to_json());
    } else {
      s += fmt::format("{}. {}\n", i + 1, e.summary());
      if (i == 0) s += breakdown(e);
    }
  }
  if (result.best.size() > 1) {
    const std::string why = why_first(result.best[0], result.best[1]);
    s += json ? fmt::format("{{\"why\": {}}}\n", nlohmann::json(why).dump()) : "\nwhy 1 over 2: " + why + "\n";
  }
  return s;
}

}  // namespace planner
}  // namespace tessera
