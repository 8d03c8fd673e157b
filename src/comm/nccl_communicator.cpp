#include "tessera/comm/nccl_communicator.h"

#include "nccl_internal.h"
#include "op_checks.h"
#include "tessera/comm/mpi_check.h"
#include "tessera/core/dtype.h"
#include "tessera/core/error.h"

#include <c10/core/ScalarType.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace comm {

using detail::CudaEvent;
using detail::DeviceGuard;
using detail::NcclResources;
using detail::NcclState;
using detail::NcclWork;

namespace {

// Why this process cannot use `device`, or "" if it can.
std::string device_problem(int device) {
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(result);
  }
  if (device < 0 || device >= count) {
    return "CUDA device " + std::to_string(device) + " does not exist; this process sees " + std::to_string(count) +
           " device(s)";
  }
  return "";
}

// Collective: throws on every rank if any rank has a problem, so that no rank
// goes on into a collective the others will never join.
void agree_or_throw(MPI_Comm comm, int rank, int size, const std::string& problem, const std::string& what) {
  const int mine = problem.empty() ? size : rank;
  int first_failed = size;
  TESSERA_MPI_CHECK(MPI_Allreduce(&mine, &first_failed, 1, MPI_INT, MPI_MIN, comm));
  TORCH_CHECK(problem.empty(), what, " failed on rank ", rank, ": ", problem);
  TORCH_CHECK(first_failed == size, what, " failed on rank ", first_failed, " (see the error reported there)");
}

// The shared checks, then what NCCL adds: a CUDA tensor on this
// communicator's device, of a dtype this NCCL carries.
ncclDataType_t check_nccl_tensor(const NcclCommunicator& comm, OpType op, const at::Tensor& tensor, const char* what) {
  check_tensor(comm, op, tensor, what);
  TORCH_CHECK(tensor.is_cuda(), where(comm, op), ": the ", what,
              " tensor must be a CUDA tensor for the NCCL backend, got one on ", tensor.device());
  TORCH_CHECK(tensor.device().index() == comm.device(), where(comm, op), ": the ", what, " tensor is on ",
              tensor.device(), " but this communicator uses cuda:", comm.device());
  ncclDataType_t type;
  TORCH_CHECK(detail::to_nccl_dtype(tensor.scalar_type(), &type), where(comm, op), ": dtype ",
              dtype_name(tensor.scalar_type()), " is not supported by NCCL ", NCCL_MAJOR, ".", NCCL_MINOR,
              " (bfloat16 needs NCCL >= 2.10 built with CUDA >= 11)");
  return type;
}

struct NcclReduction {
  ncclRedOp_t op;
  bool divide_after;  // kAvg without ncclAvg: sum, then divide by size()
};

// check_reduce_op() has already rejected avg of non-floating dtypes.
NcclReduction to_nccl_reduction(ReduceOp op, c10::ScalarType type) {
  if (type == c10::kBool) {
    // Logical or / and over 0/1 bytes, as c10d does.
    TORCH_INTERNAL_ASSERT(op != ReduceOp::kAvg, "avg of bool passed check_reduce_op");
    const bool any = op == ReduceOp::kSum || op == ReduceOp::kMax;
    return {any ? ncclMax : ncclMin, false};
  }
  switch (op) {
    case ReduceOp::kSum:
      return {ncclSum, false};
    case ReduceOp::kProduct:
      return {ncclProd, false};
    case ReduceOp::kMin:
      return {ncclMin, false};
    case ReduceOp::kMax:
      return {ncclMax, false};
    case ReduceOp::kAvg:
#if TESSERA_NCCL_HAS_AVG
      return {ncclAvg, false};
#else
      return {ncclSum, true};
#endif
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled ReduceOp ", static_cast<int>(op));
  return {ncclSum, false};
}

void* data(const at::Tensor& tensor) { return tensor.data_ptr(); }

size_t count(const at::Tensor& tensor) { return static_cast<size_t>(tensor.numel()); }

using IssueFn = std::function<void(ncclComm_t, cudaStream_t)>;

// The ordering every operation follows: the communication stream waits for
// the work queued so far on the current stream, NCCL runs on the
// communication stream, and an event marks its completion for the Work.
WorkPtr run_op(NcclState& state, const char* op, std::vector<at::Tensor> tensors, bool async, bool block_host,
               const IssueFn& issue, std::vector<int> peers = {}) {
  std::shared_ptr<NcclWork> work;
  {
    std::lock_guard<std::mutex> lock(state.issue_mutex);
    detail::check_not_aborted(*state.info, op);
    // Bytes as nccl-tests' size: the largest tensor (all_gather's output, reduce_scatter's input).
    const at::Tensor* largest = nullptr;
    for (const auto& t : tensors)
      if (largest == nullptr || t.nbytes() > largest->nbytes()) largest = &t;
    detail::OpInfo info = detail::begin_op(state.info, op, ++state.seq, std::move(peers),
                                           largest ? static_cast<int64_t>(largest->nbytes()) : 0,
                                           largest ? c10::toString(largest->scalar_type()) : "");
    NcclResources& resources = *state.resources;
    resources.check_async_error();
    DeviceGuard guard(resources.device());
    CudaEvent ready;
    ready.record(detail::current_compute_stream(resources.device()));
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(resources.stream(), ready.get(), 0));
    issue(resources.comm(), resources.stream());
    CudaEvent done;
    done.record(resources.stream());
    detail::record_stream(tensors, resources.stream());
    work = std::make_shared<NcclWork>(state.resources, std::move(info), std::move(done), std::move(tensors),
                                      block_host);
  }
  if (!async) work->wait();
  return work;
}

