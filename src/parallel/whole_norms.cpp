#include "tessera/parallel/whole_norms.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <set>

namespace tessera {
namespace parallel {

PlacementNorms::PlacementNorms(const nn::NamedPlacements& placements) {
  for (const auto& [name, p] : placements) {
    std::vector<size_t> mine;
    for (const auto& g : p.shard_groups()) {
      auto it = std::find(groups_.begin(), groups_.end(), g);
      if (it == groups_.end()) it = groups_.insert(groups_.end(), g);
      mine.push_back(static_cast<size_t>(it - groups_.begin()));
    }
    if (!mine.empty()) groups_of_[p.param.unsafeGetTensorImpl()] = std::move(mine);
  }
}

void PlacementNorms::reduce(const std::vector<at::Tensor>& params, at::Tensor& squares) const {
  // Summing over each shard group in turn sums over their product.
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<double> flags(params.size(), 0.0);
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = groups_of_.find(params[i].unsafeGetTensorImpl());
      if (it != groups_of_.end() && std::count(it->second.begin(), it->second.end(), g)) flags[i] = 1.0;
    }
    const at::Tensor mask =
        at::tensor(flags, at::kDouble).view({static_cast<int64_t>(params.size()), 1}).to(squares.device());
    at::Tensor summed = squares * mask;
    groups_[g]->all_reduce(summed);
    squares = summed + squares * (1.0 - mask);
  }
}

at::Tensor WholeNorms::total(const std::vector<at::Tensor>& params, at::Tensor squares) const {
  reduce(params, squares);
  return squares.select(1, 0).sum().view({1});
}

namespace {

// Note [One host sync per step]
// Norms stay on the parameters' device: each tensor's squared norm is a
// device scalar, the table is stacked there, reduced over the groups there
// (device tensors on the device channel), and clipping reads the total once
// (the step's one device-to-host read for norms); the loss scaler's
// overflow check is fused the same way. The per-tensor .item() this
// replaces was one synchronisation per parameter on a GPU.

// [n, 1] local squared norms of the tensors (or their gradients), float64 on
// their device.
at::Tensor local_squares(const std::vector<at::Tensor>& params, bool gradients) {
  at::NoGradGuard no_grad;
  c10::Device device(c10::kCPU);
  for (const auto& p : params) {
    device = p.device();
    break;
  }
  const at::Tensor zero = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  std::vector<at::Tensor> rows;
  rows.reserve(params.size());
  for (const auto& p : params) {
    const at::Tensor t = gradients ? p.grad() : p;
    if (!t.defined()) {
      rows.push_back(zero);
      continue;
    }
    const at::Tensor n = t.detach().to(at::kDouble).norm();
    rows.push_back((n * n).view({1}));
  }
  if (rows.empty()) return at::zeros({0, 1}, at::TensorOptions().dtype(at::kDouble).device(device));
  return at::stack(rows);
}

}  // namespace

at::Tensor whole_squares(const std::vector<at::Tensor>& params, const WholeNorms* norms, bool gradients) {
  at::Tensor squares = local_squares(params, gradients);
  if (norms != nullptr) norms->reduce(params, squares);
  return squares.view({-1});
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, const WholeNorms* norms,
                      const std::vector<comm::CommunicatorPtr>& across, const std::vector<at::Tensor>& uncounted) {
  TORCH_CHECK(max_norm > 0 && std::isfinite(max_norm),
              "clip_grad_norm: max_norm must be a positive finite number, got ", max_norm);
  at::Tensor squares = local_squares(params, /*gradients=*/true);
  at::Tensor total = norms != nullptr ? norms->total(params, squares) : squares.sum().view({1});
  total = total.contiguous();
  for (const auto& group : across)
    if (group && group->size() > 1) group->all_reduce(total);
  const double norm = std::sqrt(total.item<double>());  // Note [One host sync per step]
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard no_grad;
    for (const auto* list : {&params, &uncounted})
      for (const auto& p : *list)
        if (p.grad().defined()) p.grad().mul_(coef);
  }
  return norm;
}

}  // namespace parallel
}  // namespace tessera
