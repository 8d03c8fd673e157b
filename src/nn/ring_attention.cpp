// Ring attention: an online softmax over key/value blocks passed around the
// sequence group (Note [Ring attention]).
#include "tessera/comm/p2p.h"
#include "tessera/nn/sequence_attention.h"

#include "sequence_checks.h"

#include "tessera/core/hash.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <vector>

namespace tessera {
namespace nn {
namespace {

// Note [Ring attention]
// Forward, for this rank's queries q and each key/value block (k_j, v_j) as
// it passes (comm::ring_pass, Note [Ring pass]): scores s = q·k_jᵀ/√d under
// the causal mask, then the running maximum m, normalizer l and output
// numerator acc of the online softmax are rescaled by exp(m - m_new) and
// extended by the block. The output is acc / l; m + log l (the log-sum-exp
// of each query's row) is kept for backward, so the S x S matrix never
// exists: the largest temporary is one tile's scores (Note [Ring attention tiles]).
// Backward (FlashAttention's): with D = rowsum(dO ∘ O), for each block
// p = exp(s - lse), dv_j += pᵀ·dO, ds = p ∘ (dO·v_jᵀ - D), dq += ds·k_j/√d,
// dk_j += dsᵀ·q/√d; dk_j and dv_j travel back to their owner with
// comm::ring_pass_reduce. Keys and values go as one [2, ...] block.
// Each rank's tokens are one chunk (contiguous split) or two (zigzag): a
// (query chunk, key chunk) pair whose keys all come after every query is
// skipped, one whose keys all come before needs no mask, and only the
// diagonal pairs are masked. Sums run in float32 (float64 for double inputs).

// Note [Ring attention dropout]
// Dropout acts on the normalized probabilities P, which ring attention never
// forms; it can still drop them block by block, because the output is
// Σ_j (Z_j ∘ P_j)·v_j with Z_j the block's scaled keep-mask, and P_j = p_j / l
// with l the undropped normalizer. So the forward adds (Z ∘ p)·v_j to the
// numerator and p (undropped) to l. Backward: dv_j += (Z ∘ p)ᵀ·dO and
// ds = p ∘ (Z ∘ (dO·v_jᵀ) - D), with D = rowsum(dO ∘ O) as without dropout.
// Z is drawn on the CPU from a generator seeded with (a seed drawn from the
// layer's ParallelDropout stream once per forward, the key block's owner,
// the query and key chunk), so backward draws the same masks again and
// activation checkpointing replays them through the layer's stream.

struct Chunk {
  int64_t begin;  // local token index
  int64_t length;
  int64_t first;  // position of its first token
};

std::vector<Chunk> chunks_of(const SequenceLayout& layout, int64_t seq_len, int rank) {
  if (layout.split() == context::SequenceSplit::kContiguous) {
    const int64_t n = seq_len / layout.size();
    return {{0, n, layout.first_position(seq_len, rank)}};
  }
  const int64_t c = seq_len / (2 * layout.size());
  return {{0, c, rank * c}, {c, c, (2 * int64_t{layout.size()} - 1 - rank) * c}};
}

// Note [Ring attention tiles]
// A (query chunk, key chunk) pair is computed in tiles of at most T queries
// by T keys, T the largest power of two (at least 64) with b·h·T² ≤ 2^20
// scores: 4 MiB in fp32, so that a tile's scores, probabilities and their
// gradients stay in cache through the dozen passes the online softmax makes
// over them, and causal tiles wholly above the diagonal are skipped rather
// than computed and masked. Whole chunks of 2048 tokens with 2 heads took
// 5-10x longer per pass on one CPU thread than 512-token tiles.
std::vector<Chunk> tiles_of(const std::vector<Chunk>& chunks, int64_t t) {
  std::vector<Chunk> out;
  for (const Chunk& c : chunks)
    for (int64_t i = 0; i < c.length; i += t) out.push_back({c.begin + i, std::min(t, c.length - i), c.first + i});
  return out;
}

enum class Overlap { kNone, kFull, kCausal };

Overlap overlap(const Chunk& queries, const Chunk& keys) {
  if (keys.first > queries.first + queries.length - 1) return Overlap::kNone;
  if (keys.first + keys.length - 1 <= queries.first) return Overlap::kFull;
  return Overlap::kCausal;
}

// [queries, keys]: true where the key comes after the query.
// The scaled keep-mask of one (query chunk, key block's chunk) pair.
at::Tensor keep_mask(uint64_t seed, int src, size_t q_chunk, size_t k_chunk, double p, at::IntArrayRef shape,
                     const at::TensorOptions& options) {
  uint64_t h = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(src) + 1));
  h = splitmix64(h ^ splitmix64(static_cast<uint64_t>(q_chunk) << 32 | static_cast<uint64_t>(k_chunk)));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(h);
  at::Tensor mask = at::empty(shape, at::TensorOptions().dtype(options.dtype()));
  mask.bernoulli_(1.0 - p, gen);
  return mask.div_(1.0 - p).to(options.device());
}

at::Tensor future_mask(const Chunk& queries, const Chunk& keys, const at::Device& device) {
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor qp = at::arange(queries.first, queries.first + queries.length, opts);
  at::Tensor kp = at::arange(keys.first, keys.first + keys.length, opts);
  return kp.unsqueeze(0) > qp.unsqueeze(1);
}

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, comm::CommunicatorPtr group, SequenceLayout layout, double drop,
                            int64_t drop_seed) {
    const auto ct = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor qc = q.to(ct).contiguous();
    const at::Tensor kv = at::stack({k, v}).to(ct).contiguous();
    const int64_t seq_len = q.size(2) * layout.size();
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    constexpr double kInf = std::numeric_limits<double>::infinity();

    at::Tensor m = at::full({q.size(0), q.size(1), q.size(2)}, -kInf, qc.options());
    at::Tensor l = at::zeros_like(m);
    at::Tensor acc = at::zeros_like(qc);
    const int64_t tile = ring_tile_tokens(q.size(0) * q.size(1));
    const auto queries = tiles_of(chunks_of(layout, seq_len, layout.rank()), tile);
    comm::ring_pass(*group, kv, [&](int src, const at::Tensor& block) {
      const auto keys = tiles_of(chunks_of(layout, seq_len, src), tile);
      for (size_t ki = 0; ki < keys.size(); ++ki) {
        const Chunk& kc = keys[ki];
        const at::Tensor kk = block[0].narrow(2, kc.begin, kc.length), vv = block[1].narrow(2, kc.begin, kc.length);
        for (size_t qi = 0; qi < queries.size(); ++qi) {
          const Chunk& qch = queries[qi];
          const Overlap o = overlap(qch, kc);
          if (o == Overlap::kNone) continue;
          at::Tensor s = at::matmul(qc.narrow(2, qch.begin, qch.length), kk.transpose(-2, -1)).mul_(scale);
          if (o == Overlap::kCausal) s.masked_fill_(future_mask(qch, kc, s.device()), -kInf);
          at::Tensor mv = m.narrow(2, qch.begin, qch.length), lv = l.narrow(2, qch.begin, qch.length);
          at::Tensor av = acc.narrow(2, qch.begin, qch.length);
          const at::Tensor m_new = at::maximum(mv, std::get<0>(s.max(-1)));
          // A row with no key yet (all masked so far) keeps m = -inf: exp against 0 instead.
          const at::Tensor m_safe = m_new.masked_fill(at::isinf(m_new), 0.0);
          const at::Tensor p = at::exp(s - m_safe.unsqueeze(-1));
          const at::Tensor alpha = at::exp(mv - m_safe);
          lv.mul_(alpha).add_(p.sum(-1));
          const at::Tensor kept =
              drop > 0 ? p * keep_mask(static_cast<uint64_t>(drop_seed), src, qi, ki, drop, p.sizes(), p.options()) : p;
          av.mul_(alpha.unsqueeze(-1)).add_(at::matmul(kept, vv));
          mv.copy_(m_new);
        }
      }
    });
    // Every query sees at least its own key, so l > 0.
    const at::Tensor out = acc / l.unsqueeze(-1);
    const at::Tensor lse = m + at::log(l);
    ctx->save_for_backward({qc, kv, out, lse});
    ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group, layout));
    ctx->saved_data["drop"] = drop;
    ctx->saved_data["drop_seed"] = drop_seed;
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(q.scalar_type()),
                                                     static_cast<int64_t>(k.scalar_type()),
                                                     static_cast<int64_t>(v.scalar_type())};
    return out.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& qc = saved[0];
    const at::Tensor& kv = saved[1];
    const at::Tensor& out = saved[2];
    const at::Tensor& lse = saved[3];
    auto holder = ctx->saved_data["group"].toCapsule();
    auto* g = static_cast<GroupHolder*>(holder.get());
    const SequenceLayout& layout = g->layout;
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const at::Tensor dout = grads[0].to(qc.scalar_type());
    const int64_t seq_len = qc.size(2) * layout.size();
    const double scale = 1.0 / std::sqrt(static_cast<double>(qc.size(-1)));
    const double drop = ctx->saved_data["drop"].toDouble();
    const auto drop_seed = static_cast<uint64_t>(ctx->saved_data["drop_seed"].toInt());

    const at::Tensor delta = (dout * out).sum(-1);
    at::Tensor dq = at::zeros_like(qc);
    const int64_t tile = ring_tile_tokens(qc.size(0) * qc.size(1));
    const auto queries = tiles_of(chunks_of(layout, seq_len, layout.rank()), tile);
    at::Tensor dkv = comm::ring_pass_reduce(*g->group, kv, [&](int src, const at::Tensor& block) {
      at::Tensor contribution;
      const auto keys = tiles_of(chunks_of(layout, seq_len, src), tile);
      for (size_t ki = 0; ki < keys.size(); ++ki) {
        const Chunk& kc = keys[ki];
        const at::Tensor kk = block[0].narrow(2, kc.begin, kc.length), vv = block[1].narrow(2, kc.begin, kc.length);
        for (size_t qi = 0; qi < queries.size(); ++qi) {
          const Chunk& qch = queries[qi];
          const Overlap o = overlap(qch, kc);
          if (o == Overlap::kNone) continue;
          if (!contribution.defined()) contribution = at::zeros_like(kv);
          const at::Tensor qq = qc.narrow(2, qch.begin, qch.length);
          const at::Tensor dd = dout.narrow(2, qch.begin, qch.length);
          at::Tensor p = at::matmul(qq, kk.transpose(-2, -1)).mul_(scale);
          p.sub_(lse.narrow(2, qch.begin, qch.length).unsqueeze(-1)).exp_();
          if (o == Overlap::kCausal) p.masked_fill_(future_mask(qch, kc, p.device()), 0.0);
          const at::Tensor mask =
              drop > 0 ? keep_mask(drop_seed, src, qi, ki, drop, p.sizes(), p.options()) : at::Tensor();
          contribution[1].narrow(2, kc.begin, kc.length)
              .add_(at::matmul((mask.defined() ? p * mask : p).transpose(-2, -1), dd));
          at::Tensor ds = at::matmul(dd, vv.transpose(-2, -1));
          if (mask.defined()) ds.mul_(mask);
          ds.sub_(delta.narrow(2, qch.begin, qch.length).unsqueeze(-1)).mul_(p).mul_(scale);
          dq.narrow(2, qch.begin, qch.length).add_(at::matmul(ds, kk));
          contribution[0].narrow(2, kc.begin, kc.length).add_(at::matmul(ds.transpose(-2, -1), qq));
        }
      }
      return contribution;
    });
    auto as = [&](const at::Tensor& t, size_t i) { return t.to(static_cast<at::ScalarType>(dtypes[i])); };
    return {as(dq, 0), as(dkv[0], 1), as(dkv[1], 2), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  struct GroupHolder : torch::CustomClassHolder {
    GroupHolder(comm::CommunicatorPtr g, SequenceLayout l) : group(std::move(g)), layout(l) {}
    comm::CommunicatorPtr group;
    SequenceLayout layout;
  };
};

}  // namespace