// ncclGroupEnd must follow ncclGroupStart even when an issue inside fails.
void grouped(const std::function<void()>& issue) {
  TESSERA_NCCL_CHECK(ncclGroupStart());
  try {
    issue();
  } catch (...) {
    (void)ncclGroupEnd();
    throw;
  }
  TESSERA_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace

bool NcclCommunicator::orders_with_torch_streams() { return detail::uses_torch_streams(); }

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(MPI_Comm bootstrap, int cuda_device,
                                                           const std::string& name, std::chrono::milliseconds timeout,
                                                           std::shared_ptr<detail::AbortState> abort,
                                                           const FlightRecorderOptions& recorder) {
  int initialized = 0;
  TESSERA_MPI_CHECK(MPI_Initialized(&initialized));
  TORCH_CHECK(initialized, "NcclCommunicator::create('", name, "'): MPI is not initialised");
  TORCH_CHECK(bootstrap != MPI_COMM_NULL, "NcclCommunicator::create('", name,
              "'): the bootstrap communicator is MPI_COMM_NULL");

  MPI_Comm duplicate = MPI_COMM_NULL;
  TESSERA_MPI_CHECK(MPI_Comm_dup(bootstrap, &duplicate));
  auto state = std::make_unique<NcclState>(duplicate);
  // As for every communicator tessera creates: MPI failures become exceptions.
  TESSERA_MPI_CHECK(MPI_Comm_set_errhandler(duplicate, MPI_ERRORS_RETURN));
  int rank = 0;
  int size = 0;
  TESSERA_MPI_CHECK(MPI_Comm_rank(duplicate, &rank));
  TESSERA_MPI_CHECK(MPI_Comm_size(duplicate, &size));

  const std::string what = "NcclCommunicator::create('" + name + "')";
  agree_or_throw(duplicate, rank, size, device_problem(cuda_device), what);
  DeviceGuard guard(cuda_device);

  // Rank 0 sends its result code with the id, so a failure there is an
  // exception on every rank rather than a hang in ncclCommInitRank.
  struct IdMessage {
    ncclUniqueId id;
    int result;
  } message{};
  if (rank == 0) message.result = static_cast<int>(ncclGetUniqueId(&message.id));
  TESSERA_MPI_CHECK(MPI_Bcast(&message, static_cast<int>(sizeof(message)), MPI_BYTE, 0, duplicate));
  TORCH_CHECK(message.result == ncclSuccess, what,
              ": ncclGetUniqueId failed on rank 0: ", ncclGetErrorString(static_cast<ncclResult_t>(message.result)));

  ncclComm_t raw = nullptr;
  TESSERA_NCCL_CHECK(ncclCommInitRank(&raw, size, message.id, rank));
  detail::NcclComm comm(raw, cuda_device);
  state->resources = std::make_shared<NcclResources>(std::move(comm), cuda_device, rank);
  if (!abort) abort = detail::AbortState::create(recorder);
  state->info = detail::make_comm_info(duplicate, name, "nccl", timeout, abort);
  MpiOptions control_options;
  control_options.timeout = timeout;
  control_options.abort = abort;
  state->control = MpiCommunicator::create(duplicate, name, control_options);
  return std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(state), rank, size, cuda_device, name));
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<NcclState> state, int rank, int size, int device, std::string name)
    : state_(std::move(state)), rank_(rank), size_(size), device_(device), name_(std::move(name)) {}

NcclCommunicator::~NcclCommunicator() = default;

