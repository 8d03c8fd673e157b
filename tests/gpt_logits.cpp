// tessera's own GPT logits for the tests against transformers
// (hf_models_check.py, hf_finetune_check.py):
//   gpt_logits --preset NAME MODEL.safetensors IDS.safetensors OUT.safetensors
//     loads the full weights MODEL holds (a consolidated file, tessera's
//     names) into a serial models::GPT of GPTConfig preset NAME and writes its
//     logits [b, s, vocab] for IDS's "ids" [b, s] to OUT's "logits"
//   gpt_logits --checkpoint DIR IDS.safetensors OUT.safetensors
//     the same for a checkpoint of any layout (the model its metadata
//     records, its full weights assembled by CheckpointReader)
// Runs on one rank (mpirun -np 1).
#include "tessera/comm/factory.h"
#include "tessera/comm/mpi_runtime.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/core/safetensors.h"
#include "tessera/infer/checkpoint_reader.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
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

void write_checkpoint_logits(const std::string& dir, const std::string& ids_file, const std::string& out,
                             const tessera::comm::CommunicatorPtr& world) {
  const tessera::infer::CheckpointReader reader(dir);
  auto meta = nlohmann::json::parse(reader.metadata());
  if (!meta.contains("gpt")) meta = meta.at("extra");
  tessera::models::GPT gpt(tessera::models::GPTConfig::from_json(meta.at("gpt").dump()), serial_factory(world));
  std::map<std::string, at::Tensor> state;
  for (const auto& [name, placement] : gpt->placements()) state[name] = reader.full("model/" + name);
  gpt->load_full_state(state);
  forward_to_file(*gpt, ids_file, out);
}

}  // namespace

int main(int argc, char** argv) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  try {
    auto world = tessera::comm::make_world_communicator();
    if (argc == 6 && std::string(argv[1]) == "--preset") {
      write_preset_logits(argv[2], argv[3], argv[4], argv[5], world);
    } else if (argc == 5 && std::string(argv[1]) == "--checkpoint") {
      write_checkpoint_logits(argv[2], argv[3], argv[4], world);
    } else {
      fmt::print(stderr, "usage: gpt_logits --preset NAME MODEL.safetensors IDS.safetensors OUT.safetensors\n"
                         "       gpt_logits --checkpoint DIR IDS.safetensors OUT.safetensors\n");
      return 2;
    }
  } catch (const c10::Error& e) {
    fmt::print(stderr, "gpt_logits: error: {}\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