int64_t ring_tile_tokens(int64_t batch_heads) {
  constexpr int64_t kTileScores = int64_t{1} << 20;
  TORCH_CHECK(batch_heads > 0, "ring_tile_tokens: batch x heads must be positive, got ", batch_heads);
  int64_t t = 64;
  while (batch_heads * (2 * t) * (2 * t) <= kTileScores) t *= 2;
  return t;
}

RingAttentionImpl::RingAttentionImpl(int64_t head_dim, ParallelDropout dropout, comm::CommunicatorPtr group,
                                     SequenceLayout layout)
    : head_dim_(head_dim), dropout_(std::move(dropout)), group_(std::move(group)), layout_(layout) {
  TORCH_CHECK(!dropout_.is_empty(), "RingAttention: the dropout layer is null (give one with p = 0 for none)");
  register_module("dropout", dropout_);
  TORCH_CHECK(head_dim_ > 0, "RingAttention: head_dim must be positive, got ", head_dim_);
  TORCH_CHECK(group_ != nullptr && group_->size() == layout_.size() && group_->rank() == layout_.rank(),
              "RingAttention: the sequence group and the layout must describe the same ranks");
}

at::Tensor RingAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& positions) {
  check_sequence_attention("RingAttention", q, k, v, positions, head_dim_, layout_);
  const double drop = is_training() ? dropout_->options.p() : 0.0;
  const int64_t seed = drop > 0 ? static_cast<int64_t>(dropout_->draw_seed()) : 0;
  return RingAttentionFunction::apply(q, k, v, group_, layout_, drop, seed);
}

}  // namespace nn
}  // namespace tessera
