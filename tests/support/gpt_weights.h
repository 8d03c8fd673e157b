#pragma once
// The full weights the GPT serial-equivalence tests load into both sides:
// tessera's GPT-2 initialisation from a seed, taken in one process (the same
// whatever the layout, Note [Layout-independent initialization]). Tessera's
// GPT is the source of weights only; the serial computation is
// tests/reference_gpt.h's.
#include "test_util.h"

#include "tessera/models/gpt.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <map>
#include <string>

namespace tessera {
namespace test {

inline std::map<std::string, at::Tensor> gpt_initial_weights(const models::GPTConfig& c, uint64_t seed) {
  auto w = world();
  torch::manual_seed(seed);
  models::GPT source(c, nn::make_1d_factory(w->split(w->rank(), 0, "self"), false, 1234, 5678));
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : source->full_state()) out[entry.first] = entry.second.clone();
  return out;
}

// gpt_initial_weights with every 1-d tensor moved off its initial value:
// biases and LayerNorm biases N(0, 0.1) instead of 0, LayerNorm weights
// 1 + N(0, 0.1) instead of 1. With these a dropped or mis-sharded bias, or
// two norms swapped, changes the answer.
inline std::map<std::string, at::Tensor> gpt_random_weights(const models::GPTConfig& c, uint64_t seed) {
  auto out = gpt_initial_weights(c, seed);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1000);
  for (auto& [name, t] : out)
    if (t.dim() == 1) t = t + 0.1 * at::randn(t.sizes(), gen, t.options());
  return out;
}

// Token ids [rows, seq] in [0, vocab) from their own generator.
inline at::Tensor seeded_token_ids(uint64_t seed, int64_t vocab, int64_t rows, int64_t seq) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(vocab, {rows, seq}, gen, at::kLong);
}

}  // namespace test
}  // namespace tessera
