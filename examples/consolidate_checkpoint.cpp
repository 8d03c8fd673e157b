// tessera_consolidate: a checkpoint of any parallel configuration as one
// safetensors file of full weights (docs/checkpoints.md), for PyTorch,
// Hugging Face tools, or a single-process run. No MPI needed.
//
//   tessera_consolidate CHECKPOINT_DIR OUT.safetensors [PREFIX]    (PREFIX default "model/")
#include <tessera/core/cli.h>
#include <tessera/train/checkpoint.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <string>

int main(int argc, char** argv) {
  std::string dir, out, prefix = "model/";
  tessera::cli::Command c("tessera_consolidate", "a checkpoint of any parallel layout as one safetensors file of "
                          "full weights", "CHECKPOINT_DIR OUT.safetensors [PREFIX]");
  c.positional("CHECKPOINT_DIR", &dir, "a checkpoint directory (Trainer::save, train_gpt --save)");
  c.positional("OUT.safetensors", &out, "the file to write");
  c.positional("PREFIX", &prefix, "the tensors to take, by name prefix", false);
  try {
    const auto parsed = c.parse(argc, argv);
    if (!parsed.run) {
      fmt::print("{}", parsed.text);
      return 0;
    }
    tessera::train::consolidate_checkpoint(dir, out, prefix);
    fmt::print("{}: the '{}' tensors of {}, full\n", out, prefix, dir);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "tessera_consolidate: error: {}\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
