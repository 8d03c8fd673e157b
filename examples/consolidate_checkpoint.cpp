// tessera_consolidate: a checkpoint of any parallel configuration as one
// safetensors file of full weights (docs/checkpoints.md), for PyTorch,
// Hugging Face tools, or a single-process run. No MPI needed.
//
//   tessera_consolidate CHECKPOINT_DIR OUT.safetensors [PREFIX]    (PREFIX default "model/")
#include <tessera/train/checkpoint.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <string>

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    fmt::print(stderr, "usage: tessera_consolidate CHECKPOINT_DIR OUT.safetensors [PREFIX]\n");
    return 2;
  }
  try {
    const std::string prefix = argc == 4 ? argv[3] : "model/";
    tessera::train::consolidate_checkpoint(argv[1], argv[2], prefix);
    fmt::print("{}: the '{}' tensors of {}, full\n", argv[2], prefix, argv[1]);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "tessera_consolidate: error: {}\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