std::shared_ptr<FlightRecorder> NcclCommunicator::flight_recorder() const { return state_->info->abort->recorder(); }

std::shared_ptr<FaultInjector> NcclCommunicator::fault_injector() const { return state_->info->abort->faults(); }

WorkPtr NcclCommunicator::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  const OpType op = OpType::kAllReduce;
  validate_all_reduce(*this, tensor, options.op);
  const ncclDataType_t type = check_nccl_tensor(*this, op, tensor, "input");
  const NcclReduction reduction = to_nccl_reduction(options.op, tensor.scalar_type());
  const int size = size_;
  return run_op(*state_, "all_reduce", {tensor}, options.async, false, [&](ncclComm_t comm, cudaStream_t s) {
    if (count(tensor) == 0) return;
    TESSERA_NCCL_CHECK(ncclAllReduce(data(tensor), data(tensor), count(tensor), type, reduction.op, comm, s));
    if (reduction.divide_after) detail::divide_on_stream(tensor, size, s);
  });
}

WorkPtr NcclCommunicator::broadcast(at::Tensor& tensor, const BroadcastOptions& options) {
  const OpType op = OpType::kBroadcast;
  validate_broadcast(*this, tensor, options.root);
  const ncclDataType_t type = check_nccl_tensor(*this, op, tensor, "input");
  return run_op(*state_, "broadcast", {tensor}, options.async, false, [&](ncclComm_t comm, cudaStream_t s) {
    if (count(tensor) == 0) return;
    TESSERA_NCCL_CHECK(ncclBroadcast(data(tensor), data(tensor), count(tensor), type, options.root, comm, s));
  });
}

WorkPtr NcclCommunicator::reduce(at::Tensor& tensor, const ReduceOptions& options) {
  const OpType op = OpType::kReduce;
  validate_reduce(*this, tensor, options.root, options.op);
  const ncclDataType_t type = check_nccl_tensor(*this, op, tensor, "input");
  const NcclReduction reduction = to_nccl_reduction(options.op, tensor.scalar_type());
  const bool is_root = rank_ == options.root;
  const int size = size_;
  // In place: NCCL writes the receive buffer only on the root, so the other
  // ranks' tensors stay as they were.
  return run_op(*state_, "reduce", {tensor}, options.async, false, [&](ncclComm_t comm, cudaStream_t s) {
    if (count(tensor) == 0) return;
    TESSERA_NCCL_CHECK(
        ncclReduce(data(tensor), data(tensor), count(tensor), type, reduction.op, options.root, comm, s));
    if (reduction.divide_after && is_root) detail::divide_on_stream(tensor, size, s);
  });
}

WorkPtr NcclCommunicator::all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options) {
  const OpType op = OpType::kAllGather;
  validate_all_gather(*this, output, input);
  const ncclDataType_t type = check_nccl_tensor(*this, op, input, "input");
  check_nccl_tensor(*this, op, output, "output");
  // NCCL handles the in-place case (input at this rank's offset in output).
  return run_op(*state_, "all_gather", {output, input}, options.async, false, [&](ncclComm_t comm, cudaStream_t s) {
    if (count(input) == 0) return;
    TESSERA_NCCL_CHECK(ncclAllGather(data(input), data(output), count(input), type, comm, s));
  });
}

WorkPtr NcclCommunicator::reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                         const ReduceScatterOptions& options) {
  const OpType op = OpType::kReduceScatter;
  validate_reduce_scatter(*this, output, input, options.op);
  const ncclDataType_t type = check_nccl_tensor(*this, op, input, "input");
  check_nccl_tensor(*this, op, output, "output");
  const NcclReduction reduction = to_nccl_reduction(options.op, input.scalar_type());
  const int size = size_;
  return run_op(*state_, "reduce_scatter", {output, input}, options.async, false, [&](ncclComm_t comm, cudaStream_t s) {
    if (count(output) == 0) return;
    TESSERA_NCCL_CHECK(ncclReduceScatter(data(input), data(output), count(output), type, reduction.op, comm, s));
    if (reduction.divide_after) detail::divide_on_stream(output, size, s);
  });
}

