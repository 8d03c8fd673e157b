#pragma once
// The communicator interface of tessera (see docs/communicator.md).
//
// Modelled on PyTorch c10d: one small abstract class, an options struct per
// collective, and a Work handle per call. Backends: MpiCommunicator (CPU
// tensors, CUDA tensors staged through host memory unless the MPI is
// CUDA-aware) and NcclCommunicator (CUDA tensors). Decorators wrap any
// backend: TracingCommunicator (counts calls and bytes) and
// CheckedCommunicator (verifies that all ranks call the same collective).
//
// Every collective must be called by every rank of the communicator, in the
// same order. Tensors must be contiguous. Sizes are checked locally and, in
// checked mode, across ranks.
//
// Note [Control traffic]
// A group has two channels: the communicator itself, for tensors on the
// job's device, and control(), a host (MPI) communicator for what the
// library itself exchanges in CPU memory: scalars read by the host (loss
// means), strings, message headers, agreement flags. NCCL accepts only CUDA
// tensors, so control traffic never goes to the device channel. Under MPI
// both channels are MPI communicators (control() a duplicate), so the two
// kinds of traffic never match each other's messages. c10d keeps one
// backend per device type for the same reason.
#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessera {
namespace comm {

enum class ReduceOp { kSum, kAvg, kProduct, kMin, kMax };

std::string reduce_op_name(ReduceOp op);

// The operations a communicator performs; used by tracing and checking.
enum class OpType {
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kSend,
  kRecv,
  kBarrier,
};

std::string op_type_name(OpType op);

// A handle on one issued operation.
//
// Note [Work semantics]
// wait(): when it returns, the output tensors of the operation may be used by
// the calling thread as any other tensor:
//  - MPI backend: the host blocks until the operation has completed and, for
//    CUDA tensors staged through host memory, the result has been copied back
//    (on the current stream of the tensor's device).
//  - NCCL backend: the host does not block; the current CUDA stream of the
//    calling thread is made to wait (cudaStreamWaitEvent) for the
//    communication stream, so work queued afterwards sees the result.
// Calling wait() twice is allowed and does nothing the second time.
// is_completed() never blocks; it reports whether the operation has finished.
// A Work keeps the tensors it uses alive until it completes. Destroying a Work
// that was never waited on waits for it (the buffers must outlive the
// operation), so dropping a handle never leaves a dangling operation.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
};

using WorkPtr = std::shared_ptr<Work>;

// A Work that is already complete, returned by synchronous calls.
WorkPtr completed_work();

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  bool async = false;  // false: the call returns after the work completed
};

struct BroadcastOptions {
  int root = 0;
  bool async = false;
};

struct ReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  int root = 0;  // only the root's tensor holds the result afterwards
  bool async = false;
};

struct AllGatherOptions {
  bool async = false;
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  bool async = false;
};

// Splits are counts of rows of dimension 0 (as in c10d's all_to_all_single).
// Both empty: equal splits, dimension 0 divisible by the group size. Otherwise
// both must have one entry per rank and sum to the tensors' dimension 0.
struct AllToAllOptions {
  std::vector<int64_t> input_split_sizes;
  std::vector<int64_t> output_split_sizes;
  bool async = false;
};

// There are no tags: messages between one pair of ranks match in the order
// they are posted (NCCL has no tags, and MPI's non-overtaking rule gives the
// same order), so both sides must post them in one order.
struct SendOptions {
  bool async = false;
};

struct RecvOptions {
  bool async = false;
};

// One send or receive of a batch (Communicator::batch_isend_irecv).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;  // the data sent, or the buffer received into
  int peer = 0;       // rank in the communicator
};

