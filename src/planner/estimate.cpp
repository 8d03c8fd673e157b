#include "tessera/planner/estimate.h"

#include "tessera/context/layout.h"
#include "tessera/parallel/pipeline_simulator.h"

#include "grid_math.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <vector>

namespace tessera {
namespace planner {
namespace {

using context::TensorMode;

// Forward FLOPs of one micro-batch on one rank's stage (matmuls and attention).
double stage_forward_flops(const ModelDesc& model, const Plan& plan, const StageShape& st) {
  const auto& c = plan.grid;
  if (model.opaque()) return model.opaque_flops_per_row() / 3.0 * plan.micro_batch_rows() / c.tensor();
  const double h = static_cast<double>(model.hidden()), s = static_cast<double>(model.seq());
  const double tokens = static_cast<double>(plan.micro_batch_rows()) * s;
  const double mlp = model.mlp_matrices() * h * model.ffn_width();
  const double a = static_cast<double>(model.attention_width());
  const double attention = 2 * h * a + 2 * h * static_cast<double>(model.kv_width());  // q, k, v, output
  // A MoE layer (router, routed and shared experts) runs whole on every
  // tensor rank, so its FLOPs are not split over the tensor group; with
  // expert tensor parallelism the routed experts' are.
  const double routed = model.top_k() * mlp / (plan.expert_tensor_parallel ? c.tensor() : 1);
  const double moe = routed + h * model.experts() +
                     model.mlp_matrices() * h * static_cast<double>(model.shared_expert_ffn()) +
                     (model.shared_expert_gate() ? h : 0.0);
  double flops = 0;
  for (int64_t b = st.first_block; b < st.first_block + st.blocks; ++b) {
    const double mlp_active = model.moe_block(b) ? moe * c.tensor() : mlp;
    flops += 2 * tokens * (attention + mlp_active) + 4 * tokens * s * a;
  }
  if (st.head) flops += 2 * tokens * model.vocab() * h;
  return flops / (c.tensor() * c.sequence());
}

}  // namespace

void check_plan(const ModelDesc& model, const Plan& plan) {
  const auto& c = plan.grid;
  context::resolve(c, plan.world());
  plan.spec.resolve(c.data() * c.sequence());
  // Expert states shard over the expert-data group (the data ranks holding
  // the same experts), which the spec must divide too.
  if (model.experts() > 0) plan.spec.resolve(c.data() / c.expert());
  TORCH_CHECK(plan.global_batch > 0 && plan.micro_batches > 0, "plan: batch and micro-batches must be positive");
  TORCH_CHECK(plan.global_batch % c.data() == 0, "plan: global batch ", plan.global_batch,
              " does not split over data size ", c.data());
  TORCH_CHECK(plan.replica_batch() % plan.micro_batches == 0, "plan: ", plan.replica_batch(),
              " sequences per replica do not split into ", plan.micro_batches, " micro-batches");
  TORCH_CHECK(plan.offload != parallel::Offload::kDisk, "plan: the planner does not model disk offload");
  TORCH_CHECK(!parallel::runs_in_a_v(plan.schedule) || plan.chunks == 2, "plan: the ",
              parallel::to_string(plan.schedule),
              " schedule runs two chunks per rank in a V, got chunks = ", plan.chunks, "; set chunks 2");
  TORCH_CHECK(plan.schedule != parallel::ScheduleKind::kDualPipeV || plan.micro_batches >= 2 * c.pipeline(),
              "plan: dualpipev needs at least ", 2 * c.pipeline(), " micro-batches for pp ", c.pipeline(), ", got ",
              plan.micro_batches);
  if (model.opaque()) {
    TORCH_CHECK(c.pipeline() == 1 && c.tensor() == 1 && c.sequence() == 1,
                "plan: a module seen only by its parameter count gets data parallelism only (dp × sharding)");
    return;
  }
  TORCH_CHECK(c.pipeline() * plan.chunks <= model.layers() + 2, "plan: ", c.pipeline() * plan.chunks,
              " pipeline stages for ", model.layers() + 2, " layers (embed, blocks, head)");
  // What the layers need of the shapes in this layout: the context's rules.
  context::check_shape(context::Layout(c).expert_tensor_parallel(plan.expert_tensor_parallel),
                       context::ModelShape()
                           .hidden(model.hidden())
                           .heads(model.heads())
                           .kv_heads(model.kv_heads())
                           .ffn(model.ffn_width())
                           .seq(model.seq())
                           .experts(model.experts())
                           .rows(plan.micro_batch_rows()));
}

Estimate estimate(const ModelDesc& model, const Plan& given, const ClusterDesc& cluster, double memory_limit) {
  const Plan plan = on_nodes(given, cluster.gpus_per_node);
  Estimate est;
  est.plan = plan;
  const auto& c = plan.grid;
  const context::RankGrid grid(c, plan.world());
  const double limit = memory_limit > 0 ? memory_limit : cluster.memory_bytes;
  est.memory = predict_memory(model, plan, 0);
  if (est.memory.peak() > limit) {
    est.fits = false;
    est.why = fmt::format("needs {:.2f} GB per rank, over the {:.2f} GB limit", est.memory.peak() / 1e9, limit / 1e9);
  }
  const double m = static_cast<double>(plan.micro_batches);
  // Each pipeline rank's figures; the slowest sets the step.
  struct PerRank {
    Traffic traffic;
    std::map<std::string, double> comm;
    double compute = 0, makespan = 0, bubble = 0, busy = 0, exposed = 0;
    double unmoved = 0;  // its messages across nodes, sent and received (Note [Messages nothing moves])
  };
  std::vector<PerRank> ranks(c.pipeline());
  for (int pp_rank = 0; pp_rank < c.pipeline(); ++pp_rank) {
    PerRank& r = ranks[pp_rank];
    std::array<int, context::kNumDims> coords{};
    coords[static_cast<int>(context::Dim::kPipeline)] = pp_rank;
    const int rank = grid.global_rank_at(coords);
    r.traffic = predict_traffic(model, plan, rank);
    place(r.traffic, plan, cluster.gpus_per_node, rank);
    if (cluster.host_reductions) route_through_hosts(r.traffic, plan);
    double fwd_flops = 0;
    const auto stages = stages_of(model, plan, pp_rank);
    for (const auto& st : stages) fwd_flops += stage_forward_flops(model, plan, st);
    const double chunks = static_cast<double>(stages.size());
    double blocking_mb = 0, data_overlapped = 0, data_blocking = 0, message = 0, message_across = 0;
    for (const Collective& x : r.traffic.items()) {
      const double t = cluster.seconds(x.op, x.size, x.calls, x.bus_bytes, x.nodes, x.per_node);
      r.comm[x.component] += t;
      if (x.component == "pipeline" && x.op == comm::OpType::kAllReduce) {
        data_blocking += t;                    // the tied embedding, after the schedule
      } else if (x.component == "pipeline") {  // its sends and receives
        const bool send = x.op == comm::OpType::kSend;
        if (send) message += t / x.calls;
        if (send && x.nodes > 1) message_across += t / x.calls;
        if (x.nodes > 1) r.unmoved += t;
      } else if (x.component == "tensor" || x.component == "sequence" || x.component == "expert") {
        blocking_mb += t / m / chunks;
      } else if (x.overlapped) {
        data_overlapped += t;
      } else {
        data_blocking += t;
      }
    }
    // The schedule at the rate a rank has alone (Note [Shared compute]);
    // blocking layer traffic a third in forward, two thirds in backward.
    int64_t blocks = 0;
    for (const auto& st : stages) blocks += st.blocks;
    const double overhead = cluster.block_overhead * static_cast<double>(blocks) / chunks;  // per chunk, fwd + bwd
    const double solo = cluster.compute_rate() / cluster.solo_rate();
    const double chunk_fwd = (fwd_flops / chunks / cluster.compute_rate() + overhead / 3) * solo;
    parallel::ActionCosts costs;
    costs.forward = chunk_fwd + blocking_mb / 3;
    costs.backward = 2 * chunk_fwd + (plan.checkpoint_activations ? chunk_fwd : 0) + 2 * blocking_mb / 3;
    costs.backward_input = costs.backward / 2;
    costs.backward_weight = costs.backward / 2;
    costs.message = message;
    costs.send = (1 - cluster.message_overlap) * message_across;  // Note [Messages nothing moves]
    if (c.pipeline() > 1) {
      const auto sim = parallel::simulate(
          parallel::make_schedule(plan.schedule, c.pipeline(), static_cast<int>(plan.micro_batches), plan.chunks),
          costs);
      r.makespan = sim.makespan;
      r.bubble = sim.bubble;
    } else {
      r.makespan = m * (costs.forward + costs.backward);
    }
    const double passes = 3 + (plan.checkpoint_activations ? 1 : 0);
    r.compute = m * passes * (fwd_flops / cluster.compute_rate() + cluster.block_overhead * blocks / 3);
    r.busy = r.compute + m * chunks * blocking_mb + (1 - cluster.message_overlap) * r.unmoved;
    const double hidden = cluster.overlap * std::min(data_overlapped, r.compute);
    r.exposed = data_overlapped - hidden + data_blocking;
  }
  // Note [Messages nothing moves]
  // A pipeline message between nodes hides behind compute only where
  // something moves it while both ends compute (a copy engine, NCCL's
  // kernels). Over MPI on CPU ranks nothing does: a payload larger than
  // the eager limit moves only once its receive is posted, which the
  // executor does when the schedule needs it, and then only inside MPI
  // calls; a progress thread (TESSERA_PROGRESS_US) moved the step by
  // under 5 % on the emulated cluster (docs/planner.md). So the unhidden share,
  // 1 - message_overlap, of each message across nodes is time its ranks spend
  // outside compute: the sender's in the schedule (the send's own time in
  // the simulator), and, where ranks share cores, both ends' in the node's
  // bound, since the data-parallel replicas of a stage wait together and
  // leave the cores idle. Messages inside a node are left as they were
  // (shared memory: microseconds at these sizes).
  // Note [Shared compute]
  // When the ranks of a node share fewer compute units than they are (CPU
  // ranks on fewer cores), a rank that waits in the pipeline's bubble
  // leaves its share to the others: the schedule runs at the rate a rank
  // has alone, but the node cannot finish before all of its ranks' work has
  // run at the node's whole rate. The mean rank's compute at the rate every
  // rank has while all compute is that bound; it adds nothing when each rank
  // has a unit of its own (GPUs), since then the schedule takes longer.
  double node_bound = 0;
  for (const PerRank& r : ranks) node_bound += r.busy / static_cast<double>(ranks.size());
  double slowest = -1;
  for (const PerRank& r : ranks) {
    const double pipeline = std::max(r.makespan, node_bound);
    if (pipeline + r.exposed <= slowest) continue;
    slowest = pipeline + r.exposed;
    est.traffic = r.traffic;
    est.compute_s = r.compute;
    est.pipeline_s = pipeline;
    est.bubble = r.bubble;
    est.comm_s = r.comm;
    est.data_exposed_s = r.exposed;
  }
  // The optimizer reads and writes its states, masters, gradient and
  // parameter shards once; offloaded, it runs on the host and the gradient
  // shard goes there and the parameter shard comes back.
  const MemoryEstimate& mem = est.memory;
  const double e = plan.bf16 ? 2.0 : 4.0, opt = plan.bf16 ? 12.0 : 8.0;
  const double shard = (plan.offload == parallel::Offload::kHost ? mem.host : mem.optim) / opt;  // elements this rank steps
  const double touched = 2 * opt * shard + 3 * e * shard;            // states read and written, gradient, parameter
  if (plan.offload == parallel::Offload::kHost) {
    const double host_rate = cluster.host_flops > 0 ? cluster.host_flops : cluster.memory_bandwidth / 8;
    est.optimizer_s = 2 * e * shard / cluster.host_bandwidth + touched / host_rate;
  } else {
    est.optimizer_s = touched / cluster.memory_bandwidth;
  }
  est.step_s = est.pipeline_s + est.data_exposed_s + est.optimizer_s;
  const double model_flops = model.flops_per_sequence() * plan.global_batch;
  est.mfu = model_flops / (est.step_s * plan.world() * cluster.peak_flops);
  est.tokens_per_s = plan.global_batch * model.seq() / est.step_s;
  return est;
}

std::string Estimate::summary() const {
  std::string comm;
  for (const auto& [k, v] : comm_s)
    if (v > 0) comm += fmt::format(" {}={:.3g}s", k, v);
  return fmt::format("{:<48} step {:8.4g}s  MFU {:5.1f}%  mem {:6.2f} GB{}  pipe {:.4g}s (bubble {:.0f}%)  "
                     "data exposed {:.3g}s  optim {:.3g}s |{}",
                     plan.to_string(), step_s, 100 * mfu, memory.peak() / 1e9, fits ? "" : " (over)", pipeline_s,
                     100 * bubble, data_exposed_s, optimizer_s, comm);
}

std::string Estimate::to_json() const {
  nlohmann::json comm = nlohmann::json::object();
  for (const auto& [k, v] : comm_s) comm[k] = v;
  nlohmann::json bytes = nlohmann::json::array();
  for (const Collective& x : traffic.items())
    bytes.push_back({{"component", x.component},
                     {"group", x.group},
                     {"op", comm::op_type_name(x.op)},
                     {"ranks", x.size},
                     {"nodes", x.nodes},
                     {"calls", x.calls},
                     {"bytes", x.bytes},
                     {"bus_bytes", x.bus_bytes}});
  nlohmann::json j{{"plan", nlohmann::json::parse(plan.to_json())},
                   {"label", plan.to_string()},
                   {"step_s", step_s},
                   {"mfu", mfu},
                   {"tokens_per_s", tokens_per_s},
                   {"fits", fits},
                   {"memory_gb",
                    {{"params", memory.params / 1e9},
                     {"grads", memory.grads / 1e9},
                     {"optim", memory.optim / 1e9},
                     {"host", memory.host / 1e9},
                     {"activations", memory.activations / 1e9},
                     {"buffers", memory.buffers / 1e9},
                     {"peak", memory.peak() / 1e9}}},
                   {"time_s",
                    {{"compute", compute_s},
                     {"pipeline", pipeline_s},
                     {"bubble", bubble},
                     {"data_exposed", data_exposed_s},
                     {"optimizer", optimizer_s}}},
                   {"comm_s", comm},
                   {"collectives", bytes}};
  if (!why.empty()) j["why"] = why;
  return j.dump();
}

}  // namespace planner
}  // namespace tessera
