#include "tiled_attention.h"

#include "tessera/core/hash.h"
#include "tessera/nn/sequence_attention.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace tessera {
namespace nn {

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
// Each rank's tokens are runs of consecutive positions: one chunk
// (contiguous split) or two (zigzag). A (query tile, key tile) pair whose
// keys all come after every query is skipped, one whose keys all come
// before needs no mask, and only the diagonal pairs are masked. Sums run in
// float32 (float64 for double inputs). LocalAttention runs the same kernel
// on one rank's whole sequence (tiled_causal_attention).

// Note [Ring attention dropout]
// Dropout acts on the normalized probabilities P, which ring attention never
// forms; it can still drop them block by block, because the output is
// Σ_j (Z_j ∘ P_j)·v_j with Z_j the block's scaled keep-mask, and P_j = p_j / l
// with l the undropped normalizer. So the forward adds (Z ∘ p)·v_j to the
// numerator and p (undropped) to l. Backward: dv_j += (Z ∘ p)ᵀ·dO and
// ds = p ∘ (Z ∘ (dO·v_jᵀ) - D), with D = rowsum(dO ∘ O) as without dropout.
// Z is drawn on the CPU from a generator seeded with (a seed drawn from the
// layer's ParallelDropout stream once per forward, the key block's owner,
// the query and key tile), so backward draws the same masks again and
// activation checkpointing replays them through the layer's stream.

// Note [Ring attention tiles]
// A (query chunk, key chunk) pair is computed in tiles of at most T queries
// by T keys, T the largest power of two (at least 64) with b·h·T² ≤ 2^20
// scores: 4 MiB in fp32, so that a tile's scores, probabilities and their
// gradients stay in cache through the dozen passes the online softmax makes
// over them, and causal tiles wholly above the diagonal are skipped rather
// than computed and masked. Whole chunks of 2048 tokens with 2 heads took
// 5-10x longer per pass on one CPU thread than 512-token tiles.
int64_t ring_tile_tokens(int64_t batch_heads) {
  constexpr int64_t kTileScores = int64_t{1} << 20;
  TORCH_CHECK(batch_heads > 0, "ring_tile_tokens: batch x heads must be positive, got ", batch_heads);
  int64_t t = 64;
  while (batch_heads * (2 * t) * (2 * t) <= kTileScores) t *= 2;
  return t;
}

namespace detail {
namespace {

enum class Overlap { kNone, kFull, kCausal };

Overlap overlap(const TokenRun& queries, const TokenRun& keys) {
  if (keys.first > queries.first + queries.length - 1) return Overlap::kNone;
  if (keys.first + keys.length - 1 <= queries.first) return Overlap::kFull;
  return Overlap::kCausal;
}

// The scaled keep-mask of one (query tile, key tile) pair.
at::Tensor keep_mask(const BlockDropout& drop, size_t q_tile, size_t k_tile, at::IntArrayRef shape,
                     const at::TensorOptions& options) {
  uint64_t h = splitmix64(drop.seed ^ splitmix64(static_cast<uint64_t>(drop.owner) + 1));
  h = splitmix64(h ^ splitmix64(static_cast<uint64_t>(q_tile) << 32 | static_cast<uint64_t>(k_tile)));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(h);
  at::Tensor mask = at::empty(shape, at::TensorOptions().dtype(options.dtype()));
  mask.bernoulli_(1.0 - drop.p, gen);
  return mask.div_(1.0 - drop.p).to(options.device());
}

// [queries, keys]: true where the key comes after the query.
at::Tensor future_mask(const TokenRun& queries, const TokenRun& keys, const at::Device& device) {
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor qp = at::arange(queries.first, queries.first + queries.length, opts);
  at::Tensor kp = at::arange(keys.first, keys.first + keys.length, opts);
  return kp.unsqueeze(0) > qp.unsqueeze(1);
}

double scale_of(const at::Tensor& q) { return 1.0 / std::sqrt(static_cast<double>(q.size(-1))); }

// fn(query tile index, key tile index, query tile, key tile, overlap, keys,
// values) for each pair of tiles in which some query sees a key, then
// between().
template <typename Fn>
void for_each_visible_pair(const at::Tensor& kv, const std::vector<TokenRun>& queries,
                           const std::vector<TokenRun>& keys, const BetweenTiles& between, Fn&& fn) {
  for (size_t ki = 0; ki < keys.size(); ++ki) {
    const TokenRun& kc = keys[ki];
    const at::Tensor kk = kv[0].narrow(2, kc.begin, kc.length), vv = kv[1].narrow(2, kc.begin, kc.length);
    for (size_t qi = 0; qi < queries.size(); ++qi) {
      const Overlap o = overlap(queries[qi], kc);
      if (o == Overlap::kNone) continue;
      fn(qi, ki, queries[qi], kc, o, kk, vv);
      if (between) between();
    }
  }
}

}  // namespace

std::vector<TokenRun> runs_of_positions(const at::Tensor& positions) {
  const at::Tensor pos = positions.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  std::vector<TokenRun> runs;
  for (int64_t i = 0; i < pos.numel(); ++i) {
    if (!runs.empty() && p[i] == runs.back().first + runs.back().length) {
      ++runs.back().length;
    } else {
      runs.push_back({i, 1, p[i]});
    }
  }
  return runs;
}

std::vector<TokenRun> tiles_of(const std::vector<TokenRun>& runs, int64_t tile) {
  std::vector<TokenRun> out;
  for (const TokenRun& r : runs)
    for (int64_t i = 0; i < r.length; i += tile)
      out.push_back({r.begin + i, std::min(tile, r.length - i), r.first + i});
  return out;
}

OnlineSoftmax::OnlineSoftmax(const at::Tensor& q)
    : m(at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(), q.options())),
      l(at::zeros_like(m)),
      acc(at::zeros_like(q)) {}

void OnlineSoftmax::extend(const at::Tensor& q, const at::Tensor& kv, const std::vector<TokenRun>& queries,
                           const std::vector<TokenRun>& keys, const BlockDropout& drop, const BetweenTiles& between) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double scale = scale_of(q);
  for_each_visible_pair(kv, queries, keys, between,
                        [&](size_t qi, size_t ki, const TokenRun& qt, const TokenRun& kc, Overlap o,
                            const at::Tensor& kk, const at::Tensor& vv) {
                          at::Tensor s = at::matmul(q.narrow(2, qt.begin, qt.length), kk.transpose(-2, -1)).mul_(scale);
                          if (o == Overlap::kCausal) s.masked_fill_(future_mask(qt, kc, s.device()), -kInf);
                          at::Tensor mv = m.narrow(2, qt.begin, qt.length), lv = l.narrow(2, qt.begin, qt.length);
                          at::Tensor av = acc.narrow(2, qt.begin, qt.length);
                          const at::Tensor m_new = at::maximum(mv, std::get<0>(s.max(-1)));
                          // A row with no key yet (all masked so far) keeps m = -inf: exp against 0 instead.
                          const at::Tensor m_safe = m_new.masked_fill(at::isinf(m_new), 0.0);
                          const at::Tensor p = at::exp(s - m_safe.unsqueeze(-1));
                          const at::Tensor alpha = at::exp(mv - m_safe);
                          lv.mul_(alpha).add_(p.sum(-1));
                          const at::Tensor kept = drop.p > 0 ? p * keep_mask(drop, qi, ki, p.sizes(), p.options()) : p;
                          av.mul_(alpha.unsqueeze(-1)).add_(at::matmul(kept, vv));
                          mv.copy_(m_new);
                        });
}

