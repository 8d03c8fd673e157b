#include "tessera/planner/search.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace tessera {
namespace planner {
namespace {

using context::TensorMode;

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

parallel::Placement placement_of(int degree, int dp) {
  if (degree == 1) return parallel::Placement::replicate();
  if (degree == dp) return parallel::Placement::shard();
  return parallel::Placement::partial_shard(degree);
}

// Tensor sizes of a mode: 1d any, 2d q², 2.5d q²·d (d ≥ 2), 3d q³.
std::vector<std::pair<int, int>> tensor_sizes(TensorMode mode, int max_tp) {  // (size, depth)
  std::vector<std::pair<int, int>> out;
  for (int q = 2; q <= max_tp; ++q) {
    if (mode == TensorMode::k2D && q * q <= max_tp) out.emplace_back(q * q, 1);
    if (mode == TensorMode::k3D && q * q * q <= max_tp) out.emplace_back(q * q * q, 1);
    if (mode == TensorMode::k2p5D)
      for (int d = 2; q * q * d <= max_tp; ++d) out.emplace_back(q * q * d, d);
  }
  if (mode == TensorMode::k1D)
    for (int t = 2; t <= max_tp; t *= 2) out.emplace_back(t, 1);
  return out;
}

}  // namespace

std::vector<parallel::ShardingSpec> amsp_specs(int dp, int data_per_node) {
  std::vector<int> degrees;
  for (int d : divisors(dp))
    if (data_per_node % d == 0 || d % data_per_node == 0) degrees.push_back(d);
  std::vector<parallel::ShardingSpec> out;
  for (int p : degrees)
    for (int g : degrees)
      for (int o : degrees) {
        if (!(p <= g && g <= o && g % p == 0 && o % g == 0)) continue;
        parallel::ShardingSpec s;
        s.params = placement_of(p, dp);
        s.grads = placement_of(g, dp);
        s.optim_states = placement_of(o, dp);
        out.push_back(s);
      }
  return out;
}

SearchResult search(const ModelDesc& model, const ClusterDesc& cluster, const SearchOptions& options) {
  TORCH_CHECK(options.global_batch() > 0, "search: global batch must be positive, got ", options.global_batch());
  TORCH_CHECK(options.top() > 0, "search: top must be positive, got ", options.top());
  const int world = cluster.world();
  const double limit = options.memory_limit() > 0 ? options.memory_limit() : cluster.memory_bytes;
  const auto tensor_modes = options.tensor_modes().empty() ? std::vector<TensorMode>{TensorMode::k1D} : options.tensor_modes();
  const auto sequence_modes = options.sequence_modes().empty()
                                  ? std::vector<context::SequenceMode>{context::SequenceMode::kUlysses}
                                  : options.sequence_modes();
  const auto schedules =
      options.schedules().empty()
          ? std::vector<parallel::ScheduleKind>{parallel::ScheduleKind::k1F1B, parallel::ScheduleKind::kInterleaved1F1B,
                                                parallel::ScheduleKind::kZeroBubbleH1,
                                                parallel::ScheduleKind::kZeroBubbleV}
          : options.schedules();
  const int max_tp = model.opaque() ? 1 : (options.max_tensor() > 0 ? options.max_tensor() : cluster.gpus_per_node);
  const int max_sp = model.opaque() ? 1 : std::max(1, options.max_sequence());
  const int max_pp = model.opaque() ? 1 : (options.max_pipeline() > 0 ? options.max_pipeline() : world);

  // Grids: (tensor config, sequence config) pairs.
  std::vector<context::ParallelConfig> grids;
  std::vector<context::ParallelConfig> tensors = {context::ParallelConfig()};
  for (TensorMode mode : tensor_modes)
    for (auto [t, d] : tensor_sizes(mode, max_tp))
      tensors.push_back(context::ParallelConfig().tensor(t).tensor_mode(mode).tensor_depth(d));
  for (const auto& t : tensors)
    for (int sp : divisors(world)) {
      if (sp > max_sp) continue;
      for (auto smode : sequence_modes) {
        if (sp == 1 && smode != sequence_modes.front()) continue;
        for (int pp : divisors(world)) {
          if (pp > max_pp || world % (t.tensor() * sp * pp) != 0) continue;
          const int dp = world / (t.tensor() * sp * pp);
          for (int ep : divisors(dp)) {
            if (ep > 1 && (model.experts() == 0 || model.experts() % ep != 0)) continue;
            if (options.expert() > 0 && ep != options.expert() && model.experts() > 0) continue;
            const auto grid =
                context::ParallelConfig(t).sequence(sp).sequence_mode(smode).pipeline(pp).data(dp).expert(ep);
            if (smode != context::SequenceMode::kHybrid || sp == 1) {
              grids.push_back(grid);
              continue;
            }
            // Hybrid: every Ulysses size that leaves a ring of at least 2.
            for (int u : divisors(sp))
              if (u > 1 && u < sp) grids.push_back(context::ParallelConfig(grid).sequence_ulysses(u));
          }
        }
      }
    }

  SearchResult result;
  auto keep = [&](std::vector<Estimate>& list, Estimate e, size_t n) {
    list.push_back(std::move(e));
    std::sort(list.begin(), list.end(), [](const Estimate& a, const Estimate& b) { return a.step_s < b.step_s; });
    if (list.size() > n) list.pop_back();
  };
  for (const auto& g : grids) {
    const int dp = g.data();
    if (options.global_batch() % dp != 0) continue;
    const int64_t replica = options.global_batch() / dp;
    const int data_per_node = std::max(1, std::min(dp, cluster.gpus_per_node / (g.tensor() * g.sequence())));
    const auto specs = options.specs().empty() ? amsp_specs(dp * g.sequence(), data_per_node * g.sequence())
                                             : options.specs();
    std::vector<int64_t> mbs;
    for (int64_t m = g.pipeline() > 1 ? g.pipeline() : 1; m <= std::min(replica, options.max_micro_batches()); m *= 2)
      if (replica % m == 0) mbs.push_back(m);
    for (const auto& spec : specs)
      for (int64_t m : mbs)
        for (auto kind : (g.pipeline() > 1 ? schedules : std::vector<parallel::ScheduleKind>{parallel::ScheduleKind::k1F1B}))
          for (bool ckpt : {false, true}) {
            if (ckpt && !options.checkpointing()) continue;
            for (int variant = 0; variant < 4; ++variant) {
              const bool offload = variant & 1, etp = variant & 2;
              if (offload && !options.offload()) continue;
              // Expert tensor parallelism: tried where the tensor group is 1D and there are experts.
              if (etp && !(g.tensor() > 1 && g.tensor_mode() == TensorMode::k1D && model.experts() > 0)) continue;
              Plan plan;
              plan.grid = g;
              plan.spec = spec;
              plan.global_batch = options.global_batch();
              plan.micro_batches = m;
              plan.schedule = kind;
              plan.chunks = kind == parallel::ScheduleKind::kInterleaved1F1B || parallel::runs_in_a_v(kind) ? 2 : 1;
              plan.checkpoint_activations = ckpt;
              plan.offload = offload ? parallel::Offload::kHost : parallel::Offload::kNone;
              plan.bf16 = options.bf16();
              plan.expert_tensor_parallel = etp;
              plan = on_nodes(plan, cluster.gpus_per_node);
              ++result.considered;
              try {
                check_plan(model, plan);
              } catch (const c10::Error&) {
                ++result.invalid;
                continue;
              }
              if (predict_memory(model, plan).peak() > limit) {
                ++result.over_memory;
                if (result.over.size() < 3 || result.best.empty())
                  keep(result.over, estimate(model, plan, cluster, limit), 3);
                continue;
              }
              keep(result.best, estimate(model, plan, cluster, limit), static_cast<size_t>(options.top()));
            }
          }
  }
  return result;
}

}  // namespace planner
}  // namespace tessera
