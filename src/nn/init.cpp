#include "tessera/nn/init.h"

#include "tessera/core/hash.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

namespace tessera {
namespace nn {
namespace {

// FNV-1a: stable across runs and compilers, unlike std::hash.
uint64_t hash_name(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

}  // namespace

void init_blockwise(const ParamPlacement& p, uint64_t seed, const std::string& name, const BlockDraw& draw) {
  at::NoGradGuard no_grad;
  at::Tensor local = p.param.detach();
  if (p.region_numel() != local.numel()) local.zero_();
  if (p.full_shape.empty()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(splitmix64(seed ^ hash_name(name)));
    at::Tensor block = at::empty({}, local.options().device(at::kCPU).dtype(at::kFloat));
    draw(block, gen);
    local.copy_(block);
    return;
  }
  const int64_t rows = p.full_shape[0];
  int64_t row_numel = 1;
  for (size_t d = 1; d < p.full_shape.size(); ++d) row_numel *= p.full_shape[d];
  const int64_t block_rows = std::max<int64_t>(1, kInitBlockElements / std::max<int64_t>(row_numel, 1));
  const int64_t begin = p.offset[0], end = p.offset[0] + p.length[0];
  const uint64_t base = splitmix64(seed ^ hash_name(name));
  for (int64_t b = begin / block_rows; b * block_rows < end; ++b) {
    const int64_t b0 = b * block_rows, b1 = std::min(rows, b0 + block_rows);
    std::vector<int64_t> shape = p.full_shape;
    shape[0] = b1 - b0;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(splitmix64(base + static_cast<uint64_t>(b)));
    at::Tensor block = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
    draw(block, gen);
    // The overlap of the block with the region, and where it goes locally.
    const int64_t r0 = std::max(b0, begin), r1 = std::min(b1, end);
    at::Tensor src = block.narrow(0, r0 - b0, r1 - r0);
    at::Tensor dst = local.narrow(0, r0 - begin, r1 - r0);
    for (size_t d = 1; d < p.full_shape.size(); ++d) {
      const auto dim = static_cast<int64_t>(d);
      src = src.narrow(dim, p.offset[d], p.length[d]);
      dst = dst.narrow(dim, 0, p.length[d]);
    }
    dst.copy_(src);
  }
}

BlockDraw normal_draw(double mean, double std) {
  return [mean, std](at::Tensor& block, at::Generator& gen) { block.normal_(mean, std, gen); };
}

BlockDraw uniform_draw(double low, double high) {
  return [low, high](at::Tensor& block, at::Generator& gen) { block.uniform_(low, high, gen); };
}

uint64_t draw_seed() {
  return static_cast<uint64_t>(at::randint(int64_t(1) << 62, {1}, at::kLong).item<int64_t>());
}

}  // namespace nn
}  // namespace tessera
