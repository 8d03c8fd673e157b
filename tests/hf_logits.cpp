// tessera's logits for a Hugging Face model directory, loaded straight from
// it in a parallel layout (hf_checkpoint_check.py):
//   mpirun -np N hf_logits DIR IDS.safetensors OUT --dp D --tp T --pp P
// reads DIR through infer::HFCheckpoint into a Trainer of that layout
// (Trainer::load_weights: each rank its own boxes) and runs a forward-only
// step on IDS's "ids" [b, s]; the last stage's tensor rank 0 of data replica
// k writes its rows' full logits [b / D, s, vocab] to OUT.dp<k>.safetensors.
// Also prints the largest read buffer and the resident memory after loading.
#include "support/full_logits.h"

#include "tessera/comm/factory.h"
#include "tessera/comm/mpi_runtime.h"
#include "tessera/context/parallel_context.h"
#include "tessera/core/process_memory.h"
#include "tessera/core/safetensors.h"
#include "tessera/infer/hf_checkpoint.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/optim/by_name.h"
#include "tessera/train/trainer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/utils.h>

#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace tessera;

int run(int argc, char** argv) {
  TORCH_CHECK(argc == 10, "usage: hf_logits DIR IDS.safetensors OUT --dp D --tp T --pp P");
  const std::string dir = argv[1], ids_file = argv[2], out = argv[3];
  const int dp = std::stoi(argv[5]), tp = std::stoi(argv[7]), pp = std::stoi(argv[9]);
  torch::set_num_threads(1);
  auto world = comm::make_world_communicator();
  const at::Tensor ids = SafetensorsFile(ids_file).read("ids").to(at::kLong);
  infer::HFCheckpoint hf(dir);
  models::GPTConfig config = hf.config();
  if (config.positions() == models::Positions::kRotary) config.context(ids.size(1));
  auto ctx = context::ParallelContext::create(world, context::ParallelConfig().data(dp).tensor(tp).pipeline(pp));
  auto factory = nn::make_layer_factory(ctx, false, false);
  auto gpt = std::make_shared<models::GPTImpl>(config, factory);
  train::TrainModel model = train::gpt_train_model(gpt);
  // The loss the pipeline's last stage computes per micro-batch also keeps its logits.
  std::vector<at::Tensor> logits;
  const auto loss = model.loss;
  model.loss = [&](const at::Tensor& local, const at::Tensor& targets) {
    logits.push_back(test::full_logits(local.detach(), ctx, *factory, config.vocab()));
    return loss(local, targets);
  };
  const int64_t microbatches = pp > 1 ? 2 : 1;
  train::Trainer trainer(
      ctx, model,
      [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
        return optim::make_optimizer(optim::OptimizerByName().name("adamw").lr(0), named);
      },
      train::TrainerOptions().pipeline(parallel::PipelineOptions().microbatches(microbatches)));
  // What loading adds to a rank's resident memory beyond the model it fills:
  // the peak is reset first (Linux: "5" to clear_refs resets VmHWM).
  std::ofstream("/proc/self/clear_refs") << "5";
  const double before = static_cast<double>(resident_bytes());
  trainer.load_weights(hf);
  const double peak = static_cast<double>(peak_resident_bytes());
  const auto rows = ctx->batch_rows(ids.size(0));
  const at::Tensor mine = ids.narrow(0, rows.first, rows.count);
  trainer.evaluate(mine, at::zeros_like(mine));
  using context::ParallelMode;
  const bool writer = ctx->rank(ParallelMode::kPipeline) == pp - 1 && ctx->rank(ParallelMode::kTensor) == 0;
  if (writer) {
    TORCH_CHECK(!logits.empty(), "the last stage computed no logits");
    write_safetensors(fmt::format("{}.dp{}.safetensors", out, ctx->rank(ParallelMode::kData)),
                      {{"logits", at::cat(logits, 0).contiguous()}}, {{"format", "pt"}});
  }
  if (world->rank() == 0)
    fmt::print("hf_logits: {} at dp {} tp {} pp {}: rank 0 resident {:.1f} MB before loading, peak {:.1f} MB while "
               "loading; largest read buffer {:.2f} MB\n",
               dir, dp, tp, pp, before / 1e6, peak / 1e6, static_cast<double>(hf.largest_read()) / 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiRuntime mpi(&argc, &argv);
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "hf_logits: error: {}\n", e.what_without_backtrace());
    return 1;
  }
}
