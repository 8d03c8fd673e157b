#include "tessera/train/state_pieces.h"

#include "tessera/nn/parallel_dropout.h"
#include "tessera/optim/param_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>
#include <mutex>
#include <set>

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
  if (data.defined()) t.data = data.detach();
  return t;
}

}  // namespace

Placements named_placements(torch::nn::Module& module) {
  Placements out;
  for (const auto& p : module.named_parameters()) out.emplace_back(p.key(), nn::replicated_placement(p.value()));
  return out;
}

namespace {

// Each piece view of the optimizer with its parameter's name and placement,
// padding left out: fn(name, placement, view, end), the view's valid
// elements being [view.begin, end) of the parameter's region.
template <typename Fn>
void for_each_view(const parallel::ShardedOptimizer& optimizer, const Placements& placements, const char* who,
                   Fn&& fn) {
  const PlacementMap where = by_param(placements);
  for (const auto& v : optimizer.piece_views()) {
    auto it = where.find(v.param.unsafeGetTensorImpl());
    TORCH_CHECK(it != where.end(), who, ": a parameter of shape ", v.param.sizes(),
                " has no placement; pass the model's placements (GPT::placements())");
    const auto& [name, placement] = *it->second;
    const int64_t end = std::min(v.end, valid_numel(placement));
    if (v.begin >= end) continue;  // padding only
    fn(name, placement, v, end);
  }
}

// "optim/<state>/<name>" keys by parameter name: (state, key) pairs.
std::map<std::string, std::vector<std::pair<std::string, std::string>>> state_keys(
    const std::vector<std::string>& optim_names) {
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> states;
  const std::string prefix = "optim/";
  for (const auto& key : optim_names) {
    const auto slash = key.find('/', prefix.size());
    if (key.compare(0, prefix.size(), prefix) != 0 || slash == std::string::npos) continue;
    const std::string what = key.substr(prefix.size(), slash - prefix.size());
    if (what != "step") states[key.substr(slash + 1)].emplace_back(what, key);
  }
  return states;
}

}  // namespace

std::vector<TensorPiece> optimizer_pieces(parallel::ShardedOptimizer& optimizer, const Placements& placements) {
  std::vector<TensorPiece> out;
  for_each_view(optimizer, placements, "optimizer_pieces",
                [&](const std::string& name, const nn::ParamPlacement& placement,
                    const parallel::ShardedOptimizer::PieceView& v, int64_t end) {
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
                });
  return out;
}

std::vector<infer::PieceRequest> optimizer_requests(const parallel::ShardedOptimizer& optimizer, const Placements& placements,
                                             const std::vector<std::string>& optim_names) {
  const auto states = state_keys(optim_names);
  const std::set<std::string> present(optim_names.begin(), optim_names.end());
  std::vector<infer::PieceRequest> out;
  for_each_view(optimizer, placements, "optimizer_requests",
                [&](const std::string& name, const nn::ParamPlacement& placement,
                    const parallel::ShardedOptimizer::PieceView& v, int64_t end) {
                  const TensorPiece shape = piece_of("", placement, v.begin, end, at::Tensor());
                  auto request = [&](const std::string& key) {
                    out.push_back({key, shape.offset, shape.length, shape.flat_begin, shape.flat_end});
                  };
                  request("model/" + name);
                  auto it = states.find(name);
                  if (it != states.end())
                    for (const auto& what_key : it->second) request(what_key.second);
                  if (present.count("optim/step/" + name)) out.push_back({"optim/step/" + name, {}, {}, 0, -1});
                });
  return out;
}

