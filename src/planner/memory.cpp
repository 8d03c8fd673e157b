#include "tessera/planner/memory.h"

#include "tessera/context/rank_grid.h"
#include "tessera/core/compat.h"
#include "tessera/nn/sequence_attention.h"
#include "tessera/parallel/pipeline_simulator.h"
#include "tessera/planner/traffic.h"

#include <algorithm>

namespace tessera {
namespace planner {

namespace {

// Ring and hybrid sequence attention: key blocks passed around a ring, in tiles.
bool attends_on_a_ring(const context::ParallelConfig& c) {
  return c.sequence() > 1 &&
         (c.sequence_mode() == context::SequenceMode::kRing || c.sequence_mode() == context::SequenceMode::kHybrid);
}

}  // namespace

// Note [Activation memory]
// What one block keeps for backward, per token of the rank's layout, in
// activation elements: the two LayerNorms' inputs and outputs (4h), the
// attention's q, k, v and output (4h), its scores and probabilities
// (2 · heads · keys), and the MLP's hidden activations before and after the
// nonlinearity (2f; SwiGLU keeps gate, up and their product, 3f). 1D tensor
// parallelism splits everything but the LayerNorms' 4h; the other tensor
// modes split all of it; sequence parallelism splits the tokens, and the
// keys a score row spans for ring attention (one block of keys at a time).
// With activation checkpointing a block keeps its input (h) and one block
// at a time is rebuilt in backward. MoE blocks keep top_k times the MLP
// part. This follows Korthikanti et al. 2022 in shape; the coefficients are
// tessera's (LibTorch's saved tensors), checked against the counting
// allocator (docs/planner.md). The head's and the embedding's tensors are
// added per micro-batch in flight on the stages that hold them.
double block_activation_bytes(const ModelDesc& model, const Plan& plan) {
  if (model.opaque()) return 0;
  const auto& c = plan.grid;
  const double h = static_cast<double>(model.hidden()), f = static_cast<double>(model.ffn_width());
  const double e = plan.bf16 ? 2.0 : 4.0;
  const double tokens = static_cast<double>(plan.micro_batch_rows()) * model.seq() / c.sequence();
  // Keys per query held at once: the whole sequence under Ulysses, a ring
  // rank's block under ring and rsa, and hybrid's ring rank's U·S/sp.
  double keys = static_cast<double>(model.seq());
  if (c.sequence() > 1 && c.sequence_mode() == context::SequenceMode::kHybrid)
    keys = keys * c.sequence_ulysses() / c.sequence();
  else if (c.sequence() > 1 && c.sequence_mode() != context::SequenceMode::kUlysses)
    keys = keys / c.sequence();
  const double mlp = (model.mlp_matrices() == 3 ? 3.0 : 2.0) * f;
  // Attention keeps q, k, v and its output (GPT-2: 4h); grouped-query
  // attention keeps the kv heads before and after their repetition.
  const double a = static_cast<double>(model.attention_width()), kv = static_cast<double>(model.kv_width());
  const double attention = kv == a ? 4 * a : 4 * a + 2 * kv;
  // Ring and hybrid keep no scores: their tiles are transient (attention_tile_bytes).
  const double scores = model.fused_attention() || attends_on_a_ring(c) ? 0.0 : 2.0 * model.heads() * keys;
  const double replicated = 4 * h, split = attention + scores + mlp;
  const double per_token =
      c.tensor_mode() == context::TensorMode::k1D ? replicated + split / c.tensor() : (replicated + split) / c.tensor();
  return tokens * per_token * e;
}

namespace {

// The transient work of tiled attention, once per rank: two tiles (the
// scores and their exponent forward, the probabilities and the score
// gradient backward; Note [Ring attention tiles]), in fp32 whatever the
// model's precision. Ring and hybrid always tile; local attention (Ulysses'
// included) tiles on LibTorch 1.13 when it drops nothing.
double attention_tile_bytes(const ModelDesc& model, const Plan& plan) {
  const auto& c = plan.grid;
  if (model.opaque()) return 0;
  const bool ring = attends_on_a_ring(c);
  const bool local = c.sequence() == 1 || c.sequence_mode() == context::SequenceMode::kUlysses;
  if (!ring && !(local && model.fused_attention() && !TESSERA_TORCH_VERSION_AT_LEAST(2, 0))) return 0;
  const bool hybrid = ring && c.sequence_mode() == context::SequenceMode::kHybrid;
  const int64_t split = hybrid ? c.sequence_ulysses() : (local ? c.sequence() : 1);
  const int64_t heads = std::max<int64_t>(model.heads() / c.tensor() / split, 1);
  const int64_t batch_heads = plan.micro_batch_rows() * heads;
  // The keys a tile spans: a rank's chunk on the ring (two per rank under
  // zigzag), the whole sequence in local attention.
  const int64_t ring_size = hybrid ? c.sequence() / c.sequence_ulysses() : c.sequence();
  const int64_t chunk =
      ring ? model.seq() / ring_size / (c.sequence_split() == context::SequenceSplit::kZigzag ? 2 : 1) : model.seq();
  const double side = static_cast<double>(std::min(chunk, nn::ring_tile_tokens(batch_heads)));
  return 2.0 * static_cast<double>(batch_heads) * side * side * 4.0;
}

}  // namespace

MemoryEstimate predict_memory(const ModelDesc& model, const Plan& plan, int global_rank) {
  MemoryEstimate m;
  const auto& c = plan.grid;
  const context::RankGrid grid(c, plan.world());
  const int pp_rank = grid.coordinate(context::Dim::kPipeline, global_rank);
  const LocalParams lp = local_params(model, plan, pp_rank);
  const double e = plan.bf16 ? 2.0 : 4.0, opt = plan.bf16 ? 12.0 : 8.0;
  auto states = [&](double numel, int n) {
    if (numel <= 0) return;
    const parallel::ShardDegrees d = plan.spec.resolve(n);
    const double padded = numel + d.optim;  // each bucket padded to a multiple of the largest degree
    m.params += e * padded / d.params;
    m.grads += e * padded / d.grads;
    (plan.offload == parallel::Offload::kHost ? m.host : m.optim) += opt * padded / d.optim;
  };
  states(lp.dense, c.data() * (c.sequence() > 1 ? c.sequence() : 1));
  states(lp.expert, c.data() / c.expert());

  // Activations: micro-batches in flight on this rank's stages.
  const auto stages = stages_of(model, plan, pp_rank);
  int64_t blocks = 0;
  for (const auto& st : stages) blocks += st.blocks;
  const double per_block = block_activation_bytes(model, plan);
  std::vector<int> stage_inflight;  // per stage of the model; empty without a pipeline
  if (c.pipeline() > 1) {
    const auto sim = parallel::simulate(
        parallel::make_schedule(plan.schedule, c.pipeline(), static_cast<int>(plan.micro_batches), plan.chunks));
    m.inflight = sim.peak_inflight[pp_rank];
    stage_inflight = sim.peak_inflight_stage;
  }
  const double per_chunk_blocks = static_cast<double>(blocks) / stages.size();
  const double tokens = static_cast<double>(plan.micro_batch_rows()) * model.seq() / c.sequence();
  if (plan.checkpoint_activations) {
    const double kept = tokens * model.hidden() * e / (c.tensor_mode() == context::TensorMode::k1D ? 1 : c.tensor());
    m.activations = m.inflight * per_chunk_blocks * kept + per_block;
  } else {
    m.activations = m.inflight * per_chunk_blocks * per_block;
  }
  // The ends of the model, per micro-batch in flight (Note [Activation
  // memory]): the head's logits, their log-probabilities and gradient
  // (3 · V per token, V split over the tensor group), the embedding's
  // output (h) and the one gradient arriving for it (h); each per
  // micro-batch its own stage holds (the V's rank 0 holds many of the
  // embedding's, one of the head's).
  for (const auto& st : stages) {
    const double held = stage_inflight.empty() ? m.inflight : stage_inflight.at(st.stage);
    if (st.head) m.activations += held * tokens * 3.0 * model.vocab() / c.tensor() * e;
    if (st.embed) m.activations += (held + 1) * tokens * model.hidden() / c.tensor() * e;
  }
  // Gathered parameters: the unit in use and the prefetched one (a block
  // each). Sharded gradients exist full-size until their bucket is reduced;
  // a pipeline stage keeps one stage-sized gradient buffer beside them
  // (measured: docs/planner.md).
  const parallel::ShardDegrees d = plan.spec.resolve(c.data() * (c.sequence() > 1 ? c.sequence() : 1));
  const double local = lp.dense + lp.expert;
  const double unit = blocks > 0 ? local / std::max<int64_t>(blocks, 1) : local;
  if (d.params > 1) m.buffers += 2 * e * unit;
  // 2D/2.5D/3D matmuls receive panels by broadcast: in backward, an
  // activation panel and a gradient panel of the widest (MLP) matmul.
  if (c.tensor() > 1 && c.tensor_mode() != context::TensorMode::k1D)
    m.buffers += 2 * tokens * model.ffn_width() / c.tensor() * e;
  if (blocks > 0) m.buffers += attention_tile_bytes(model, plan);  // a stage without blocks runs no attention
  if (c.pipeline() > 1)
    m.buffers += e * local;
  else if (d.grads > 1)
    m.buffers += e * local * (1 - 1.0 / d.grads);
  return m;
}

}  // namespace planner
}  // namespace tessera