WorkPtr NcclCommunicator::all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options) {
  const OpType op = OpType::kAllToAll;
  const AllToAllLayout layout = validate_all_to_all(*this, output, input, options);
  const ncclDataType_t type = check_nccl_tensor(*this, op, input, "input");
  check_nccl_tensor(*this, op, output, "output");
  const size_t item = c10::elementSize(input.scalar_type());
  char* send_base = static_cast<char*>(data(input));
  char* recv_base = static_cast<char*>(data(output));
  return run_op(*state_, "all_to_all", {output, input}, options.async, false, [&](ncclComm_t comm, cudaStream_t s) {
    // Zero-sized pieces are skipped on both sides alike: rank r's
    // send count to us is our receive count from r.
    grouped([&] {
      for (int r = 0; r < size_; ++r) {
        const size_t send = static_cast<size_t>(layout.send_counts[r]);
        const size_t recv = static_cast<size_t>(layout.recv_counts[r]);
        if (send > 0) {
          TESSERA_NCCL_CHECK(ncclSend(send_base + layout.send_displs[r] * item, send, type, r, comm, s));
        }
        if (recv > 0) {
          TESSERA_NCCL_CHECK(ncclRecv(recv_base + layout.recv_displs[r] * item, recv, type, r, comm, s));
        }
      }
    });
  });
}

WorkPtr NcclCommunicator::send(const at::Tensor& tensor, int dst, const SendOptions& options) {
  const OpType op = OpType::kSend;
  const ncclDataType_t type = check_nccl_tensor(*this, op, tensor, "input");
  // Not to itself: NCCL pairs a self-send with its receive only within a group.
  check_rank(*this, op, "destination", dst, false);
  return run_op(*state_, "send", {tensor}, options.async, false,
                [&](ncclComm_t comm, cudaStream_t s) {
                  if (count(tensor) == 0) return;
                  TESSERA_NCCL_CHECK(ncclSend(data(tensor), count(tensor), type, dst, comm, s));
                },
                {dst});
}

WorkPtr NcclCommunicator::recv(at::Tensor& tensor, int src, const RecvOptions& options) {
  const OpType op = OpType::kRecv;
  const ncclDataType_t type = check_nccl_tensor(*this, op, tensor, "output");
  check_rank(*this, op, "source", src, false);
  return run_op(*state_, "recv", {tensor}, options.async, false,
                [&](ncclComm_t comm, cudaStream_t s) {
                  if (count(tensor) == 0) return;
                  TESSERA_NCCL_CHECK(ncclRecv(data(tensor), count(tensor), type, src, comm, s));
                },
                {src});
}

WorkPtr NcclCommunicator::barrier(const BarrierOptions& options) {
  void* buffer = state_->resources->barrier_buffer();
  return run_op(*state_, "barrier", {}, options.async, /*block_host=*/true, [&](ncclComm_t comm, cudaStream_t s) {
    TESSERA_NCCL_CHECK(ncclAllReduce(buffer, buffer, 1, ncclInt32, ncclSum, comm, s));
  });
}

WorkPtr NcclCommunicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  validate_batch(*this, ops);
  std::vector<at::Tensor> tensors;
  std::vector<ncclDataType_t> types;
  std::vector<int> peers;
  for (const auto& o : ops) {
    peers.push_back(o.peer);
    const bool send = o.kind == P2POp::Kind::kSend;
    types.push_back(check_nccl_tensor(*this, send ? OpType::kSend : OpType::kRecv, o.tensor, send ? "input" : "output"));
    tensors.push_back(o.tensor);
  }
  // One group: NCCL pairs sends and receives across the whole group, self
  // included, so the order of posting inside it cannot deadlock.
  return run_op(
      *state_, "batch_isend_irecv", tensors, /*async=*/true, false,
      [&](ncclComm_t comm, cudaStream_t s) {
        grouped([&] {
          for (size_t i = 0; i < ops.size(); ++i) {
            const P2POp& o = ops[i];
            if (count(o.tensor) == 0) continue;
            if (o.kind == P2POp::Kind::kRecv) {
              TESSERA_NCCL_CHECK(ncclRecv(data(o.tensor), count(o.tensor), types[i], o.peer, comm, s));
            } else {
              TESSERA_NCCL_CHECK(ncclSend(data(o.tensor), count(o.tensor), types[i], o.peer, comm, s));
            }
          }
        });
      },
      std::move(peers));
}

CommunicatorPtr NcclCommunicator::control() { return state_->control; }

CommunicatorPtr NcclCommunicator::split(int color, int key, const std::string& name) {
  MPI_Comm child = MPI_COMM_NULL;
  TESSERA_MPI_CHECK(MPI_Comm_split(state_->bootstrap.get(), color < 0 ? MPI_UNDEFINED : color, key, &child));
  if (child == MPI_COMM_NULL) return nullptr;
  detail::MpiComm owned(child);  // create() keeps its own duplicate
  return create(owned.get(), device_, name, state_->info->timeout, state_->info->abort);
}

}  // namespace comm
}  // namespace tessera