void load_optimizer_pieces(const infer::PieceSource& source, parallel::ShardedOptimizer& optimizer,
                           const Placements& placements) {
  at::NoGradGuard no_grad;
  // This rank's elements of a tensor, checked against the model's shape.
  auto elements = [&](const std::string& key, const nn::ParamPlacement& p, int64_t begin, int64_t end) {
    TORCH_CHECK(source.contains(key), source.describe(), " has no '", key,
                "': it was saved from another model or optimizer");
    const auto shape = source.full_shape(key);
    TORCH_CHECK(shape == p.full_shape, source.describe(), ": '", key, "' has shape ", c10::IntArrayRef(shape),
                ", this model's is ", c10::IntArrayRef(p.full_shape));
    return source.flat(key, p.offset, p.length, begin, end);
  };
  const auto states = state_keys(source.names("optim/"));
  optimizer.fetch_offloaded();  // Note [Disk offload]
  for_each_view(optimizer, placements, "load_optimizer_pieces",
                [&](const std::string& name, const nn::ParamPlacement& placement,
                    const parallel::ShardedOptimizer::PieceView& v, int64_t end) {
                  v.value.narrow(0, 0, end - v.begin).copy_(elements("model/" + name, placement, v.begin, end));
                  optim::ParamState state;
                  const std::string step_key = "optim/step/" + name;
                  if (source.contains(step_key)) state.step = source.full(step_key).item<int64_t>();
                  auto it = states.find(name);
                  if (it != states.end())
                    for (const auto& [what, key] : it->second) {
                      at::Tensor t = at::zeros({v.value.numel()}, v.value.options());
                      t.narrow(0, 0, end - v.begin).copy_(elements(key, placement, v.begin, end));
                      state.tensors[what] = t;
                    }
                  optim::set_param_state(optimizer.inner(), v.value, state);
                });
  optimizer.sync_params_from_pieces();
  optimizer.park_offloaded();
}

