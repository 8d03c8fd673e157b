// tessera_demo: builds the rank grid of a parallel configuration, prints it,
// and runs every collective on every parallel mode's communicator, checking
// each result. `make demo` runs it on 8 ranks as dp2 x pp2 x tp2.
//
//   mpirun -np 8 tessera_demo --dp 2 --pp 2 --tp 2 [--tp-mode 2d ...]
//   mpirun -np 8 tessera_demo --grid-config parallel.json
// Every option: tessera_demo --help (docs/cli.md).
#include <tessera/tessera.h>

#include "example_main.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <string>
#include <vector>

namespace {

using tessera::comm::Communicator;
using tessera::comm::CommunicatorPtr;
using tessera::comm::ReduceOp;
using tessera::context::ParallelMode;

struct Args {
  tessera::context::ParallelConfig grid;
  std::string grid_config;
  bool check = false, verbose = false, no_collectives = false;
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("tessera_demo", "the rank grid of a parallel layout, and every collective on every group");
  c.group("Layout");
  tessera::context::add_grid_options(c, a.grid);
  c.add("seed", &a.grid.seed(), "base of every mode's seed");
  c.add("grid-config", &a.grid_config, "the layout as a JSON ParallelConfig instead of the flags above");
  c.group("Run");
  c.add("check", &a.check, "every collective checked (as TESSERA_CHECK_COLLECTIVES=1)");
  c.add("verbose", &a.verbose, "every rank's coordinates, groups and seeds");
  c.add("no-collectives", &a.no_collectives, "the grid only");
  return c;
}

// The grid as one table of coordinates and every mode's groups.
void print_grid(const tessera::context::RankGrid& grid) {
  using tessera::context::Dim;
  const Dim dims[] = {Dim::kTensor, Dim::kSequence, Dim::kData, Dim::kPipeline};
  fmt::print("rank ");
  for (Dim d : dims) fmt::print(" {:>3}", tessera::context::dim_name(d));
  fmt::print("\n");
  for (int r = 0; r < grid.world_size(); ++r) {
    fmt::print("{:>4} ", r);
    for (Dim d : dims) fmt::print(" {:>3}", grid.coordinate(d, r));
    fmt::print("\n");
  }
  fmt::print("\ngroups of each mode (members in group order):\n");
  for (auto mode : grid.modes()) {
    std::string groups;
    for (const auto& g : grid.groups(mode)) groups += " " + tessera::join_list(g);
    fmt::print("  {:<17}{}\n", tessera::context::mode_name(mode), groups);
  }
  fmt::print("\n");
}

// Runs each collective once on `c` with values whose result is known, and
// returns the names of those that came out wrong on this rank.
std::vector<std::string> exercise(Communicator& c, c10::ScalarType dtype) {
  std::vector<std::string> wrong;
  const int r = c.rank(), n = c.size();
  auto opts = at::TensorOptions().dtype(dtype);
  auto expect = [&](const char* name, const at::Tensor& got, const at::Tensor& want) {
    if (!at::equal(got.to(at::kDouble), want.to(dtype).to(at::kDouble))) wrong.push_back(name);
  };
  at::Tensor t = at::full({4}, r + 1.0, opts);
  c.all_reduce(t);
  expect("all_reduce", t, at::full({4}, n * (n + 1) / 2.0));
  t = at::full({4}, r == n - 1 ? 7.0 : 0.0, opts);
  c.broadcast(t, {n - 1});
  expect("broadcast", t, at::full({4}, 7.0));
  t = at::full({4}, r + 1.0, opts);
  c.reduce(t, {ReduceOp::kMax, 0});
  expect("reduce", t, at::full({4}, r == 0 ? double(n) : r + 1.0));
  at::Tensor gathered = at::empty({2 * n}, opts);
  c.all_gather(gathered, at::full({2}, double(r), opts));
  expect("all_gather", gathered, at::arange(n, at::kDouble).repeat_interleave(2));
  at::Tensor piece = at::empty({2}, opts);
  c.reduce_scatter(piece, at::arange(2 * n, at::kDouble).to(dtype));
  expect("reduce_scatter", piece, at::arange(2 * r, 2 * r + 2, at::kDouble) * n);
  at::Tensor sent = (at::arange(n, at::kDouble) + 10 * r).to(dtype), received = at::empty({n}, opts);
  c.all_to_all(received, sent);
  expect("all_to_all", received, at::arange(n, at::kDouble) * 10 + r);
  if (n > 1) {
    at::Tensor in = at::empty({3}, opts);
    // One batch: a ring of unbatched sends would block on NCCL.
    c.batch_isend_irecv({{tessera::comm::P2POp::Kind::kRecv, in, (r + n - 1) % n},
                         {tessera::comm::P2POp::Kind::kSend, at::full({3}, double(r), opts), (r + 1) % n}})
        ->wait();
    expect("send/recv", in, at::full({3}, double((r + n - 1) % n)));
  }
  c.barrier();
  return wrong;
}

int run(const Args& a, const tessera::cli::Command& c) {
  auto world = tessera::comm::make_world_communicator(
      {tessera::comm::Backend::kMpi, c10::Device(c10::kCPU),
       a.check || tessera::comm::WorldOptions::checked_mode_from_env(), nullptr});
  const bool root = world->rank() == 0;
  for (const char* grid_flag : {"dp", "pp", "tp", "tp-mode", "tp-depth", "sp", "sp-mode", "sp-split", "ep", "order", "seed"})
    TORCH_CHECK(a.grid_config.empty() || !c.given(grid_flag), "--", grid_flag,
                " with --grid-config: the file gives the whole layout; use one of them");
  auto config = a.grid_config.empty() ? a.grid : tessera::context::config_from_json_file(a.grid_config);
  auto ctx = tessera::context::ParallelContext::create(world, config);
  if (root) {
    fmt::print("tessera {} on LibTorch {}, {} ranks, backend {}\n", TESSERA_VERSION, tessera::torch_version_string(),
               world->size(), world->backend());
    fmt::print("config: {}\n\n", tessera::context::to_string(ctx->config()));
  }
  if (a.verbose) {
    std::string text;
    for (const auto& part : tessera::comm::all_gather_strings(*world, ctx->describe() + "\n")) text += part;
    if (root) fmt::print("{}", text);
  } else if (root) {
    print_grid(ctx->grid());
  }
  if (a.no_collectives) return 0;

  int failures = 0;
  for (auto mode : ctx->grid().modes()) {
    for (auto dtype : {c10::kFloat, c10::kBFloat16}) {
      auto wrong = exercise(*ctx->comm(mode), dtype);
      at::Tensor bad = at::full({1}, static_cast<int>(wrong.size()), at::kInt);
      world->all_reduce(bad);
      failures += bad.item<int>();
      if (!wrong.empty())
        fmt::print(stderr, "rank {}: {} on '{}' wrong: {}\n", world->rank(), tessera::dtype_name(dtype),
                   tessera::context::mode_name(mode), tessera::join_list(wrong));
      if (root)
        fmt::print(
            "{:<18} size {}  {:<9} all_reduce broadcast reduce all_gather reduce_scatter all_to_all "
            "send/recv barrier: {}\n",
            tessera::context::mode_name(mode), ctx->size(mode), tessera::dtype_name(dtype),
            bad.item<int>() == 0 ? "ok" : "WRONG");
    }
  }
  if (root) fmt::print("\n{}\n", failures == 0 ? "all collectives correct on every mode" : "SOME COLLECTIVES WRONG");
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a, c); });
}