std::pair<at::Tensor, at::Tensor> OnlineSoftmax::finish() const {
  // Every query sees at least its own key, so l > 0.
  return {acc / l.unsqueeze(-1), m + at::log(l)};
}

at::Tensor attention_block_backward(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& dout,
                                    const at::Tensor& delta, const at::Tensor& lse,
                                    const std::vector<TokenRun>& queries, const std::vector<TokenRun>& keys,
                                    const BlockDropout& drop, at::Tensor& dq, const BetweenTiles& between) {
  const double scale = scale_of(q);
  at::Tensor contribution;
  for_each_visible_pair(kv, queries, keys, between,
                        [&](size_t qi, size_t ki, const TokenRun& qt, const TokenRun& kc, Overlap o,
                            const at::Tensor& kk, const at::Tensor& vv) {
                          if (!contribution.defined()) contribution = at::zeros_like(kv);
                          const at::Tensor qq = q.narrow(2, qt.begin, qt.length);
                          const at::Tensor dd = dout.narrow(2, qt.begin, qt.length);
                          at::Tensor p = at::matmul(qq, kk.transpose(-2, -1)).mul_(scale);
                          p.sub_(lse.narrow(2, qt.begin, qt.length).unsqueeze(-1)).exp_();
                          if (o == Overlap::kCausal) p.masked_fill_(future_mask(qt, kc, p.device()), 0.0);
                          const at::Tensor mask =
                              drop.p > 0 ? keep_mask(drop, qi, ki, p.sizes(), p.options()) : at::Tensor();
                          contribution[1]
                              .narrow(2, kc.begin, kc.length)
                              .add_(at::matmul((mask.defined() ? p * mask : p).transpose(-2, -1), dd));
                          at::Tensor ds = at::matmul(dd, vv.transpose(-2, -1));
                          if (mask.defined()) ds.mul_(mask);
                          ds.sub_(delta.narrow(2, qt.begin, qt.length).unsqueeze(-1)).mul_(p).mul_(scale);
                          dq.narrow(2, qt.begin, qt.length).add_(at::matmul(ds, kk));
                          contribution[0].narrow(2, kc.begin, kc.length).add_(at::matmul(ds.transpose(-2, -1), qq));
                        });
  return contribution;
}

