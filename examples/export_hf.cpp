// tessera_export_hf: a tessera checkpoint of any layout (train_gpt --save's
// DIR/final or DIR/step-N) as a Hugging Face model directory that
// transformers' AutoModelForCausalLM.from_pretrained loads
// (docs/huggingface.md). With several ranks each writes its own shards.
//
//   tessera_export_hf ckpt/final out --dtype bfloat16 --shard-mb 2000
//   mpirun -np 4 tessera_export_hf ckpt/final out
#include "example_main.h"

#include <tessera/comm/factory.h>
#include <tessera/infer/hf_checkpoint.h>

#include <fmt/format.h>

#include <string>

int main(int argc, char** argv) {
  std::string checkpoint, out, dtype;
  int64_t shard_mb = 5000;
  tessera::cli::Command c("tessera_export_hf", "a tessera checkpoint of any layout as a Hugging Face model directory",
                          "CHECKPOINT OUT_DIR");
  c.positional("CHECKPOINT", &checkpoint, "a checkpoint directory of a GPT (train_gpt --save's DIR/final)");
  c.positional("OUT_DIR", &out, "the Hugging Face directory to write (replaced once complete)");
  c.add("dtype", &dtype, "the weights' dtype: float32, bfloat16 or float16; empty: the checkpoint's");
  c.add("shard-mb", &shard_mb, "the largest shard file, in MB (10^6 bytes)");
  return tessera_examples::run_command(argc, argv, c, [&] {
    auto world = tessera::comm::make_world_communicator();
    tessera::infer::HFExportOptions options;
    TORCH_CHECK(shard_mb >= 1, "--shard-mb must be >= 1, got ", shard_mb);
    options.shard_bytes(shard_mb * 1000 * 1000);
    if (!dtype.empty()) options.dtype(tessera::infer::hf_dtype(dtype));
    const auto stats = tessera::infer::export_hf(checkpoint, out, world, options);
    if (world->rank() == 0)
      fmt::print("{}: {} of {} tensors, {:.2f} MB in {} shard(s), written by {} rank(s), from {}\n", out,
                 stats.architecture, stats.tensors, static_cast<double>(stats.bytes) / 1e6, stats.shards,
                 world->size(), checkpoint);
    return 0;
  });
}
