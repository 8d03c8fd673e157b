#pragma once
// Text generation with a StreamedGPT: the prompt in one forward (prefill),
// then one forward per new token through the KV cache; each next token
// drawn from the last position's logits with temperature and top-k.
#include "tessera/train/streamed_gpt.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace train {

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
Generation generate(StreamedGPT& model, const at::Tensor& prompt, int64_t new_tokens,
                    const SamplingOptions& options = {}, bool keep_logits = false);

}  // namespace train
}  // namespace tessera
