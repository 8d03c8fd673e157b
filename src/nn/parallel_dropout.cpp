#include "tessera/nn/parallel_dropout.h"

#include "tessera/core/hash.h"

#include <ATen/ATen.h>

#include <limits>
#include <mutex>
#include <set>

namespace tessera {
namespace nn {

ParallelDropoutImpl::ParallelDropoutImpl(const ParallelDropoutOptions& options_) : options(options_) {
  TORCH_CHECK(options.p() >= 0.0 && options.p() < 1.0, "ParallelDropout: p must be in [0, 1), got ", options.p());
  reset();
}

void ParallelDropoutImpl::reset() {
  generators_.clear();
  row_generators_.clear();
}

at::Generator& ParallelDropoutImpl::generator_for(const c10::Device& device) {
  const std::string key = device.str();
  auto it = generators_.find(key);
  if (it == generators_.end()) {
    // A private copy of the device's default generator type, reseeded: the
    // program's global random stream is left untouched.
    at::Generator gen = at::globalContext().defaultGenerator(device).clone();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(options.seed());
    }
    it = generators_.emplace(key, gen).first;
  }
  return it->second;
}

at::Tensor ParallelDropoutImpl::forward(const at::Tensor& input) {
  if (!is_training() || options.p() == 0.0) return input;
  const double keep = 1.0 - options.p();
  at::Tensor mask = at::empty_like(input, input.options().requires_grad(false));
  if (!options.row_keyed()) {
    mask.bernoulli_(keep, generator_for(input.device()));
    return input * mask.div_(keep);
  }
  // Note [Row-keyed dropout]
  const uint64_t call = draw_seed();
  auto it = row_generators_.find(input.device().str());
  if (it == row_generators_.end())
    it = row_generators_.emplace(input.device().str(), at::globalContext().defaultGenerator(input.device()).clone())
             .first;
  at::Generator& gen = it->second;
  const int64_t rows = input.dim() == 0 ? 1 : input.size(0);
  at::Tensor by_row = input.dim() == 0 ? mask.view({1}) : mask;
  for (int64_t r = 0; r < rows; ++r) {
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(splitmix64(call ^ splitmix64(static_cast<uint64_t>(first_row_ + r))));
    }
    by_row.select(0, r).bernoulli_(keep, gen);
  }
  return input * mask.div_(keep);
}

uint64_t ParallelDropoutImpl::draw_seed() {
  at::Tensor seed = at::empty({1}, at::kLong);
  seed.random_(0, std::numeric_limits<int64_t>::max(), generator_for(c10::Device(c10::kCPU)));
  return static_cast<uint64_t>(seed.item<int64_t>());
}

namespace {

// Generators are handles: a copy of the state is a clone.
ParallelDropoutImpl::RngState clone_streams(const ParallelDropoutImpl::RngState& streams) {
  ParallelDropoutImpl::RngState out;
  for (const auto& entry : streams) {
    at::Generator gen = entry.second;
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace(entry.first, gen.clone());
  }
  return out;
}

}  // namespace

ParallelDropoutImpl::RngState ParallelDropoutImpl::rng_state() const { return clone_streams(generators_); }

void ParallelDropoutImpl::set_rng_state(const RngState& state) { generators_ = clone_streams(state); }

void ParallelDropoutImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::ParallelDropout(p=" << options.p() << ", seed=" << options.seed()
         << (options.row_keyed() ? ", row_keyed" : "") << ")";
}

std::vector<ParallelDropoutImpl*> dropout_layers(torch::nn::Module& module) {
  std::vector<ParallelDropoutImpl*> out;
  std::set<const void*> seen;
  for (const auto& m : module.modules())
    if (auto* d = dynamic_cast<ParallelDropoutImpl*>(m.get()); d != nullptr && seen.insert(d).second)
      out.push_back(d);
  return out;
}

}  // namespace nn
}  // namespace tessera
