#include "tessera/planner/plan.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace tessera {
namespace planner {

int Plan::world() const { return grid.data() * grid.pipeline() * grid.tensor() * grid.sequence(); }

int Plan::pipeline_rank_of(int stage) const {
  const int pp = grid.pipeline();
  return parallel::runs_in_a_v(schedule) && stage >= pp ? 2 * pp - 1 - stage : stage % pp;
}

int64_t Plan::replica_batch() const {
  TORCH_CHECK(grid.data() > 0, "plan: the data size must be resolved (> 0)");
  return global_batch / grid.data();
}

int64_t Plan::micro_batch_rows() const { return replica_batch() / micro_batches; }

std::string Plan::to_string() const {
  std::string s = fmt::format("dp{} pp{} tp{}({}) sp{}", grid.data(), grid.pipeline(), grid.tensor(),
                              context::tensor_mode_name(grid.tensor_mode()), grid.sequence());
  if (grid.sequence() > 1) {
    s += "(" + context::sequence_mode_name(grid.sequence_mode());
    if (grid.sequence_mode() == context::SequenceMode::kHybrid) s += fmt::format(" u{}", grid.sequence_ulysses());
    s += ")";
  }
  if (grid.expert() > 1) s += fmt::format(" ep{}", grid.expert());
  if (expert_tensor_parallel && grid.tensor() > 1) s += " etp";
  s += " " + spec.to_string() + fmt::format(" mb{}", micro_batches);
  if (grid.pipeline() > 1) {
    s += " " + parallel::to_string(schedule);
    if (chunks > 1) s += fmt::format("x{}", chunks);
  }
  if (checkpoint_activations) s += " ckpt";
  if (offload != parallel::Offload::kNone) s += " offload";
  s += bf16 ? " bf16" : " fp32";
  return s;
}

std::string Plan::to_json() const {
  nlohmann::json j{{"dp", grid.data()},
                   {"pp", grid.pipeline()},
                   {"tp", grid.tensor()},
                   {"tp_mode", context::tensor_mode_name(grid.tensor_mode())},
                   {"tp_depth", grid.tensor_depth()},
                   {"sp", grid.sequence()},
                   {"sp_mode", context::sequence_mode_name(grid.sequence_mode())},
                   {"sp_ulysses", grid.sequence_ulysses()},
                   {"ep", grid.expert()},
                   {"expert_tensor_parallel", expert_tensor_parallel},
                   {"spec", spec.to_string()},
                   {"global_batch", global_batch},
                   {"micro_batches", micro_batches},
                   {"schedule", parallel::to_string(schedule)},
                   {"chunks", chunks},
                   {"checkpoint_activations", checkpoint_activations},
                   {"offload", offload != parallel::Offload::kNone},
                   {"bf16", bf16}};
  return j.dump();
}

}  // namespace planner
}  // namespace tessera
