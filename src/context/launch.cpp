#include "tessera/context/launch.h"

#include "tessera/core/error.h"

#include <torch/cuda.h>

#include <cerrno>
#include <cstdlib>
#include <functional>
#include <limits>
#include <sstream>

namespace tessera {
namespace context {
namespace {

// Returns nullptr for a variable that is not set.
using Lookup = std::function<const char*(const char*)>;

int env_int(const char* name, const char* value) {
  const std::string text = value;
  errno = 0;
  char* end = nullptr;
  const long parsed = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK(!text.empty() && errno == 0 && end == text.c_str() + text.size() && parsed >= 0 &&
                  parsed <= std::numeric_limits<int>::max(),
              "environment variable ", name, "='", text, "' is not a non-negative integer");
  return static_cast<int>(parsed);
}

// Slurm writes tasks per node compressed: "2(x3),1" means 2, 2, 2, 1.
int slurm_tasks_on_node(const char* name, const std::string& text, int node_id) {
  std::istringstream in(text);
  std::string entry;
  int node = 0;
  int tasks = -1;
  while (tasks < 0 && std::getline(in, entry, ',')) {
    int repeat = 1;
    std::string count = entry;
    const size_t paren = entry.find("(x");
    if (paren != std::string::npos) {
      TORCH_CHECK(entry.back() == ')', "environment variable ", name, "='", text,
                  "' is not in Slurm's \"N(xM),...\" form");
      count = entry.substr(0, paren);
      const std::string times = entry.substr(paren + 2, entry.size() - paren - 3);
      repeat = env_int(name, times.c_str());
    }
    if (node_id < node + repeat) tasks = env_int(name, count.c_str());
    node += repeat;
  }
  TORCH_CHECK(tasks >= 0, "environment variable ", name, "='", text, "' has no entry for node ", node_id);
  return tasks;
}

LaunchInfo make_info(const char* launcher, const char* rank_name, int rank, const char* size_name, int size) {
  TORCH_CHECK(size >= 1 && rank < size, "launcher ", launcher, " gives local rank ", rank, " (", rank_name,
              ") but local size ", size, " (", size_name, ")");
  LaunchInfo info;
  info.local_rank = rank;
  info.local_size = size;
  info.launcher = launcher;
  return info;
}

LaunchInfo detect_with(const Lookup& get) {
  struct Pair {
    const char* launcher;
    const char* rank;
    const char* size;
  };
  // Slurm is handled separately below because of its size variables.
  const Pair mpi_pairs[] = {
      {"openmpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"mpich", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
  };
  auto from_pair = [&](const Pair& pair) {
    const char* size = get(pair.size);
    TORCH_CHECK(size != nullptr, "environment variable ", pair.rank, " is set but ", pair.size,
                " is not; cannot tell how many processes share this node");
    return make_info(pair.launcher, pair.rank, env_int(pair.rank, get(pair.rank)), pair.size, env_int(pair.size, size));
  };
  for (const Pair& pair : mpi_pairs) {
    if (get(pair.rank) != nullptr) return from_pair(pair);
  }

  if (const char* local_id = get("SLURM_LOCALID")) {
    const int rank = env_int("SLURM_LOCALID", local_id);
    for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (const char* value = get(name)) {
        const char* node_text = get("SLURM_NODEID");
        const int node = node_text ? env_int("SLURM_NODEID", node_text) : 0;
        // --ntasks-per-node is one number for every node.
        const bool uniform = std::string(name) == "SLURM_NTASKS_PER_NODE";
        return make_info("slurm", "SLURM_LOCALID", rank, name,
                         uniform ? env_int(name, value) : slurm_tasks_on_node(name, value, node));
      }
    }
    TORCH_CHECK(false,
                "environment variable SLURM_LOCALID is set but none of "
                "SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE is");
  }

  const Pair torchrun = {"torchrun", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  if (get(torchrun.rank) != nullptr) return from_pair(torchrun);
  return LaunchInfo{};
}

}  // namespace

LaunchInfo detect_launch() {
  return detect_with([](const char* name) { return std::getenv(name); });
}

LaunchInfo detect_launch(const std::map<std::string, std::string>& env) {
  return detect_with([&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

c10::Device pick_device(const LaunchInfo& info, int cuda_device_count) {
  TORCH_CHECK(cuda_device_count >= 0, "CUDA device count ", cuda_device_count, " is negative");
  TORCH_CHECK(info.local_rank >= 0, "local rank ", info.local_rank, " is negative");
  if (cuda_device_count == 0) return c10::Device(c10::DeviceType::CPU);
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(info.local_rank % cuda_device_count));
}

c10::Device local_device() { return pick_device(detect_launch(), static_cast<int>(torch::cuda::device_count())); }

}  // namespace context
}  // namespace tessera
