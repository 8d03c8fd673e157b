// Atomicity of checkpoints (Note [Atomic checkpoints]), driven by
// checkpoint_atomicity.sh:
//   checkpoint_crash save DIR    writes DIR (values of version 1)
//   checkpoint_crash crash DIR   starts writing DIR; rank 1 dies once its file is in place
//   checkpoint_crash crash-replace DIR   rewrites DIR; rank 0 dies between moving DIR
//                                        to DIR.old and moving the new one in
//   checkpoint_crash check OLD NEW   OLD loads with version-1 values; NEW is refused
//   checkpoint_crash check-replaced DIR   DIR is refused, naming DIR.old
// Exit status 0 when the mode did what it says.
#include "tessera/comm/factory.h"
#include "tessera/comm/mpi_runtime.h"
#include "tessera/train/checkpoint.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstdlib>
#include <string>

namespace {

std::vector<tessera::train::TensorPiece> pieces(int rank, int size, double version) {
  tessera::train::TensorPiece w;  // rank r holds elements [4r, 4r + 4) of w
  w.name = "w";
  w.full_shape = {4 * size};
  w.flat_begin = 4 * rank;
  w.flat_end = 4 * rank + 4;
  w.data = at::arange(4 * rank, 4 * rank + 4, at::kFloat) * version;
  tessera::train::TensorPiece b;  // every rank holds all of b
  b.name = "b";
  b.full_shape = {3};
  b.data = at::full({3}, version);
  return {w, b};
}

}  // namespace

int main(int argc, char** argv) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  auto world = tessera::comm::make_world_communicator();
  const std::string mode = argc > 2 ? argv[1] : "";
  const int rank = world->rank();
  try {
    if (mode == "save" || mode == "crash" || mode == "crash-replace") {
      tessera::train::CheckpointOptions options;
      if (mode == "crash-replace")
        options.before_move_in([] {
          fmt::print(stderr, "rank 0: the old checkpoint is moved away, dying before the new one moves in\n");
          std::_Exit(9);
        });
      if (mode == "crash")
        options.after_file([rank](const std::string& file) {
          if (rank == 1) {
            fmt::print(stderr, "rank 1: wrote {}, dying before the index\n", file);
            std::_Exit(9);
          }
        });
      tessera::train::save_checkpoint(argv[2], pieces(rank, world->size(), mode == "save" ? 1 : 2), "{}", world,
                                      options);
      return mode == "save" ? 0 : 1;  // a crash run that finishes did not crash
    }
    if (mode == "check" && argc > 3) {
      tessera::infer::CheckpointReader old(argv[2]);
      auto expected = pieces(0, world->size(), 1);
      TORCH_CHECK(old.full("w").equal(at::arange(4 * world->size(), at::kFloat)), "old checkpoint: wrong w");
      TORCH_CHECK(old.full("b").equal(at::full({3}, 1.0)), "old checkpoint: wrong b");
      try {
        tessera::infer::CheckpointReader partial(argv[3]);
      } catch (const c10::Error& e) {
        fmt::print("rank {}: the partial checkpoint is refused: {}\n", rank, e.msg());
        return e.msg().find("did not finish") != std::string::npos ? 0 : 1;
      }
      fmt::print("rank {}: the partial checkpoint was accepted\n", rank);
      return 1;
    }
    if (mode == "check-replaced") {
      try {
        tessera::infer::CheckpointReader replaced(argv[2]);
      } catch (const c10::Error& e) {
        fmt::print("rank {}: the replaced checkpoint is refused: {}\n", rank, e.msg());
        return e.msg().find("was replacing it") != std::string::npos &&
                       e.msg().find(std::string(argv[2]) + ".old") != std::string::npos
                   ? 0
                   : 1;
      }
      fmt::print("rank {}: the replaced checkpoint was accepted\n", rank);
      return 1;
    }
    fmt::print(stderr, "usage: checkpoint_crash save|crash|crash-replace DIR | check OLD NEW | check-replaced DIR\n");
    return 2;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "rank {}: {}\n", rank, e.msg());
    return 1;
  }
}
