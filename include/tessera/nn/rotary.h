#pragma once
// Rotary position embeddings (Su et al. 2021) in the convention of Llama,
// Mistral and Qwen as Hugging Face writes them: a head's dimension splits in
// two halves, x·cos + rotate_half(x)·sin with rotate_half(x) = [-x₂, x₁] and
// angle position · θ^(-2i/d) for i < d/2, computed in fp32.
//
// Llama 3's frequency scaling (`rope_scaling` of type "llama3") divides the
// low frequencies by `factor`, keeps the high ones and blends the band in
// between; it lets a model trained at original_context run at longer ones.
//
// The layer holds no parameters. It takes each token's position in the whole
// sequence (LayerFactory::attention_positions), so a sequence shard (ring,
// zigzag, Ulysses) rotates its tokens exactly as the serial model does.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>
#include <utility>

namespace tessera {
namespace nn {

struct Llama3RopeScaling {
  TORCH_ARG(double, factor) = 8.0;
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  TORCH_ARG(int64_t, original_context) = 8192;  // original_max_position_embeddings
};

struct RotaryOptions {
  /* implicit */ RotaryOptions(int64_t head_dim) : head_dim_(head_dim) {}  // NOLINT
  TORCH_ARG(int64_t, head_dim);  // even
  TORCH_ARG(double, theta) = 10000.0;
  TORCH_ARG(c10::optional<Llama3RopeScaling>, scaling) = c10::nullopt;
};

// The inverse frequencies θ^(-2i/d), i < d/2, after scaling; fp32 [d/2].
at::Tensor rotary_inverse_frequencies(const RotaryOptions& options);
// cos and sin [tokens, d] of the angles positions ⊗ inverse_frequencies
// (computed in fp32), in `dtype` on `device`.
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const at::Tensor& inverse_frequencies, const at::Tensor& positions,
                                                 at::ScalarType dtype, at::Device device);
// x [..., tokens, d] rotated: x·cos + rotate_half(x)·sin.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

class RotaryEmbeddingImpl : public torch::nn::Cloneable<RotaryEmbeddingImpl> {
 public:
  explicit RotaryEmbeddingImpl(const RotaryOptions& options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // x [..., tokens, head_dim], positions [tokens] (int64) -> x rotated.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions);

  RotaryOptions options;

 private:
  at::Tensor inverse_frequencies_;  // not a buffer: derived from the options, never saved
  // cos and sin of the last positions seen, in the last type and device: q
  // and k of a block, and every step after the first, rotate by the same.
  at::Tensor positions_, cos_, sin_;
};

TORCH_MODULE(RotaryEmbedding);

}  // namespace nn
}  // namespace tessera
