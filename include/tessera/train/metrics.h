#pragma once
// What a training run reports while it runs: a progress line per step on
// stdout and one JSON object per step in a JSONL file (rank 0 only), which
// scripts/plot_metrics.py turns into a PNG of loss and throughput.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace models {
struct GPTConfig;
}
namespace train {

class MetricsLog {
 public:
  // Writes only where `enabled` (rank 0); an empty path writes no file.
  MetricsLog(bool enabled, const std::string& path);

  // {"kind": kind, "<name>": value, ...} as one line of the file.
  void record(const std::string& kind, const std::vector<std::pair<std::string, double>>& fields);
  // The same with arrays beside the numbers: {"kind": kind, ..., "<name>": [v, ...]}.
  void record(const std::string& kind, const std::vector<std::pair<std::string, double>>& fields,
              const std::vector<std::pair<std::string, std::vector<double>>>& arrays);
  void print(const std::string& line) const;
  bool enabled() const { return enabled_; }

 private:
  bool enabled_;
  std::unique_ptr<std::ofstream> file_;
};

// Model FLOPs of one training token of a GPT (any preset) at sequence length
// `seq`: 6·N (forward and backward through every weight matrix a token uses:
// in a MoE block its router and top_k experts; norms, biases and the
// position table left out) + 12·L·(heads · head_dim)·seq (attention scores
// and values), the formula of Kaplan et al. / PaLM's MFU
// (planner::ModelDesc::flops_per_sequence). Recomputation (activation
// checkpointing) is not counted: MFU counts model FLOPs only.
double gpt_flops_per_token(const models::GPTConfig& config, int64_t seq);

// The FLOP/s this rank reaches on a matrix product of side `n` in `dtype`
// (best of `repeats`) on `device`: the peak an MFU figure is taken against.
// Pass the dtype the model computes in: a GPU's bf16 peak is many times its
// float32 one, and MFU against the wrong one passes 100 %.
// Call it on all ranks at once, so that ranks sharing cores measure their share.
double measured_matmul_flops(int64_t n = 512, int repeats = 5, const c10::Device& device = c10::Device(c10::kCPU),
                             c10::ScalarType dtype = c10::kFloat);

}  // namespace train
}  // namespace tessera
