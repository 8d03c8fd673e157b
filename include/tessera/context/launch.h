#pragma once
// Start-up from the launcher's environment: which process of this node we
// are, and which device to use (docs/parallel-context.md, "Launch").
#include <c10/core/Device.h>

#include <map>
#include <string>

namespace tessera {
namespace context {

struct LaunchInfo {
  int local_rank = 0;  // rank among the processes of this node
  int local_size = 1;  // processes on this node
  // "openmpi", "mpich", "slurm", "torchrun", or "none" when nothing was found.
  std::string launcher = "none";
};

// Note [Launcher precedence]
// Variables are read in this order, first match wins:
//   openmpi   OMPI_COMM_WORLD_LOCAL_RANK / OMPI_COMM_WORLD_LOCAL_SIZE
//   mpich     MPI_LOCALRANKID / MPI_LOCALNRANKS (MPICH Hydra, Intel MPI)
//   slurm     SLURM_LOCALID / SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE
//             or SLURM_TASKS_PER_NODE (entry SLURM_NODEID of "2(x3),1")
//   torchrun  LOCAL_RANK / LOCAL_WORLD_SIZE
// MPI launchers come before Slurm because mpirun run inside an sbatch script
// inherits the script's own SLURM_LOCALID (always 0) while setting its own
// variables correctly. A rank variable without its size variable, or a value
// that is not a number, throws: a wrong local rank would silently put two
// processes on one GPU.
LaunchInfo detect_launch();
// The same, from the given variables instead of the process environment.
LaunchInfo detect_launch(const std::map<std::string, std::string>& env);

// CUDA device local_rank % cuda_device_count when cuda_device_count > 0,
// otherwise CPU. The caller passes the count (torch::cuda::device_count())
// so that this stays free of CUDA and testable without a GPU.
c10::Device pick_device(const LaunchInfo& info, int cuda_device_count);

// pick_device(detect_launch(), number of CUDA devices LibTorch sees): the
// device this process should use. Pass it to comm::make_world_communicator.
c10::Device local_device();

}  // namespace context
}  // namespace tessera
