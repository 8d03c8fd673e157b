#include "tessera/infer/generation.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <cmath>
#include <limits>

namespace tessera {
namespace infer {

at::Tensor sample_tokens(const at::Tensor& logits, const SamplingOptions& o, at::Generator& generator) {
  TORCH_CHECK(logits.dim() == 2, "sample_tokens: logits must be [batch, vocab], got ", logits.sizes());
  TORCH_CHECK(o.temperature() >= 0 && std::isfinite(o.temperature()), "sampling: temperature must be >= 0 (0: ",
              "greedy), got ", o.temperature());
  TORCH_CHECK(o.top_k() >= 0 && o.top_k() <= logits.size(1), "sampling: top_k must lie in [0, ", logits.size(1),
              "] (0: every token), got ", o.top_k());
  const at::Tensor x = logits.to(at::kFloat);
  if (o.temperature() == 0) return x.argmax(1);
  at::Tensor scaled = x / o.temperature();
  if (o.top_k() > 0 && o.top_k() < x.size(1)) {
    const at::Tensor kth = std::get<0>(scaled.topk(o.top_k(), 1)).narrow(1, o.top_k() - 1, 1);
    scaled = scaled.masked_fill(scaled < kth, -std::numeric_limits<float>::infinity());
  }
  return at::multinomial(at::softmax(scaled, 1), 1, false, generator).squeeze(1);
}

double Generation::decode_tokens_per_second() const {
  const int64_t steps = tokens.defined() ? tokens.size(1) - 1 : 0;
  return decode_seconds > 0 ? static_cast<double>(steps * tokens.size(0)) / decode_seconds : 0.0;
}

Generation generate(TokenModel& model, const at::Tensor& prompt, int64_t new_tokens, const SamplingOptions& o,
                    bool keep_logits) {
  TORCH_CHECK(prompt.dim() == 2 && prompt.size(1) >= 1, "generate: the prompt must be [batch, tokens >= 1], got ",
              prompt.sizes());
  TORCH_CHECK(new_tokens >= 1, "generate: new_tokens must be >= 1, got ", new_tokens);
  const auto& group = model.group();
  const bool drawer = group == nullptr || group->rank() == 0;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(o.seed());
  model.reset(prompt.size(0));
  Generation out;
  std::vector<at::Tensor> tokens;
  at::Tensor ids = prompt.to(at::kLong);
  for (int64_t i = 0; i < new_tokens; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor last = model.forward(ids).select(1, ids.size(1) - 1);
    at::Tensor next = drawer ? sample_tokens(last, o, generator) : at::empty({last.size(0)}, at::kLong);
    if (group != nullptr && group->size() > 1) group->control()->broadcast(next)->wait();  // from rank 0
    (i == 0 ? out.prefill_seconds : out.decode_seconds) +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (keep_logits) out.logits.push_back(last);
    tokens.push_back(next);
    ids = next.unsqueeze(1);
  }
  out.tokens = at::stack(tokens, 1);
  return out;
}

}  // namespace infer
}  // namespace tessera