void load_model_pieces(const infer::PieceSource& source, parallel::ShardedOptimizer& optimizer,
                       const Placements& placements) {
  at::NoGradGuard no_grad;
  optimizer.fetch_offloaded();  // Note [Disk offload]
  for_each_view(optimizer, placements, "load_model_pieces",
                [&](const std::string& name, const nn::ParamPlacement& p,
                    const parallel::ShardedOptimizer::PieceView& v, int64_t end) {
                  const std::string key = "model/" + name;
                  TORCH_CHECK(source.contains(key), source.describe(), " has no '", name,
                              "', a parameter of this model");
                  const auto shape = source.full_shape(key);
                  TORCH_CHECK(shape == p.full_shape, source.describe(), ": '", name, "' has shape ",
                              c10::IntArrayRef(shape), ", this model's is ", c10::IntArrayRef(p.full_shape));
                  v.value.narrow(0, 0, end - v.begin).copy_(source.flat(key, p.offset, p.length, v.begin, end));
                });
  optimizer.sync_params_from_pieces();
  optimizer.park_offloaded();
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

std::vector<infer::PieceRequest> buffer_requests(torch::nn::Module& module) {
  std::vector<infer::PieceRequest> out;
  for (const auto& b : module.named_buffers())
    if (b.value().defined()) out.push_back({"buffer/" + b.key(), {}, {}, 0, -1});
  return out;
}

void load_buffer_pieces(const infer::PieceSource& reader, torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  for (const auto& b : module.named_buffers()) {
    if (!b.value().defined()) continue;
    const std::string key = "buffer/" + b.key();
    TORCH_CHECK(reader.contains(key), reader.describe(), " has no buffer '", b.key(),
                "' (saved as '", key, "'); it was saved from a module without it or by a tessera that did not save buffers");
    TORCH_CHECK(reader.full_shape(key) == b.value().sizes().vec(), reader.describe(), ": buffer '", b.key(),
                "' has shape ", c10::IntArrayRef(reader.full_shape(key)), ", the module's has ", b.value().sizes());
    b.value().copy_(reader.full(key));
  }
}

namespace {

std::vector<nn::ParallelDropoutImpl*> dropouts(torch::nn::Module& module) { return nn::dropout_layers(module); }

std::string rng_prefix(const std::string& key) { return "rng/" + key + "/"; }

// The CUDA devices holding the module's tensors, in index order.
std::set<c10::DeviceIndex> cuda_devices(torch::nn::Module& module) {
  std::set<c10::DeviceIndex> out;
  for (const auto& t : module.parameters())
    if (t.defined() && t.is_cuda()) out.insert(t.device().index());
  for (const auto& t : module.buffers())
    if (t.defined() && t.is_cuda()) out.insert(t.device().index());
  return out;
}

bool have_device(const c10::Device& device) {
  if (device.is_cpu()) return true;
  return device.is_cuda() && at::hasCUDA() && device.index() < static_cast<int64_t>(at::getNumGPUs());
}

// A new generator of the device's default kind, in `state`.
at::Generator generator_in(const c10::Device& device, const at::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(device).clone();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
  return gen;
}

}  // namespace

std::vector<TensorPiece> random_state_pieces(torch::nn::Module& module, int global_rank) {
  return random_state_pieces(module, std::to_string(global_rank), true);
}

std::vector<std::string> load_random_state_pieces(const infer::PieceSource& reader, torch::nn::Module& module,
                                                  int global_rank) {
  return load_random_state_pieces(reader, module, std::to_string(global_rank));
}

std::vector<TensorPiece> random_state_pieces(torch::nn::Module& module, const std::string& key,
                                             bool process_generators) {
  std::vector<TensorPiece> out;
  auto add = [&](const std::string& name, at::Generator gen) {
    TensorPiece rng;
    rng.name = rng_prefix(key) + name;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng.data = gen.get_state();
    }
    rng.full_shape = rng.data.sizes().vec();
    out.push_back(std::move(rng));
  };
  if (process_generators) {
    add("cpu", at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
    for (c10::DeviceIndex i : cuda_devices(module)) {
      const c10::Device device(c10::kCUDA, i);
      add(device.str(), at::globalContext().defaultGenerator(device));
    }
  }
  const auto drops = dropouts(module);
  for (size_t k = 0; k < drops.size(); ++k)
    for (const auto& [device, gen] : drops[k]->rng_state()) add("dropout/" + std::to_string(k) + "/" + device, gen);
  return out;
}

std::vector<std::string> load_random_state_pieces(const infer::PieceSource& reader, torch::nn::Module& module,
                                                  const std::string& key) {
  const std::string prefix = rng_prefix(key);
  std::vector<std::string> missing;
  const auto names = reader.names(prefix);
  if (names.empty()) return missing;  // saved without random states
  const auto drops = dropouts(module);
  std::vector<nn::ParallelDropoutImpl::RngState> streams(drops.size());
  for (const auto& name : names) {
    const std::string rest = name.substr(prefix.size());
    const bool dropout = rest.rfind("dropout/", 0) == 0;
    size_t layer = 0;
    std::string device_name = rest;
    if (dropout) {
      const size_t slash = rest.find('/', 8);
      const std::string number = slash == std::string::npos ? "" : rest.substr(8, slash - 8);
      TORCH_CHECK(!number.empty() && number.size() < 10 && number.find_first_not_of("0123456789") == std::string::npos,
                  reader.describe(), ": random stream '", name, "' is not named dropout/<layer>/<device>");
      layer = std::stoul(number);
      device_name = rest.substr(slash + 1);
      TORCH_CHECK(layer < drops.size(), reader.describe(), " holds the random stream of dropout layer ",
                  layer, " but the module has ", drops.size(), " dropout layers");
    }
    const c10::Device device(device_name);
    if (!have_device(device)) {
      missing.push_back(name);
      continue;
    }
    // Generators take their state as a host byte tensor whatever their
    // device; an elastic move delivers pieces on the model's device.
    const at::Tensor state = reader.full(name).to(at::kCPU);
    TORCH_CHECK(state.scalar_type() == at::kByte, reader.describe(), ": random stream '", name, "' holds ",
                state.scalar_type(), " values, but a generator's state is bytes (uint8)");
    if (dropout) {
      streams[layer].emplace(device_name, generator_in(device, state));
    } else {
      at::Generator gen = at::globalContext().defaultGenerator(device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  for (size_t k = 0; k < drops.size(); ++k) drops[k]->set_rng_state(streams[k]);
  return missing;
}

}  // namespace train
}  // namespace tessera
