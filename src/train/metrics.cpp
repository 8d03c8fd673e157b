#include "tessera/train/metrics.h"

#include "tessera/models/gpt.h"
#include "tessera/planner/model_desc.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace tessera {
namespace train {

MetricsLog::MetricsLog(bool enabled, const std::string& path) : enabled_(enabled) {
  if (!enabled_ || path.empty()) return;
  file_ = std::make_unique<std::ofstream>(path, std::ios::trunc);
  TORCH_CHECK(file_->good(), "metrics: cannot write ", path);
}

void MetricsLog::record(const std::string& kind, const std::vector<std::pair<std::string, double>>& fields) {
  record(kind, fields, {});
}

void MetricsLog::record(const std::string& kind, const std::vector<std::pair<std::string, double>>& fields,
                        const std::vector<std::pair<std::string, std::vector<double>>>& arrays) {
  if (!file_) return;
  nlohmann::ordered_json line;
  line["kind"] = kind;
  for (const auto& [name, value] : fields) line[name] = value;
  for (const auto& [name, values] : arrays) line[name] = values;
  *file_ << line.dump() << "\n";
  file_->flush();
}

void MetricsLog::print(const std::string& line) const {
  if (!enabled_) return;
  fmt::print("{}\n", line);
  std::fflush(stdout);
}

double gpt_flops_per_token(const models::GPTConfig& c, int64_t seq) {
  // One formula for every preset: the planner's (grouped-query attention,
  // SwiGLU, untied heads and experts included).
  return planner::ModelDesc::gpt(models::GPTConfig(c).context(std::max(c.context(), seq)), seq).flops_per_sequence() /
         static_cast<double>(seq);
}

double measured_matmul_flops(int64_t n, int repeats, const c10::Device& device, c10::ScalarType dtype) {
  // No draw from the process's generator: a run resumed from a checkpoint
  // measures this after restoring it, and must continue its random streams
  // bit for bit (Note [Random states in checkpoints]).
  // Small integers: exact in bf16 too.
  at::Tensor a = at::arange(n * n, at::kFloat).remainder(7).sub_(3).view({n, n}).to(device, dtype),
             b = a.t().contiguous();
  // Reading one element back waits for the product on an asynchronous device.
  at::mm(a, b)[0][0].item<double>();  // warm-up
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    at::Tensor c = at::mm(a, b);
    c[0][0].item<double>();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / best;
}

}  // namespace train
}  // namespace tessera
