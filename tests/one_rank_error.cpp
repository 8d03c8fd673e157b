// An error on some ranks only, the others already in their next collective:
// the examples' frame (examples/example_main.h, Note [One rank's error])
// must end every rank with a message, not hang. "one": rank 1 cannot open
// its data file; "all": every rank meets the same bad flag.
#include "example_main.h"

#include <string>

int main(int argc, char** argv) {
  return tessera_examples::run_example(argc, argv, "one_rank_error", [](int argc, char** argv) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const std::string mode = argc > 1 ? argv[1] : "";
    TORCH_CHECK(mode == "one" || mode == "all", "unknown mode '", mode, "'");
    if (mode == "all") TORCH_CHECK(false, "--layers must be >= 1, got 0");
    if (rank == 1) TORCH_CHECK(false, "cannot open the data file /nonexistent/shard-1.bin");
    MPI_Barrier(MPI_COMM_WORLD);  // where the other ranks would wait forever
    return 0;
  });
}
