// Uses the installed tessera through its umbrella header: a 2-rank job that
// builds a ParallelContext and all-reduces over its data group.
#include <tessera/tessera.h>

#include <ATen/ATen.h>

#include <cstdio>

int main(int argc, char** argv) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  tessera::limit_threads(1);
  const c10::Device device = tessera::context::local_device();  // a GPU when there is one
  auto world = tessera::comm::make_world_communicator({tessera::comm::Backend::kAuto, device});
  auto ctx = tessera::context::ParallelContext::create(world, tessera::context::ParallelConfig());
  auto data = ctx->comm(tessera::context::ParallelMode::kData);
  at::Tensor t = at::ones({4}, at::TensorOptions().device(device));
  data->all_reduce(t);
  const bool ok = t[0].item<float>() == static_cast<float>(data->size());
  std::printf("consumer rank %d of %d: tessera %s, data size %d, all_reduce %s\n", world->rank(), world->size(),
              TESSERA_VERSION, data->size(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
