// tessera's own GPT logits for the Hugging Face export test (hf_export_check.py):
//   gpt_logits MODEL.safetensors HEADS IDS.safetensors OUT.safetensors
//     loads a consolidated GPT file (docs/checkpoints.md) into a serial
//     models::GPT and writes its logits [b, s, vocab] for IDS's "ids" [b, s]
//   gpt_logits --random OUT.safetensors
//     writes a consolidated-format file of an untied GPT (4 heads) whose every
//     tensor, biases and LayerNorms included, is random
//   gpt_logits --preset NAME MODEL.safetensors IDS.safetensors OUT.safetensors
//     the same logits for a model of GPTConfig preset NAME (any architecture:
//     hf_models_check.py's Llama family) whose full weights MODEL holds
// Runs on one rank (mpirun -np 1).
#include "tessera/comm/factory.h"
#include "tessera/comm/mpi_runtime.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/core/safetensors.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/utils.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace {

using tessera::SafetensorsFile;

std::shared_ptr<tessera::nn::LayerFactory> serial_factory(const tessera::comm::CommunicatorPtr& world) {
  TORCH_CHECK(world->size() == 1, "gpt_logits runs on one rank, not ", world->size());
  return tessera::nn::make_1d_factory(world, false, 1234, 5678);
}

void write_random(const std::string& out, const tessera::comm::CommunicatorPtr& world) {
  tessera::models::GPTConfig c = tessera::models::GPTConfig::preset("tiny");  // vocab 101, 4 heads, hidden 32
  c.tied(false);
  torch::manual_seed(7);
  tessera::models::GPT gpt(c, serial_factory(world));
  // GPT-2's initialisation leaves biases 0 and LayerNorms 1: perturb every
  // tensor so that a misplaced one changes the logits.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : gpt->full_state()) tensors.emplace_back(name, t + 0.2 * at::randn_like(t));
  tessera::write_safetensors(out, tensors, {{"format", "pt"}});
}

// The logits of `gpt` (weights loaded) for IDS's "ids", into OUT's "logits".
void forward_to_file(tessera::models::GPTImpl& gpt, const std::string& ids_file, const std::string& out) {
  gpt.eval();
  at::NoGradGuard no_grad;
  const at::Tensor ids = SafetensorsFile(ids_file).read("ids").to(at::kLong);
  tessera::write_safetensors(out, {{"logits", gpt.forward(ids).contiguous()}}, {{"format", "pt"}});
}

void write_preset_logits(const std::string& preset, const std::string& model, const std::string& ids_file,
                         const std::string& out, const tessera::comm::CommunicatorPtr& world) {
  const SafetensorsFile file(model);
  tessera::models::GPT gpt(tessera::models::GPTConfig::preset(preset), serial_factory(world));
  std::map<std::string, at::Tensor> state;
  for (const auto& name : file.names()) state[name] = file.read(name);
  TORCH_CHECK(state.size() == gpt->placements().size(), model, " holds ", state.size(), " tensors, the ", preset,
              " model has ", gpt->placements().size());
  gpt->load_full_state(state);
  forward_to_file(*gpt, ids_file, out);
}

void write_logits(const std::string& model, int64_t heads, const std::string& ids_file, const std::string& out,
                  const tessera::comm::CommunicatorPtr& world) {
  const SafetensorsFile file(model);
  TORCH_CHECK(file.contains("wte.weight") && file.contains("wpe.weight"), model,
              " is not a consolidated tessera GPT (no wte.weight / wpe.weight)");
  tessera::models::GPTConfig c;
  c.vocab(file.shape("wte.weight").at(0));
  c.hidden(file.shape("wte.weight").at(1));
  c.context(file.shape("wpe.weight").at(0));
  c.heads(heads);
  c.tied(!file.contains("lm_head.weight"));
  c.layers(0);
  while (file.contains(fmt::format("h.{}.ln_1.weight", c.layers()))) ++c.layers();
  tessera::models::GPT gpt(c, serial_factory(world));
  std::map<std::string, at::Tensor> state;
  for (const auto& name : file.names()) state[name] = file.read(name);
  const auto placements = gpt->placements();
  for (const auto& [name, t] : state) {
    bool known = false;
    for (const auto& p : placements) known = known || p.first == name;
    TORCH_CHECK(known, model, ": tensor '", name, "' is not a parameter of this GPT");
  }
  gpt->load_full_state(state);
  forward_to_file(*gpt, ids_file, out);
  fmt::print("{}: logits of {} ({} layers, {} heads, hidden {}, vocab {}, {})\n", out, model, c.layers(), c.heads(),
             c.hidden(), c.vocab(), c.tied() ? "tied" : "untied");
}

}  // namespace

int main(int argc, char** argv) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  try {
    auto world = tessera::comm::make_world_communicator();
    if (argc == 3 && std::string(argv[1]) == "--random") {
      write_random(argv[2], world);
    } else if (argc == 6 && std::string(argv[1]) == "--preset") {
      write_preset_logits(argv[2], argv[3], argv[4], argv[5], world);
    } else if (argc == 5) {
      write_logits(argv[1], std::stoll(argv[2]), argv[3], argv[4], world);
    } else {
      fmt::print(stderr,
                 "usage: gpt_logits MODEL.safetensors HEADS IDS.safetensors OUT.safetensors\n"
                 "       gpt_logits --random OUT.safetensors\n"
                 "       gpt_logits --preset NAME MODEL.safetensors IDS.safetensors OUT.safetensors\n");
      return 2;
    }
  } catch (const c10::Error& e) {
    fmt::print(stderr, "gpt_logits: error: {}\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
