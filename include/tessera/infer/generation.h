#pragma once
// Text generation: the prompt in one forward (prefill), then one forward
// per new token (through the KV cache of a StreamedGPT, or over the last
// context of a WindowedGPT); each next token drawn from the last position's
// logits with temperature and top-k.
#include "tessera/comm/communicator.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace infer {

struct SamplingOptions {
  // 0: greedy (the most likely token); otherwise softmax(logits / temperature).
  TORCH_ARG(double, temperature) = 1.0;
  // Draw among the k most likely tokens only; 0: all.
  TORCH_ARG(int64_t, top_k) = 0;
  TORCH_ARG(uint64_t, seed) = 0;

 public:
  SamplingOptions() = default;
};

// logits [batch, vocab] -> the next token of each row, [batch] int64.
at::Tensor sample_tokens(const at::Tensor& logits, const SamplingOptions& options, at::Generator& generator);

// What generate() drives: a model that continues a batch of sequences.
class TokenModel {
 public:
  virtual ~TokenModel() = default;
  // Forgets every sequence; `batch` new ones start.
  virtual void reset(int64_t batch) = 0;
  // ids [batch, t] continue every sequence; returns their logits [batch, t,
  // vocab] in float over the whole vocabulary, on every rank of group().
  // Collective over group().
  virtual at::Tensor forward(const at::Tensor& ids) = 0;
  // The ranks that compute together, whose rank 0 draws the tokens; null:
  // this rank alone.
  virtual const comm::CommunicatorPtr& group() const = 0;
};

struct Generation {
  at::Tensor tokens;               // [batch, new tokens]
  std::vector<at::Tensor> logits;  // per new token, [batch, vocab] (with keep_logits)
  double prefill_seconds = 0;
  double decode_seconds = 0;       // the forwards after the prefill
  // New tokens after the first (each one decode forward) per second.
  double decode_tokens_per_second() const;
};

// prompt [batch, p >= 1] int64. Collective over model.group(): every rank
// passes the same prompt; rank 0 of the group draws each token and sends it
// to the others, so they continue alike.
Generation generate(TokenModel& model, const at::Tensor& prompt, int64_t new_tokens,
                    const SamplingOptions& options = {}, bool keep_logits = false);

}  // namespace infer
}  // namespace tessera
