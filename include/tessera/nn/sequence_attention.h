#pragma once
// Sequence-parallel attention: the core_attention slot when each rank of a
// sequence group holds only some tokens of every sequence (positions from a
// SequenceLayout). Each module takes q, k, v [b, heads, local tokens,
// head_dim] and the local tokens' positions, and returns the attention
// output of those tokens over the whole (causal) sequence, equal to serial
// attention. docs/sequence-parallel.md has the communication of each.
//
//   UlyssesAttention      all-to-all to a head split, full-sequence attention
//                         on heads/P heads, all-to-all back (DeepSpeed-Ulysses).
//   RingAttention         key/value blocks passed around the ring, an online
//                         (log-sum-exp) softmax, no S x S matrix; blocks whose
//                         keys all follow every query are skipped.
//   RingSelfAttention     the sequence-parallel paper's form: keys around the
//                         ring to build each query's whole score row, softmax,
//                         then values around the ring.
//   HybridAttention       Ulysses inside groups of U adjacent ranks, ring
//                         attention across them on heads/U heads (USP).
#include "tessera/comm/communicator.h"
#include "tessera/nn/attention.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/nn/sequence_layout.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

namespace tessera {
namespace nn {

class UlyssesAttentionImpl : public torch::nn::Module {
 public:
  // `dropout` acts on the attention probabilities of the local heads.
  UlyssesAttentionImpl(int64_t head_dim, torch::nn::AnyModule dropout, comm::CommunicatorPtr group,
                       SequenceLayout layout);
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);

 private:
  int64_t head_dim_;
  comm::CommunicatorPtr group_;
  SequenceLayout layout_;
  LocalAttention local_{nullptr};
};
TORCH_MODULE(UlyssesAttention);

// The side of ring attention's score tiles, in tokens, for b·h heads
// (Note [Ring attention tiles]): the largest power of two, at least 64,
// with b·h·T² ≤ 2^20.
int64_t ring_tile_tokens(int64_t batch_heads);

class RingAttentionImpl : public torch::nn::Module {
 public:
  // `dropout` (p may be 0) drops attention probabilities block by block:
  // each block's mask is drawn from a seed of its stream and the block's
  // coordinates, and drawn again in backward (Note [Ring attention dropout]).
  RingAttentionImpl(int64_t head_dim, ParallelDropout dropout, comm::CommunicatorPtr group, SequenceLayout layout);
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);

 private:
  int64_t head_dim_;
  ParallelDropout dropout_;
  comm::CommunicatorPtr group_;
  SequenceLayout layout_;
};
TORCH_MODULE(RingAttention);

class RingSelfAttentionImpl : public torch::nn::Module {
 public:
  RingSelfAttentionImpl(int64_t head_dim, torch::nn::AnyModule dropout, comm::CommunicatorPtr group,
                        SequenceLayout layout);
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);

 private:
  int64_t head_dim_;
  torch::nn::AnyModule dropout_;
  comm::CommunicatorPtr group_;
  SequenceLayout layout_;
};
TORCH_MODULE(RingSelfAttention);

class HybridAttentionImpl : public torch::nn::Module {
 public:
  // `layout` has ulysses() == ulysses_group->size(); the ring group holds the
  // ranks of ring_layout(). `dropout` acts as in RingAttention on the local
  // heads.
  HybridAttentionImpl(int64_t head_dim, ParallelDropout dropout, comm::CommunicatorPtr ulysses_group,
                      comm::CommunicatorPtr ring_group, SequenceLayout layout);
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);

 private:
  int64_t head_dim_;
  comm::CommunicatorPtr ulysses_;
  SequenceLayout layout_;
  RingAttention ring_{nullptr};
};
TORCH_MODULE(HybridAttention);

}  // namespace nn
}  // namespace tessera
