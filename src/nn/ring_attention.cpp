// Ring attention: an online softmax over key/value blocks passed around the
// sequence group (Note [Ring attention]).
#include "tessera/comm/p2p.h"
#include "tessera/nn/sequence_attention.h"

#include "sequence_checks.h"

#include <ATen/ATen.h>
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
// exists: the largest temporary is one block's n x n scores.
// Backward (FlashAttention's): with D = rowsum(dO ∘ O), for each block
// p = exp(s - lse), dv_j += pᵀ·dO, ds = p ∘ (dO·v_jᵀ - D), dq += ds·k_j/√d,
// dk_j += dsᵀ·q/√d; dk_j and dv_j travel back to their owner with
// comm::ring_pass_reduce. Keys and values go as one [2, ...] block.
// Each rank's tokens are one chunk (contiguous split) or two (zigzag): a
// (query chunk, key chunk) pair whose keys all come after every query is
// skipped, one whose keys all come before needs no mask, and only the
// diagonal pairs are masked. Sums run in float32 (float64 for double inputs).

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

enum class Overlap { kNone, kFull, kCausal };

Overlap overlap(const Chunk& queries, const Chunk& keys) {
  if (keys.first > queries.first + queries.length - 1) return Overlap::kNone;
  if (keys.first + keys.length - 1 <= queries.first) return Overlap::kFull;
  return Overlap::kCausal;
}

// [queries, keys]: true where the key comes after the query.
at::Tensor future_mask(const Chunk& queries, const Chunk& keys, const at::Device& device) {
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor qp = at::arange(queries.first, queries.first + queries.length, opts);
  at::Tensor kp = at::arange(keys.first, keys.first + keys.length, opts);
  return kp.unsqueeze(0) > qp.unsqueeze(1);
}

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, comm::CommunicatorPtr group, SequenceLayout layout) {
    const auto ct = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor qc = q.to(ct).contiguous();
    const at::Tensor kv = at::stack({k, v}).to(ct).contiguous();
    const int64_t seq_len = q.size(2) * layout.size();
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    constexpr double kInf = std::numeric_limits<double>::infinity();

    at::Tensor m = at::full({q.size(0), q.size(1), q.size(2)}, -kInf, qc.options());
    at::Tensor l = at::zeros_like(m);
    at::Tensor acc = at::zeros_like(qc);
    const auto queries = chunks_of(layout, seq_len, layout.rank());
    comm::ring_pass(*group, kv, [&](int src, const at::Tensor& block) {
      for (const Chunk& kc : chunks_of(layout, seq_len, src)) {
        const at::Tensor kk = block[0].narrow(2, kc.begin, kc.length), vv = block[1].narrow(2, kc.begin, kc.length);
        for (const Chunk& qch : queries) {
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
          av.mul_(alpha.unsqueeze(-1)).add_(at::matmul(p, vv));
          mv.copy_(m_new);
        }
      }
    });
    // Every query sees at least its own key, so l > 0.
    const at::Tensor out = acc / l.unsqueeze(-1);
    const at::Tensor lse = m + at::log(l);
    ctx->save_for_backward({qc, kv, out, lse});
    ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group, layout));
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

    const at::Tensor delta = (dout * out).sum(-1);
    at::Tensor dq = at::zeros_like(qc);
    const auto queries = chunks_of(layout, seq_len, layout.rank());
    at::Tensor dkv = comm::ring_pass_reduce(*g->group, kv, [&](int src, const at::Tensor& block) {
      at::Tensor contribution;
      for (const Chunk& kc : chunks_of(layout, seq_len, src)) {
        const at::Tensor kk = block[0].narrow(2, kc.begin, kc.length), vv = block[1].narrow(2, kc.begin, kc.length);
        for (const Chunk& qch : queries) {
          const Overlap o = overlap(qch, kc);
          if (o == Overlap::kNone) continue;
          if (!contribution.defined()) contribution = at::zeros_like(kv);
          const at::Tensor qq = qc.narrow(2, qch.begin, qch.length);
          const at::Tensor dd = dout.narrow(2, qch.begin, qch.length);
          at::Tensor p = at::matmul(qq, kk.transpose(-2, -1)).mul_(scale);
          p.sub_(lse.narrow(2, qch.begin, qch.length).unsqueeze(-1)).exp_();
          if (o == Overlap::kCausal) p.masked_fill_(future_mask(qch, kc, p.device()), 0.0);
          contribution[1].narrow(2, kc.begin, kc.length).add_(at::matmul(p.transpose(-2, -1), dd));
          at::Tensor ds = at::matmul(dd, vv.transpose(-2, -1));
          ds.sub_(delta.narrow(2, qch.begin, qch.length).unsqueeze(-1)).mul_(p).mul_(scale);
          dq.narrow(2, qch.begin, qch.length).add_(at::matmul(ds, kk));
          contribution[0].narrow(2, kc.begin, kc.length).add_(at::matmul(ds.transpose(-2, -1), qq));
        }
      }
      return contribution;
    });
    auto as = [&](const at::Tensor& t, size_t i) { return t.to(static_cast<at::ScalarType>(dtypes[i])); };
    return {as(dq, 0), as(dkv[0], 1), as(dkv[1], 2), at::Tensor(), at::Tensor()};
  }

  struct GroupHolder : torch::CustomClassHolder {
    GroupHolder(comm::CommunicatorPtr g, SequenceLayout l) : group(std::move(g)), layout(l) {}
    comm::CommunicatorPtr group;
    SequenceLayout layout;
  };
};

}  // namespace

RingAttentionImpl::RingAttentionImpl(int64_t head_dim, comm::CommunicatorPtr group, SequenceLayout layout)
    : head_dim_(head_dim), group_(std::move(group)), layout_(layout) {
  TORCH_CHECK(head_dim_ > 0, "RingAttention: head_dim must be positive, got ", head_dim_);
  TORCH_CHECK(group_ != nullptr && group_->size() == layout_.size() && group_->rank() == layout_.rank(),
              "RingAttention: the sequence group and the layout must describe the same ranks");
}

at::Tensor RingAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& positions) {
  check_sequence_attention("RingAttention", q, k, v, positions, head_dim_, layout_);
  return RingAttentionFunction::apply(q, k, v, group_, layout_);
}

}  // namespace nn
}  // namespace tessera