namespace {

struct TiledCausalFunction : torch::autograd::Function<TiledCausalFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& positions) {
    const auto ct = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor qc = q.to(ct).contiguous();
    const at::Tensor kv = at::stack({k, v}).to(ct).contiguous();
    const auto tiles = tiles_of(runs_of_positions(positions), ring_tile_tokens(q.size(0) * q.size(1)));
    OnlineSoftmax softmax(qc);
    softmax.extend(qc, kv, tiles, tiles, {});
    auto [out, lse] = softmax.finish();
    ctx->save_for_backward({qc, kv, out, lse, positions});
    ctx->saved_data["dtypes"] =
        std::vector<int64_t>{static_cast<int64_t>(q.scalar_type()), static_cast<int64_t>(k.scalar_type()),
                             static_cast<int64_t>(v.scalar_type())};
    return out.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &qc = saved[0], &kv = saved[1], &out = saved[2], &lse = saved[3], &positions = saved[4];
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const at::Tensor dout = grads[0].to(qc.scalar_type());
    const auto tiles = tiles_of(runs_of_positions(positions), ring_tile_tokens(qc.size(0) * qc.size(1)));
    at::Tensor dq = at::zeros_like(qc);
    const at::Tensor dkv = attention_block_backward(qc, kv, dout, (dout * out).sum(-1), lse, tiles, tiles, {}, dq);
    auto as = [&](const at::Tensor& t, size_t i) { return t.to(static_cast<at::ScalarType>(dtypes[i])); };
    return {as(dq, 0), as(dkv[0], 1), as(dkv[1], 2), at::Tensor()};
  }
};

}  // namespace

at::Tensor tiled_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& positions) {
  return TiledCausalFunction::apply(q, k, v, positions);
}

}  // namespace detail
}  // namespace nn
}  // namespace tessera
