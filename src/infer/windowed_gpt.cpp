#include "tessera/infer/windowed_gpt.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace tessera {
namespace infer {

WindowedGPT::WindowedGPT(std::shared_ptr<models::GPTImpl> gpt) : gpt_(std::move(gpt)) {
  TORCH_CHECK(gpt_ != nullptr, "WindowedGPT: the model must not be null");
  TORCH_CHECK(gpt_->factory()->tensor_group()->size() == 1, "WindowedGPT: the model must run on one rank (a factory "
              "over a group of one); its tensor group has ", gpt_->factory()->tensor_group()->size(), " ranks");
  gpt_->eval();
}

void WindowedGPT::reset(int64_t batch) {
  TORCH_CHECK(batch >= 1, "WindowedGPT::reset: batch must be >= 1, got ", batch);
  history_ = at::empty({batch, 0}, at::kLong);
}

at::Tensor WindowedGPT::forward(const at::Tensor& ids) {
  const int64_t context = gpt_->config().context(), t = ids.size(1);
  TORCH_CHECK(history_.defined() && ids.dim() == 2 && ids.size(0) == history_.size(0),
              "WindowedGPT::forward: ids must be [", history_.defined() ? history_.size(0) : 0,
              ", t] (the batch of the last reset), got ", ids.sizes());
  TORCH_CHECK(t >= 1 && t <= context, "WindowedGPT::forward: ", t, " tokens at once; 1 to the context of ", context);
  history_ = at::cat({history_, ids.to(at::kLong)}, 1);
  const int64_t w = std::min(context, history_.size(1));
  at::NoGradGuard no_grad;
  const at::Tensor logits = gpt_->forward(history_.narrow(1, history_.size(1) - w, w));
  return logits.narrow(1, w - t, t).narrow(-1, 0, gpt_->config().vocab()).to(at::kFloat);
}

}  // namespace infer
}  // namespace tessera
