#pragma once
// Internals of the NCCL backend (not installed): RAII owners of the CUDA,
// NCCL and MPI handles, the Work type, and the glue to LibTorch's CUDA stream
// API, which exists only when TESSERA_HAVE_C10_CUDA is defined.
#include "tessera/comm/communicator.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/comm/nccl_check.h"
#include "waiting.h"

#include <mpi.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

// ncclAvg and ncclBfloat16 arrived in NCCL 2.10 (bfloat16 also needs CUDA 11's
// cuda_bf16.h, which nccl.h includes). Overridable so that the fallback paths
// can be compile-checked against a newer NCCL.
#ifndef TESSERA_NCCL_HAS_AVG
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
#define TESSERA_NCCL_HAS_AVG 1
#else
#define TESSERA_NCCL_HAS_AVG 0
#endif
#endif

#ifndef TESSERA_NCCL_HAS_BF16
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0) && defined(__CUDA_BF16_TYPES_EXIST__)
#define TESSERA_NCCL_HAS_BF16 1
#else
#define TESSERA_NCCL_HAS_BF16 0
#endif
#endif

namespace tessera {
namespace comm {
namespace detail {

// Makes `device` current for its lifetime and restores the previous device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// An event without timing (cheaper to record and query), created on the
// current device.
class CudaEvent {
 public:
  CudaEvent();
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&&) = delete;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream);

 private:
  cudaEvent_t event_ = nullptr;
};

// The communication stream: non-blocking (no implicit synchronisation with
// the legacy default stream) and at the highest priority the device offers,
// so that NCCL kernels are scheduled ahead of queued compute kernels.
class CudaStream {
 public:
  CudaStream();  // on the current device
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Raw device memory, zero-initialised, on the current device.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

// Owns an MPI communicator; frees it unless MPI is already finalised.
class MpiComm {
 public:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {}
  ~MpiComm();
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_;
};

// Owns an initialised ncclComm_t; destroys it with its device current.
class NcclComm {
 public:
  NcclComm(ncclComm_t comm, int device) : comm_(comm), device_(device) {}
  ~NcclComm();
  NcclComm(NcclComm&& other) noexcept;
  NcclComm& operator=(NcclComm&&) = delete;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  // ncclCommAbort: pending operations are cancelled and the communicator is
  // gone (Note [Timeouts]).
  void abort();

 private:
  ncclComm_t comm_;
  int device_;
};

// What an operation needs on the device. Shared by the communicator and its
// outstanding Works, so a Work can still check for NCCL errors after its
// communicator is gone. Members are destroyed in reverse order: the NCCL
// communicator (which flushes its operations) before its stream.
class NcclResources {
 public:
  // Creates the stream and buffer on the current device, which must be `device`.
  NcclResources(NcclComm comm, int device, int rank);

  ncclComm_t comm() const { return comm_.get(); }
  cudaStream_t stream() const { return stream_.get(); }
  int device() const { return device_; }
  int rank() const { return rank_; }  // for log messages
  // One int32 that barrier() all-reduces.
  void* barrier_buffer() const { return barrier_buffer_.get(); }

  // Throws if NCCL has reported an asynchronous error (a failed peer, a
  // network error): the operation would otherwise never complete.
  void check_async_error() const;
  // After a timeout: aborts the NCCL communicator.
  void abort();

 private:
  int device_;
  int rank_;
  DeviceBuffer barrier_buffer_;
  CudaStream stream_;
  NcclComm comm_;
};

// See Note [Work semantics] in communicator.h.
class NcclWork final : public Work {
 public:
  // block_host: wait() also blocks the host until completion (barrier),
  // for at most the communicator's timeout.
  NcclWork(std::shared_ptr<NcclResources> resources, OpInfo op, CudaEvent done, std::vector<at::Tensor> tensors,
           bool block_host);
  // Waits (as wait() does) if nobody did; errors are logged, not thrown.
  ~NcclWork() override;

  void wait() override;
  bool is_completed() override;

 private:
  bool query_locked();

  std::shared_ptr<NcclResources> resources_;
  OpInfo op_;
  CudaEvent done_;
  // Kept alive until the Work is destroyed (see docs/nccl-backend.md).
  std::vector<at::Tensor> tensors_;
  bool block_host_;
  std::mutex mutex_;
  bool waited_ = false;
};

// Whether the functions below use LibTorch's CUDA streams and allocator
// (this file compiled with TESSERA_HAVE_C10_CUDA).
bool uses_torch_streams();

// The calling thread's current stream on `device`: LibTorch's current CUDA
// stream where LibTorch has CUDA, else the legacy default stream.
cudaStream_t current_compute_stream(int device);

// Tells LibTorch's caching allocator that the tensors are in use on `stream`,
// so their memory is not handed out again before the stream has passed this
// point. A no-op without TESSERA_HAVE_C10_CUDA (no CUDA tensors exist then).
void record_stream(const std::vector<at::Tensor>& tensors, cudaStream_t stream);

// tensor /= divisor, queued on `stream`: ReduceOp::kAvg where NCCL lacks
// ncclAvg. Needs TESSERA_HAVE_C10_CUDA.
void divide_on_stream(at::Tensor& tensor, int64_t divisor, cudaStream_t stream);

// False for dtypes NCCL cannot carry. bool travels as uint8.
bool to_nccl_dtype(c10::ScalarType type, ncclDataType_t* out);

// Communicator state that stays behind the public header.
struct NcclState {
  explicit NcclState(MPI_Comm bootstrap_comm) : bootstrap(bootstrap_comm) {}

  MpiComm bootstrap;  // duplicate of the creating communicator, for split()
  std::shared_ptr<NcclResources> resources;
  std::shared_ptr<MpiCommunicator> control;  // Note [Control traffic]
  std::shared_ptr<const CommInfo> info;      // for timeout messages
  int64_t seq = 0;
  std::mutex issue_mutex;  // keeps each operation's event/NCCL/event sequence whole
};

}  // namespace detail
}  // namespace comm
}  // namespace tessera
