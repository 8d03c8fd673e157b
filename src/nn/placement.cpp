#include "tessera/nn/placement.h"

#include "tessera/comm/functional.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <map>
#include <sstream>

namespace tessera {
namespace nn {
namespace {

bool useful(const comm::CommunicatorPtr& g) { return g != nullptr && g->size() > 1; }

std::vector<comm::CommunicatorPtr> groups_of(const std::vector<AxisPlacement>& axes, AxisKind kind) {
  std::vector<comm::CommunicatorPtr> out;
  for (const auto& a : axes)
    if (a.kind == kind && useful(a.group)) out.push_back(a.group);
  return out;
}

}  // namespace

bool ParamPlacement::whole() const {
  for (size_t d = 0; d < full_shape.size(); ++d)
    if (offset[d] != 0 || length[d] != full_shape[d]) return false;
  return true;
}

int64_t ParamPlacement::region_numel() const {
  int64_t n = 1;
  for (int64_t l : length) n *= l;
  return n;
}

int64_t ParamPlacement::valid_numel() const {
  if (param.dim() == 0) return param.numel();
  for (size_t d = 1; d < length.size(); ++d)
    TORCH_INTERNAL_ASSERT(length[d] == param.size(static_cast<int64_t>(d)),
                          "a placement pads dimension ", d, "; padding is supported along dimension 0 only");
  return length[0] * (param.numel() / std::max<int64_t>(param.size(0), 1));
}

std::vector<comm::CommunicatorPtr> ParamPlacement::shard_groups() const { return groups_of(axes, AxisKind::kShard); }
std::vector<comm::CommunicatorPtr> ParamPlacement::gradient_groups() const {
  return groups_of(axes, AxisKind::kPartial);
}

ParamPlacement& ParamPlacement::shard(std::string axis, comm::CommunicatorPtr group, int64_t dim, int64_t full_size) {
  TORCH_CHECK(group != nullptr, "placement of axis '", axis, "': the group is null");
  TORCH_CHECK(dim >= 0 && dim < param.dim(), "placement of axis '", axis, "': dimension ", dim,
              " does not exist in a parameter of shape ", param.sizes());
  axes.push_back({std::move(axis), std::move(group), AxisKind::kShard, dim});
  // Block index along dim: the first axis outermost (Note [Placement model]).
  int64_t index = 0, blocks = 1;
  for (const auto& a : axes) {
    if (a.kind != AxisKind::kShard || a.dim != dim) continue;
    index = index * a.group->size() + a.group->rank();
    blocks *= a.group->size();
  }
  const int64_t chunk = param.size(dim);
  full_shape[dim] = full_size >= 0 ? full_size : chunk * blocks;
  TORCH_CHECK(full_shape[dim] > 0 && full_shape[dim] <= chunk * blocks && (dim == 0 || full_shape[dim] == chunk * blocks),
              "placement of axis '", axes.back().axis, "': ", blocks, " chunks of ", chunk, " along dimension ", dim,
              " cannot hold a full size of ", full_shape[dim], " (only dimension 0 may be padded)");
  offset[dim] = std::min(full_shape[dim], chunk * index);
  length[dim] = std::min(chunk, full_shape[dim] - offset[dim]);
  return *this;
}

ParamPlacement& ParamPlacement::replicate(std::string axis, comm::CommunicatorPtr group) {
  TORCH_CHECK(group != nullptr, "placement of axis '", axis, "': the group is null");
  axes.push_back({std::move(axis), std::move(group), AxisKind::kReplicate, -1});
  return *this;
}

ParamPlacement& ParamPlacement::partial(std::string axis, comm::CommunicatorPtr group) {
  TORCH_CHECK(group != nullptr, "placement of axis '", axis, "': the group is null");
  axes.push_back({std::move(axis), std::move(group), AxisKind::kPartial, -1});
  return *this;
}

std::string ParamPlacement::describe() const {
  std::ostringstream out;
  for (size_t i = 0; i < axes.size(); ++i) {
    const auto& a = axes[i];
    out << (i ? " " : "") << a.axis << ":"
        << (a.kind == AxisKind::kShard ? "S(" + std::to_string(a.dim) + ")"
                                       : a.kind == AxisKind::kPartial ? "P" : "R");
  }
  return axes.empty() ? "whole" : out.str();
}

ParamPlacement replicated_placement(const at::Tensor& param) {
  ParamPlacement p;
  p.param = param;
  p.full_shape = param.sizes().vec();
  p.offset.assign(p.full_shape.size(), 0);
  p.length = p.full_shape;
  return p;
}

ParamPlacement sharded_placement(const at::Tensor& param, int64_t dim, int64_t full_size,
                                 const comm::CommunicatorPtr& group, const std::string& axis) {
  return replicated_placement(param).shard(axis, group, dim, full_size);
}

namespace {

// A parameter emptied on this rank (Note [Other stages released]) cannot be read or written here.
void check_held(const ParamPlacement& p, const char* what) {
  int64_t held = 1;
  for (int64_t n : p.length) held *= n;
  TORCH_CHECK(held == 0 || p.param.numel() > 0, what, ": this rank holds no data of a parameter of full shape ",
              c10::IntArrayRef(p.full_shape),
              ": its layer belongs to another pipeline rank's stage and was released here (PipelineExecutor); "
              "read or load it on the rank that runs the stage, or through a checkpoint");
}

}  // namespace

void load_full(const ParamPlacement& p, const at::Tensor& full) {
  check_held(p, "load_full");
  TORCH_CHECK(full.sizes().vec() == p.full_shape, "load_full: a tensor of shape ", full.sizes(), " given, ",
              c10::IntArrayRef(p.full_shape), " expected");
  at::NoGradGuard no_grad;
  at::Tensor src = full.detach();
  at::Tensor dst = p.param.detach();
  for (size_t d = 0; d < p.full_shape.size(); ++d) {
    const auto dim = static_cast<int64_t>(d);
    src = src.narrow(dim, p.offset[d], p.length[d]);
    dst = dst.narrow(dim, 0, p.length[d]);
  }
  if (dst.numel() != p.param.numel()) p.param.detach().zero_();
  dst.copy_(src);
}

at::Tensor gather_full(const ParamPlacement& p, const at::Tensor& local) {
  at::NoGradGuard no_grad;
  at::Tensor t = local.detach();
  for (auto it = p.axes.rbegin(); it != p.axes.rend(); ++it)
    if (it->kind == AxisKind::kShard && it->group->size() > 1) t = comm::raw::all_gather(t, it->dim, *it->group);
  for (size_t d = 0; d < p.full_shape.size(); ++d)
    if (t.size(static_cast<int64_t>(d)) != p.full_shape[d]) t = t.narrow(static_cast<int64_t>(d), 0, p.full_shape[d]);
  return t.is_same(local) || t.data_ptr() == local.data_ptr() ? t.clone() : t.contiguous();
}

at::Tensor full_value(const ParamPlacement& p, bool gradients) {
  check_held(p, "full_value");
  if (!gradients) return gather_full(p, p.param);
  const at::Tensor g = p.param.grad();
  return gather_full(p, g.defined() ? g : at::zeros_like(p.param));
}

void reduce_partial_gradients(const NamedPlacements& placements) {
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : placements) {
    if (!p.param.grad().defined()) continue;
    for (const auto& g : p.gradient_groups()) g->all_reduce(p.param.mutable_grad());
  }
}

NamedPlacements placements_of(torch::nn::Module& module,
                              const std::function<ParamPlacement(const at::Tensor&)>& replicated) {
  std::map<const c10::TensorImpl*, ParamPlacement> placed;
  auto add = [&](torch::nn::Module* m) {
    auto* placed_module = dynamic_cast<PlacedModule*>(m);
    if (placed_module == nullptr) return;
    for (auto& [name, p] : placed_module->local_placements())
      if (p.defined()) placed.emplace(p.param.unsafeGetTensorImpl(), std::move(p));
  };
  // The module itself apart: it may not be held by a shared_ptr yet (a constructor).
  add(&module);
  for (const auto& item : module.named_modules("", /*include_self=*/false)) add(item.value().get());
  NamedPlacements out;
  for (const auto& item : module.named_parameters()) {
    auto it = placed.find(item.value().unsafeGetTensorImpl());
    out.emplace_back(item.key(), it != placed.end() ? it->second : replicated(item.value()));
  }
  return out;
}

}  // namespace nn
}  // namespace tessera
