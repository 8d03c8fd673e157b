#pragma once
// Umbrella header: everything a training program needs from tessera.
// Prefer the narrower headers inside the library and in large projects, for
// compile time.
#include "tessera/comm/checked_communicator.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/factory.h"
#include "tessera/comm/functional.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/comm/mpi_runtime.h"
#include "tessera/comm/tracing_communicator.h"
#include "tessera/config.h"
#include "tessera/context/launch.h"
#include "tessera/context/parallel_config.h"
#include "tessera/context/parallel_context.h"
#include "tessera/context/rank_grid.h"
#include "tessera/core/compat.h"
#include "tessera/core/dtype.h"
#include "tessera/core/error.h"
#include "tessera/core/logging.h"
#include "tessera/core/threads.h"
#include "tessera/parallel/pipeline_executor.h"
#include "tessera/parallel/pipeline_partition.h"
#include "tessera/parallel/pipeline_schedule.h"
#include "tessera/parallel/pipeline_simulator.h"
#include "tessera/parallel/shard_layout.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/sharding_spec.h"
#ifdef TESSERA_HAVE_NCCL
#include "tessera/comm/nccl_communicator.h"
#endif
