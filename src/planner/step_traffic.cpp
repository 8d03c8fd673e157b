// The per-step parts of the traffic model: parameters per rank, data
// parallelism and sharding, the pipeline's messages, and the sum over a
// rank's stages and micro-batches (traffic.h).
#include "tessera/planner/traffic.h"

#include "grid_math.h"

#include "tessera/comm/hierarchical_communicator.h"
#include "tessera/parallel/bucket_size.h"
#include "tessera/parallel/pipeline_schedule.h"
#include "tessera/parallel/sharding_spec.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

namespace tessera {
namespace planner {
namespace {

using comm::OpType;
using context::ParallelMode;
using context::TensorMode;
using detail::pad_to;

double element_bytes(const Plan& plan) { return plan.bf16 ? 2.0 : 4.0; }

// The degrees chain {1, s_p, s_g, s_os} over a group of n (Note [Nested shard layout]).
std::vector<int> chain_of(const parallel::ShardDegrees& d) {
  std::vector<int> c = {1, d.params, d.grads, d.optim};
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  return c;
}

int level_of(const std::vector<int>& chain, int degree) {
  return static_cast<int>(std::find(chain.begin(), chain.end(), degree) - chain.begin());
}

std::string level_group(const std::string& base, const std::vector<int>& chain, int level) {
  return base + ".shard" + std::to_string(chain[level - 1]) + "-" + std::to_string(chain[level]);
}

// One bucket set of `numel` elements sharded by `spec` over a group of n
// ranks named `base` (the data group, or expert_data for experts).
// Buckets: one per unit (layer) once anything is sharded, else DDP's
// buckets (1 MiB, then 25 MiB; route_through_hosts makes them smaller where
// they reduce by host); each collective below runs once per bucket, with
// the mean bucket's size.
void sharded_traffic(const Plan& plan, ParallelMode mode, const std::string& base, int n, double numel,
                     double gathers, double units, bool prefetched, Traffic& out) {
  if (numel <= 0 || n <= 1) return;
  const parallel::ShardDegrees d = plan.spec.resolve(n);
  const std::vector<int> chain = chain_of(d);
  const double e = element_bytes(plan);
  const bool sharded = d.optim > 1;
  // DDP's buckets: the first of 1 MiB, then 25 MiB (Note [The first bucket]).
  const double buckets =
      sharded ? std::max(1.0, units)
              : static_cast<double>(parallel::bucket_count(static_cast<int64_t>(numel * e), parallel::kDdpBucketBytes));
  auto level_op = [&](const std::string& comp, int level, OpType op, double times, bool overlapped) {
    out.add(comp, mode, level_group(base, chain, level), chain[level] / chain[level - 1], op, times * buckets,
            numel / chain[level - 1] / buckets, e, overlapped);
  };
  // Sharded parameters: gathered before forward and again before backward,
  // the next unit prefetched while one computes.
  for (int i = 1; i <= level_of(chain, d.params); ++i) level_op("params", i, OpType::kAllGather, gathers, prefetched);
  // Gradients into their placement during backward.
  if (d.grads == 1) {
    out.add("grads", mode, base, n, OpType::kAllReduce, buckets, numel / buckets, e, true);
  } else {
    for (int i = 1; i <= level_of(chain, d.grads); ++i) level_op("grads", i, OpType::kReduceScatter, 1, true);
    if (d.grads < n)
      out.add("grads", mode, base + ".replica" + std::to_string(d.grads), n / d.grads, OpType::kAllReduce, buckets,
              numel / d.grads / buckets, e, true);
  }
  // Updated optimizer shards back to the parameters' placement, after the step.
  for (int i = level_of(chain, d.optim); i > level_of(chain, d.params); --i)
    level_op("optimizer", i, OpType::kAllGather, 1, false);
}

}  // namespace

LocalParams local_params(const ModelDesc& model, const Plan& plan, int pp_rank) {
  return local_params(model, plan, stages_of(model, plan, pp_rank));
}

LocalParams local_params(const ModelDesc& model, const Plan& plan, const std::vector<StageShape>& stages) {
  LocalParams lp;
  if (model.opaque()) {
    lp.dense = static_cast<double>(model.params());
    return lp;
  }
  const auto& c = plan.grid;
  const int tp = c.tensor();
  const double h = static_cast<double>(model.hidden()), f = static_cast<double>(model.ffn_width());
  const double a = static_cast<double>(model.attention_width()), kv = static_cast<double>(model.kv_width());
  const double d = static_cast<double>(model.head_size());
  const int m = model.mlp_matrices();
  const double norm = static_cast<double>(model.norm_params());
  const bool one_d = c.tensor_mode() == TensorMode::k1D;
  const int q = detail::rank_grid(c).q(), depth = c.tensor_mode() == TensorMode::k2p5D ? c.tensor_depth() : 1;
  // Matrices split over the tensor group (2.5D: replicated over depth);
  // vectors over the hidden blocks (q), whole in 1D except column biases.
  const double mat_div = detail::rank_grid(c).hidden_blocks(), vec_div = one_d ? 1 : q;
  // 1D with fewer kv heads than ranks holds one kv head per rank (Note
  // [Replicated key/value heads]): counted here as mat_div (and tp) times
  // that head, so that the divisions below leave one.
  const bool kv_replicated = one_d && (kv / d) < tp;
  const double kv_rows = kv_replicated ? 2 * d * tp : 2 * kv;
  const double attn_w = 2 * h * a + h * kv_rows, mlp_w = m * h * f;
  // Column-parallel biases (qkv, fc/gate/up) and row-parallel ones (the two output projections).
  const double attn_col_b = model.qkv_bias() ? a + kv_rows : 0, attn_row_b = model.bias() ? h : 0;
  const double mlp_col_b = model.bias() ? (m - 1) * f : 0, mlp_row_b = model.bias() ? h : 0;
  // Qwen 3's per-head norms: whole on every rank, partial over every tensor group.
  const double head_norm = model.qk_norm() ? 2 * d : 0;
  const int64_t vocab_unit = detail::rank_grid(c).vocab_unit();
  double weights = 0, col_b = 0, replicated = 0, head_norms = 0;  // this rank's, unsplit by vec_div for vectors
  bool has_embed = false;  // a tied head beside the embedding (pp 1, or the V's rank 0) shares its table
  for (const StageShape& st : stages) has_embed = has_embed || st.embed;
  for (const StageShape& st : stages) {
    for (int64_t b = st.first_block; b < st.first_block + st.blocks; ++b) {
      weights += attn_w / mat_div;
      col_b += attn_col_b;
      head_norms += head_norm;
      replicated += 2 * norm + attn_row_b;
      if (model.moe_block(b)) {
        lp.dense += model.router_params();
        // Expert tensor parallelism splits the matrices and column biases
        // over the tensor group; c_proj's bias stays whole.
        const double etp = plan.expert_tensor_parallel ? tp : 1;
        lp.expert += static_cast<double>(model.experts() / c.expert()) * ((mlp_w + mlp_col_b) / etp + mlp_row_b);
      } else {
        weights += mlp_w / mat_div;
        col_b += mlp_col_b;
        replicated += mlp_row_b;
      }
    }
    const double table = static_cast<double>(pad_to(model.vocab(), vocab_unit)) * h / mat_div;
    if (st.embed) {
      weights += table;
      replicated += static_cast<double>(model.positions()) * h;
    }
    if (st.head) {
      replicated += norm;
      if (!model.tied() || !has_embed) weights += table;
    }
  }
  const double col = one_d ? col_b / tp : col_b / vec_div, rep = replicated / vec_div;
  const double hn = head_norms;
  lp.dense += weights + col + rep + hn;
  switch (c.tensor_mode()) {
    case TensorMode::k1D:
      if (hn > 0 && tp > 1) lp.partial = {{ParallelMode::kTensor, hn}};
      break;
    case TensorMode::k2D:
      lp.partial = {{ParallelMode::k2DCol, col + rep + hn}};
      if (hn > 0) lp.partial.emplace_back(ParallelMode::k2DRow, hn);
      break;
    case TensorMode::k2p5D:
      lp.partial = {{ParallelMode::k2p5DCol, col + rep + hn}};
      if (hn > 0) lp.partial.emplace_back(ParallelMode::k2p5DRow, hn);
      if (depth > 1) lp.partial.emplace_back(ParallelMode::k2p5DDep, weights + col + rep + hn);
      break;
    case TensorMode::k3D:  // Linear3D's bias is partial over its output and weight groups
      lp.partial = {{ParallelMode::k3DInput, rep + hn},
                    {ParallelMode::k3DOutput, col + hn},
                    {ParallelMode::k3DWeight, col + rep + hn}};
      break;
  }
  return lp;
}

void data_traffic(const ModelDesc& model, const Plan& plan, int pp_rank, Traffic& out) {
  const auto& c = plan.grid;
  const LocalParams lp = local_params(model, plan, pp_rank);
  // Under a pipeline, sharded parameters are gathered around each compute
  // action (Note [ZeRO-3 under a pipeline]): a stage's units once per F, B,
  // I and W of the schedule; a tied head gathers the embedding's whole unit
  // (the table and the positions), also on the embedding's rank; as
  // gathers of the rank's parameters, a weighted count per kind of
  // parameter. Gradient accumulation without a pipeline keeps them gathered
  // over its micro-batches: once for forward, once for backward.
  double gathers = 2.0, expert_gathers = 2.0;
  if (c.pipeline() > 1) {
    const auto schedule =
        parallel::make_schedule(plan.schedule, c.pipeline(), static_cast<int>(plan.micro_batches), plan.chunks);
    std::map<int, int> actions;  // stage -> compute actions
    for (const auto& a : schedule.ranks[pp_rank]) actions[a.stage] += a.is_compute();
    double dense = 0, expert = 0;
    for (const StageShape& st : stages_of(model, plan, pp_rank)) {
      std::vector<StageShape> gathered{st};
      if (model.tied() && st.head && !st.embed) gathered.push_back(StageShape{st.stage, 0, 0, true, false});
      const LocalParams one = local_params(model, plan, gathered);
      dense += actions[st.stage] * one.dense;
      expert += actions[st.stage] * one.expert;
    }
    gathers = lp.dense > 0 ? dense / lp.dense : 0;
    expert_gathers = lp.expert > 0 ? expert / lp.expert : 0;
  }
  double units = 0;
  for (const StageShape& st : stages_of(model, plan, pp_rank))
    units += static_cast<double>(st.blocks) + (st.embed ? 1 : 0) + (st.head ? 1 : 0);
  // Layers that share a parameter (a tied embedding without a pipeline) are
  // gathered all at once before the forward: nothing to prefetch behind.
  const bool prefetched = !(model.tied() && c.pipeline() == 1);
  if (c.sequence() > 1) {
    const int n = c.data() * c.sequence();
    sharded_traffic(plan, ParallelMode::kDataSequence, detail::mode_group(ParallelMode::kDataSequence), n, lp.dense,
                    gathers, units, prefetched, out);
  } else {
    sharded_traffic(plan, ParallelMode::kData, detail::mode_group(ParallelMode::kData), c.data(), lp.dense, gathers,
                    units, prefetched, out);
  }
  if (lp.expert > 0)
    sharded_traffic(plan, ParallelMode::kExpertData, detail::mode_group(ParallelMode::kExpertData),
                    c.data() / c.expert(), lp.expert, expert_gathers, static_cast<double>(model.moe_blocks()),
                    prefetched, out);
  const parallel::ShardDegrees d = plan.spec.resolve(c.data());
  for (const auto& [mode, numel] : lp.partial) {
    const int n = context::RankGrid(c, plan.world()).group_size(mode);
    out.add("partial", mode, detail::mode_group(mode), n, OpType::kAllReduce, 1, numel / d.grads, element_bytes(plan));
  }
}

void pipeline_traffic(const ModelDesc& model, const Plan& plan, int pp_rank, Traffic& out) {
  const auto& c = plan.grid;
  const int pp = c.pipeline();
  if (pp == 1 || model.opaque()) return;
  const int stages = pp * plan.chunks;
  // An activation [rows, s, h] in each rank's layout: replicated over 1D
  // tensor ranks, split by the other tensor modes and by sequence ranks.
  const double rows = static_cast<double>(plan.micro_batch_rows());
  const double split = c.sequence() * (c.tensor_mode() == TensorMode::k1D ? 1 : c.tensor());
  const double act = rows * model.seq() * model.hidden() / split;
  const double m = static_cast<double>(plan.micro_batches), e = element_bytes(plan);
  const std::string g = detail::mode_group(ParallelMode::kPipeline);
  for (const StageShape& st : stages_of(model, plan, pp_rank)) {
    // Hand-overs between two stages of one rank are local (the interleaved
    // wrap-around with pp 1, the V's turn on rank pp - 1).
    const bool next_remote = st.stage + 1 < stages && plan.pipeline_rank_of(st.stage + 1) != pp_rank;
    const bool prev_remote = st.stage > 0 && plan.pipeline_rank_of(st.stage - 1) != pp_rank;
    if (next_remote) {
      out.add("pipeline", ParallelMode::kPipeline, g, pp, OpType::kSend, m, act, e);
      out.add("pipeline", ParallelMode::kPipeline, g, pp, OpType::kRecv, m, act, e);
    }
    if (prev_remote) {
      out.add("pipeline", ParallelMode::kPipeline, g, pp, OpType::kRecv, m, act, e);
      out.add("pipeline", ParallelMode::kPipeline, g, pp, OpType::kSend, m, act, e);
    }
  }
  // The tied token embedding lives on the first and the last stage; their
  // gradients are summed between the two after the schedule.
  if (model.tied()) {
    bool holds = false;
    for (const StageShape& st : stages_of(model, plan, pp_rank)) holds = holds || st.embed || st.head;
    const int first = 0, last = plan.pipeline_rank_of(stages - 1);
    if (holds && first != last) {
      out.add("pipeline", ParallelMode::kPipeline, "pipeline.tied", 2, OpType::kAllReduce, 1,
              static_cast<double>(pad_to(model.vocab(), detail::rank_grid(c).vocab_unit()) * model.hidden()) /
                  detail::rank_grid(c).hidden_blocks(),
              e);
    }
  }
}

Traffic predict_traffic(const ModelDesc& model, const Plan& plan, int global_rank) {
  const context::RankGrid grid(plan.grid, plan.world());
  const int pp_rank = grid.coordinate(context::Dim::kPipeline, global_rank);
  Traffic out;
  data_traffic(model, plan, pp_rank, out);
  pipeline_traffic(model, plan, pp_rank, out);
  if (!model.opaque()) {
    const auto& c = plan.grid;
    const StageShape none;
    const TrafficInput in{model, plan, none, static_cast<double>(plan.micro_batch_rows()), element_bytes(plan)};
    for (const StageShape& st : stages_of(model, plan, pp_rank)) {
      TrafficInput one{model, plan, st, in.rows, in.act_bytes};
      Traffic mb;
      if (c.sequence() > 1) sequence_traffic(c.sequence_mode())(one, mb);
      tensor_traffic(c.tensor_mode())(one, mb);  // at tensor size 1, the cross entropy's sums only
      expert_traffic(one, mb);
      for (Collective& x : mb.items()) {
        x.calls *= plan.micro_batches;
        x.bytes *= plan.micro_batches;
        x.bus_bytes *= plan.micro_batches;
        bool merged = false;
        for (Collective& y : out.items()) {
          if (y.component == x.component && y.group == x.group && y.op == x.op && y.overlapped == x.overlapped) {
            y.calls += x.calls;
            y.bytes += x.bytes;
            y.bus_bytes += x.bus_bytes;
            merged = true;
            break;
          }
        }
        if (!merged) out.items().push_back(x);
      }
    }
  }
  return out;
}

void place(Traffic& traffic, const Plan& plan, int gpus_per_node, int global_rank) {
  const context::RankGrid grid(plan.grid, plan.world());
  auto span = [&](const std::vector<int>& members, Collective& c) {
    std::map<int, int> per;
    for (int r : members) ++per[r / gpus_per_node];
    c.nodes = static_cast<int>(per.size());
    c.per_node = 0;
    for (const auto& kv : per) c.per_node = std::max(c.per_node, kv.second);
  };
  for (Collective& c : traffic.items()) {
    std::vector<int> members = grid.group_of(c.mode, global_rank);
    // Sub-groups of the data group: every `stride`-th member of a block.
    const auto shard = c.group.find(".shard");
    const auto replica = c.group.find(".replica");
    if (shard != std::string::npos) {
      const std::string range = c.group.substr(shard + 6);
      const int lo = std::stoi(range.substr(0, range.find('-')));
      const int hi = std::stoi(range.substr(range.find('-') + 1));
      const int me = grid.local_rank(c.mode, global_rank);
      std::vector<int> sub;
      const int base = me / hi * hi + me % lo;
      for (int k = 0; k < hi / lo; ++k) sub.push_back(members[base + k * lo]);
      members = sub;
    } else if (replica != std::string::npos) {
      const int k = std::stoi(c.group.substr(replica + 8));
      const int me = grid.local_rank(c.mode, global_rank);
      std::vector<int> sub;
      for (int i = me % k; i < static_cast<int>(members.size()); i += k) sub.push_back(members[i]);
      members = sub;
    } else if (c.group == "pipeline.tied") {
      members = {members.front(), members.back()};
    }
    span(members, c);
  }
}

void route_through_hosts(Traffic& traffic, const Plan& plan) {
  const std::string data = detail::mode_group(ParallelMode::kData);
  const double e = element_bytes(plan);
  Traffic routed;
  std::vector<Collective> kept;
  for (const Collective& x : traffic.items()) {
    const int n = x.size, per_node = x.per_node, hosts = x.nodes;
    double calls = x.calls;
    // DDP's gradient buckets where they reduce by host: Note [Buckets across hosts].
    if (x.component == "grads" && x.group == data && x.op == OpType::kAllReduce && hosts > 1 && per_node >= 2) {
      const auto bytes = static_cast<int64_t>(x.bytes);
      calls = static_cast<double>(parallel::bucket_count(bytes, parallel::default_bucket_bytes(bytes, true)));
    }
    const double m = calls > 0 ? x.bytes / calls / e : 0;  // elements per call
    const bool staged_op = x.op == OpType::kAllReduce || x.op == OpType::kReduceScatter || x.op == OpType::kAllGather;
    // The data group and its splits (ZeRO's shard levels, replica groups).
    const bool of_data = x.group == data || x.group.rfind(data + ".", 0) == 0;
    const double min_elements =
        x.op == OpType::kAllReduce ? static_cast<double>(comm::HierarchicalCommunicator::kMinElements) : 1;
    const bool routes = of_data && x.mode == ParallelMode::kData && staged_op && n >= 4 && hosts > 1 && per_node >= 2 &&
                        hosts * per_node == n && m >= min_elements;
    if (!routes) {
      kept.push_back(x);
      continue;
    }
    const double piece = std::ceil(m / n);
    if (x.op == OpType::kAllReduce) {
      for (OpType op : {OpType::kReduceScatter, OpType::kAllGather})
        routed.add(x.component, x.mode, x.group + ".host", per_node, op, calls, piece * n, e, x.overlapped);
    } else {  // Note [Scatters and gathers by host]: the same collective inside the host
      routed.add(x.component, x.mode, x.group + ".host", per_node, x.op, calls, m, e, x.overlapped);
    }
    const double steps = (x.op == OpType::kAllReduce ? 2.0 : 1.0) * (hosts - 1) * calls;
    for (OpType op : {OpType::kSend, OpType::kRecv})
      routed.add(x.component, x.mode, x.group + ".cross", hosts, op, steps, piece, e, x.overlapped);
  }
  for (Collective& y : routed.items()) {
    const bool cross = y.group.size() > 6 && y.group.compare(y.group.size() - 6, 6, ".cross") == 0;
    y.nodes = cross ? y.size : 1;
    y.per_node = cross ? 1 : y.size;
    kept.push_back(y);
  }
  traffic.items() = std::move(kept);
}

int data_ranks_per_node(const Plan& plan, int gpus_per_node, int global_rank) {
  TORCH_CHECK(gpus_per_node >= 1, "plan: ranks per node must be >= 1, got ", gpus_per_node);
  const context::RankGrid grid(plan.grid, plan.world());
  const ParallelMode tokens = plan.grid.sequence() > 1 ? ParallelMode::kDataSequence : ParallelMode::kData;
  int on_node = 0;
  for (int r : grid.group_of(tokens, global_rank)) on_node += r / gpus_per_node == global_rank / gpus_per_node;
  return on_node;
}

Plan on_nodes(Plan plan, int gpus_per_node) {
  if (plan.spec.per_host()) plan.spec = plan.spec.on_hosts(data_ranks_per_node(plan, gpus_per_node));
  return plan;
}

}  // namespace planner
}  // namespace tessera
