#pragma once
// A GPT in memory as generate()'s TokenModel, without a KV cache: it keeps
// each sequence's tokens and runs the model over the last `context` of them
// for every new token. Any length and every layer the model has (experts
// too), at the cost of recomputing the window; for short samples from a
// model just trained (train_gpt's --sample). StreamedGPT is the fast path.
#include "tessera/models/gpt.h"
#include "tessera/infer/generation.h"

#include <ATen/core/Tensor.h>

#include <memory>

namespace tessera {
namespace infer {

class WindowedGPT : public TokenModel {
 public:
  // A GPT on a group of one rank (its factory's tensor group has size 1).
  explicit WindowedGPT(std::shared_ptr<models::GPTImpl> gpt);

  void reset(int64_t batch) override;
  // ids [batch, t], t <= the context; logits of those t positions, each
  // over the context before it.
  at::Tensor forward(const at::Tensor& ids) override;
  const comm::CommunicatorPtr& group() const override { return group_; }

 private:
  std::shared_ptr<models::GPTImpl> gpt_;
  at::Tensor history_;  // [batch, tokens so far]
  comm::CommunicatorPtr group_;  // null: this rank alone
};

}  // namespace infer
}  // namespace tessera