// Note [Timeouts]
// Every wait that blocks the host gives up after the communicator's timeout
// (TESSERA_COMM_TIMEOUT seconds, default 600; 0 waits forever). The rank then
// throws a TimeoutError naming the operation, the communicator, the
// operation's sequence number on it and the peers, and marks the
// communicator and every communicator split from the same world as aborted:
// their later calls throw at once. Operations still pending are abandoned
// with their buffers (MPI may still write them), so the process cannot
// finalize MPI and should end; an uncaught TimeoutError ends it, and mpirun
// then ends the other ranks.
class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// TESSERA_COMM_TIMEOUT in seconds (a decimal number; 0 for none), or 600 s.
std::chrono::milliseconds timeout_from_env();

struct BarrierOptions {
  bool async = false;
};

class Communicator;
using CommunicatorPtr = std::shared_ptr<Communicator>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Name given at creation ("world", "data", "tensor", ...); used in traces
  // and error messages.
  virtual const std::string& name() const = 0;
  // "mpi", "nccl", or a decorator's name around its backend's.
  virtual std::string backend() const = 0;

  // In place: every rank ends with op over all ranks' tensors.
  virtual WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options = {}) = 0;
  // In place: every rank ends with the root's tensor.
  virtual WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options = {}) = 0;
  // In place on the root; other ranks' tensors are left unchanged.
  virtual WorkPtr reduce(at::Tensor& tensor, const ReduceOptions& options = {}) = 0;
  // output (numel = size() * input.numel()) receives rank r's input at
  // offset r * input.numel(), flat.
  virtual WorkPtr all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options = {}) = 0;
  // input (numel = size() * output.numel()) is reduced over ranks and rank r
  // keeps the r-th flat chunk in output.
  virtual WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                 const ReduceScatterOptions& options = {}) = 0;
  // Rows [offset_r, offset_r + input_split[r]) of input go to rank r; output
  // receives output_split[r] rows from rank r, in rank order.
  virtual WorkPtr all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options = {}) = 0;
  virtual WorkPtr send(const at::Tensor& tensor, int dst, const SendOptions& options = {}) = 0;
  virtual WorkPtr recv(at::Tensor& tensor, int src, const RecvOptions& options = {}) = 0;
  virtual WorkPtr barrier(const BarrierOptions& options = {}) = 0;

  // Note [Batched point-to-point]
  // Posts every op of the list as one group (MPI: all requests at once,
  // receives first; NCCL: one ncclGroupStart/End), so a batch in which ranks
  // both send and receive cannot deadlock however the ranks are ordered,
  // even when a send blocks until its receive is posted. wait() returns once
  // every op has completed. Ops with one peer match the peer's ops with this
  // rank in the order they are listed. A rank may list itself as a peer.
  virtual WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops) = 0;

  // Whether a posted send holds back what is ordered after it until the
  // peer posts the receive: NCCL's hold the stream; MPI's do with
  // synchronous sends (MpiOptions), the mode that stands in for NCCL on CPU.
  // When false a caller may post sends, go on and wait for them later; when
  // true, sends and receives that depend on each other go in one batch.
  virtual bool sends_wait_for_receiver() const = 0;

  // Whether issuing a collective waits until every rank of the group has
  // issued it (CheckedCommunicator compares the calls first). A caller that
  // keeps several communicators' operations in flight, issued in an order
  // that differs between ranks, must not do so over such communicators:
  // two of those waits could each wait for the other (Note [Reductions in
  // bucket order per link]).
  virtual bool issue_waits_for_group() const { return false; }

  // The host communicator of this group for control traffic (Note [Control
  // traffic]): the same ranks in the same order. A control communicator is
  // its own control().
  virtual CommunicatorPtr control() = 0;

  // Collective over this communicator: ranks with the same color form a new
  // communicator, ordered by key (ties by rank). color < 0 returns nullptr.
  virtual CommunicatorPtr split(int color, int key, const std::string& name) = 0;
};

// Every rank's string, in rank order, on every rank (lengths all-gathered,
// then the padded bytes, over group.control()): for descriptions and
// reports. Collective.
std::vector<std::string> all_gather_strings(Communicator& group, const std::string& mine);

}  // namespace comm
}  // namespace tessera
