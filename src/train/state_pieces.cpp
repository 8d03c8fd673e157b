#include "tessera/train/state_pieces.h"

#include "tessera/optim/param_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>

namespace tessera {
namespace train {
namespace {

using PlacementMap = std::map<const c10::TensorImpl*, const std::pair<std::string, nn::ParamPlacement>*>;

PlacementMap by_param(const Placements& placements) {
  PlacementMap out;
  for (const auto& p : placements) out[p.second.param.unsafeGetTensorImpl()] = &p;
  return out;
}

int64_t valid_numel(const nn::ParamPlacement& p) { return p.valid_numel(); }

TensorPiece piece_of(const std::string& name, const nn::ParamPlacement& p, int64_t begin, int64_t end,
                     const at::Tensor& data) {
  TensorPiece t;
  t.name = name;
  t.full_shape = p.full_shape;
  if (!p.whole()) {
    t.offset = p.offset;
    t.length = p.length;
  }
  const bool whole = begin == 0 && end == p.param.numel() && valid_numel(p) == end;
  t.flat_begin = whole ? 0 : begin;
  t.flat_end = whole ? -1 : end;
  t.data = data.detach();
  return t;
}

}  // namespace

Placements named_placements(torch::nn::Module& module) {
  Placements out;
  for (const auto& p : module.named_parameters()) out.emplace_back(p.key(), nn::replicated_placement(p.value()));
  return out;
}

std::vector<TensorPiece> optimizer_pieces(parallel::ShardedOptimizer& optimizer, const Placements& placements) {
  const PlacementMap where = by_param(placements);
  std::vector<TensorPiece> out;
  for (const auto& v : optimizer.piece_views()) {
    auto it = where.find(v.param.unsafeGetTensorImpl());
    TORCH_CHECK(it != where.end(), "optimizer_pieces: a parameter of shape ", v.param.sizes(),
                " has no placement; pass the model's placements (GPT::placements())");
    const auto& [name, placement] = *it->second;
    const int64_t end = std::min(v.end, valid_numel(placement));
    if (v.begin >= end) continue;  // padding only
    const at::Tensor value = v.value.narrow(0, 0, end - v.begin);
    out.push_back(piece_of("model/" + name, placement, v.begin, end, value));
    const optim::ParamState state = optim::get_param_state(optimizer.inner(), v.value);
    for (const auto& [key, tensor] : state.tensors)
      out.push_back(piece_of("optim/" + key + "/" + name, placement, v.begin, end,
                             tensor.view({-1}).narrow(0, 0, end - v.begin)));
    TensorPiece step;
    step.name = "optim/step/" + name;
    step.data = at::full({}, state.step, at::TensorOptions().dtype(at::kLong));
    out.push_back(std::move(step));
  }
  return out;
}

void load_optimizer_pieces(const CheckpointReader& reader, parallel::ShardedOptimizer& optimizer,
                           const Placements& placements) {
  const PlacementMap where = by_param(placements);
  at::NoGradGuard no_grad;
  // This rank's region of each tensor of the parameter being loaded, read
  // once (a parameter may have several pieces here); one parameter at a time.
  std::map<std::string, at::Tensor> cache;
  const c10::TensorImpl* cached_param = nullptr;
  auto region = [&](const std::string& key, const nn::ParamPlacement& p) {
    if (cached_param != p.param.unsafeGetTensorImpl()) {
      cache.clear();
      cached_param = p.param.unsafeGetTensorImpl();
    }
    auto it = cache.find(key);
    if (it == cache.end()) {
      TORCH_CHECK(reader.contains(key), "checkpoint ", reader.dir(), " has no '", key,
                  "': it was saved from another model or optimizer");
      const auto shape = reader.full_shape(key);
      TORCH_CHECK(shape == p.full_shape, "checkpoint ", reader.dir(), ": '", key, "' has shape ",
                  c10::IntArrayRef(shape), ", this model's is ", c10::IntArrayRef(p.full_shape));
      it = cache.emplace(key, reader.region(key, p.offset, p.length).contiguous()).first;
    }
    return it->second.view({-1});
  };
  // "optim/<state>/<name>" keys by parameter name: (state, key) pairs.
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> states;
  const std::string prefix = "optim/";
  for (const auto& key : reader.names(prefix)) {
    const auto slash = key.find('/', prefix.size());
    if (slash == std::string::npos) continue;
    const std::string what = key.substr(prefix.size(), slash - prefix.size());
    if (what != "step") states[key.substr(slash + 1)].emplace_back(what, key);
  }
  for (const auto& v : optimizer.piece_views()) {
    auto it = where.find(v.param.unsafeGetTensorImpl());
    TORCH_CHECK(it != where.end(), "load_optimizer_pieces: a parameter of shape ", v.param.sizes(),
                " has no placement; pass the model's placements (GPT::placements())");
    const auto& [name, placement] = *it->second;
    const int64_t end = std::min(v.end, valid_numel(placement));
    if (v.begin >= end) continue;
    v.value.narrow(0, 0, end - v.begin).copy_(region("model/" + name, placement).narrow(0, v.begin, end - v.begin));
    optim::ParamState state;
    const std::string step_key = "optim/step/" + name;
    if (reader.contains(step_key)) state.step = reader.full(step_key).item<int64_t>();
    for (const auto& [what, key] : states[name]) {
      at::Tensor t = at::zeros({v.value.numel()}, v.value.options());
      t.narrow(0, 0, end - v.begin).copy_(region(key, placement).narrow(0, v.begin, end - v.begin));
      state.tensors[what] = t;
    }
    optim::set_param_state(optimizer.inner(), v.value, state);
  }
  optimizer.sync_params_from_pieces();
}

std::vector<TensorPiece> buffer_pieces(torch::nn::Module& module, bool writer) {
  std::vector<TensorPiece> out;
  if (!writer) return out;
  for (const auto& b : module.named_buffers()) {
    if (!b.value().defined()) continue;
    TensorPiece t;
    t.name = "buffer/" + b.key();
    t.full_shape = b.value().sizes().vec();
    t.data = b.value().detach();
    out.push_back(std::move(t));
  }
  return out;
}

void load_buffer_pieces(const CheckpointReader& reader, torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  for (const auto& b : module.named_buffers()) {
    if (!b.value().defined()) continue;
    const std::string key = "buffer/" + b.key();
    TORCH_CHECK(reader.contains(key), "checkpoint ", reader.dir(), " has no buffer '", b.key(),
                "' (saved as '", key, "'); it was saved from a module without it or by a tessera that did not save buffers");
    TORCH_CHECK(reader.full_shape(key) == b.value().sizes().vec(), "checkpoint ", reader.dir(), ": buffer '", b.key(),
                "' has shape ", c10::IntArrayRef(reader.full_shape(key)), ", the module's has ", b.value().sizes());
    b.value().copy_(reader.full(key));
  }
}

}  // namespace train
}  // namespace tessera
