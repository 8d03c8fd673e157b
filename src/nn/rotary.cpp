#include "tessera/nn/rotary.h"

#include <ATen/ATen.h>

#include <cmath>
#include <tuple>

namespace tessera {
namespace nn {

at::Tensor rotary_inverse_frequencies(const RotaryOptions& o) {
  const int64_t d = o.head_dim();
  // fp32 throughout, as the reference implementations compute it.
  at::Tensor inv = at::pow(o.theta(), at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d))
                       .reciprocal();
  if (!o.scaling()) return inv;
  const Llama3RopeScaling& s = *o.scaling();
  const double original = static_cast<double>(s.original_context());
  const double low_wavelen = original / s.low_freq_factor(), high_wavelen = original / s.high_freq_factor();
  const at::Tensor wavelen = 2 * M_PI / inv;
  const at::Tensor scaled = at::where(wavelen > low_wavelen, inv / s.factor(), inv);
  const at::Tensor smooth = (original / wavelen - s.low_freq_factor()) / (s.high_freq_factor() - s.low_freq_factor());
  const at::Tensor blended = (1 - smooth) * scaled / s.factor() + smooth * scaled;
  const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, blended, scaled);
}

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const at::Tensor& inverse_frequencies, const at::Tensor& positions,
                                                 at::ScalarType dtype, at::Device device) {
  const at::Tensor angles =
      at::outer(positions.to(device).to(at::kFloat), inverse_frequencies.to(device));  // [tokens, d/2]
  const at::Tensor both = at::cat({angles, angles}, -1);
  return {both.cos().to(dtype), both.sin().to(dtype)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
}

RotaryEmbeddingImpl::RotaryEmbeddingImpl(const RotaryOptions& options_) : options(options_) { reset(); }

void RotaryEmbeddingImpl::reset() {
  TORCH_CHECK(options.head_dim() > 0 && options.head_dim() % 2 == 0, "rotary position embeddings need an even head "
              "dimension (the two halves rotate as pairs); got head_dim ", options.head_dim(),
              "; choose an even head dimension or learned positions");
  TORCH_CHECK(options.theta() > 0, "rotary theta must be positive, got ", options.theta());
  if (options.scaling()) {
    const auto& s = *options.scaling();
    TORCH_CHECK(s.factor() > 0 && s.original_context() > 0 && s.high_freq_factor() > s.low_freq_factor() &&
                    s.low_freq_factor() > 0,
                "llama3 rope scaling needs factor > 0, original_context > 0 and high_freq_factor > "
                "low_freq_factor > 0; got factor ", s.factor(), ", original_context ", s.original_context(), ", low_freq_factor ",
                s.low_freq_factor(), ", high_freq_factor ", s.high_freq_factor());
  }
  inverse_frequencies_ = rotary_inverse_frequencies(options);
}

at::Tensor RotaryEmbeddingImpl::forward(const at::Tensor& x, const at::Tensor& positions) {
  const int64_t d = options.head_dim();
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) == d, "RotaryEmbedding: expected [..., tokens, ", d, "], got ", x.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(-2), "RotaryEmbedding: positions must be [",
              x.size(-2), "], got ", positions.sizes());
  const bool cached = cos_.defined() && cos_.device() == x.device() && cos_.scalar_type() == x.scalar_type() &&
                      positions_.sizes() == positions.sizes() && positions_.equal(positions.to(positions_.device()));
  if (!cached) {
    positions_ = positions.to(at::kCPU).clone();
    std::tie(cos_, sin_) = rotary_cos_sin(inverse_frequencies_, positions, x.scalar_type(), x.device());
  }
  return apply_rotary(x, cos_, sin_);
}

void RotaryEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::RotaryEmbedding(head_dim=" << options.head_dim() << ", theta=" << options.theta()
         << (options.scaling() ? ", llama3 scaling" : "") << ")";
}

}  // namespace nn
}  // namespace tessera
