#include "nccl_internal.h"

#include "tessera/config.h"  // TESSERA_HAVE_C10_CUDA: without it the stream ordering below compiles out
#include "tessera/core/logging.h"

#ifdef TESSERA_HAVE_C10_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <chrono>
#include <string>
#include <thread>
#include <utility>

namespace tessera {
namespace comm {
namespace detail {
namespace {

// Between two queries while the host waits for a barrier: short enough not
// to add visible latency, long enough not to hog a core.

// For destructors, which must not throw: errors are dropped (at process exit
// the CUDA runtime may already be unloading and every call fails).
void set_device_quietly(int device) {
  if (device >= 0 && cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  TESSERA_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) TESSERA_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (current != previous_) set_device_quietly(previous_);
}

CudaEvent::CudaEvent() { TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }

CudaEvent::~CudaEvent() {
  // An event destroyed while still pending is released once it completes.
  if (event_ != nullptr && cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(other.event_) { other.event_ = nullptr; }

void CudaEvent::record(cudaStream_t stream) { TESSERA_CUDA_CHECK(cudaEventRecord(event_, stream)); }

CudaStream::CudaStream() {
  int least = 0;
  int greatest = 0;  // numerically lowest = highest priority
  TESSERA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  TESSERA_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
}

CudaStream::~CudaStream() {
  // Returns at once; queued work still runs and the stream is released after.
  if (stream_ != nullptr && cudaStreamDestroy(stream_) != cudaSuccess) (void)cudaGetLastError();
}

DeviceBuffer::DeviceBuffer(size_t bytes) {
  TESSERA_CUDA_CHECK(cudaMalloc(&data_, bytes));
  // cudaMemset runs on the legacy default stream, which the non-blocking
  // communication stream does not wait for: finish it here, at creation.
  cudaError_t result = cudaMemset(data_, 0, bytes);
  if (result == cudaSuccess) result = cudaDeviceSynchronize();
  if (result != cudaSuccess) {
    (void)cudaFree(data_);
    data_ = nullptr;
    TESSERA_CUDA_CHECK(result);
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr && cudaFree(data_) != cudaSuccess) (void)cudaGetLastError();
}

MpiComm::~MpiComm() {
  if (comm_ == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  int previous = -1;
  const bool have_previous = cudaGetDevice(&previous) == cudaSuccess;
  set_device_quietly(device_);
  // Flushes the communicator's outstanding operations, then frees it. Errors
  // cannot be reported from a destructor.
  (void)ncclCommDestroy(comm_);
  if (have_previous) set_device_quietly(previous);
  (void)cudaGetLastError();
}

void NcclComm::abort() {
  if (comm_ == nullptr) return;
  int previous = -1;
  const bool have_previous = cudaGetDevice(&previous) == cudaSuccess;
  set_device_quietly(device_);
  (void)ncclCommAbort(comm_);
  comm_ = nullptr;
  if (have_previous) set_device_quietly(previous);
  (void)cudaGetLastError();
}

NcclComm::NcclComm(NcclComm&& other) noexcept : comm_(other.comm_), device_(other.device_) { other.comm_ = nullptr; }

NcclResources::NcclResources(NcclComm comm, int device, int rank)
    : device_(device), rank_(rank), barrier_buffer_(sizeof(int32_t)), stream_(), comm_(std::move(comm)) {}

void NcclResources::check_async_error() const {
  TORCH_CHECK(comm_.get() != nullptr, "NCCL communicator on CUDA device ", device_, " (rank ", rank_,
              ") was aborted after a timeout and cannot be used any more");
  ncclResult_t async_error = ncclSuccess;
  TESSERA_NCCL_CHECK(ncclCommGetAsyncError(comm_.get(), &async_error));
  TORCH_CHECK(async_error == ncclSuccess, "NCCL communicator on CUDA device ", device_, " (rank ", rank_,
              ") reported an asynchronous error: ", ncclGetErrorString(async_error), detail::nccl_last_error_suffix(),
              ". The communicator cannot be used any more.");
}

void NcclResources::abort() { comm_.abort(); }

NcclWork::NcclWork(std::shared_ptr<NcclResources> resources, OpInfo op, CudaEvent done,
                   std::vector<at::Tensor> tensors, bool block_host)
    : resources_(std::move(resources)),
      op_(std::move(op)),
      done_(std::move(done)),
      tensors_(std::move(tensors)),
      block_host_(block_host) {
  TORCH_INTERNAL_ASSERT(resources_ != nullptr);
}

NcclWork::~NcclWork() {
  // The buffers must outlive the operation: order the current stream after it
  // (and, for a barrier, the host), as an explicit wait() would.
  try {
    wait();
  } catch (const c10::Error& error) {
    log_message(LogLevel::kWarning, resources_->rank(),
                std::string("NCCL work destroyed without wait() failed to wait: ") + error.what_without_backtrace());
  } catch (const std::exception& error) {
    log_message(LogLevel::kWarning, resources_->rank(),
                std::string("NCCL work destroyed without wait() failed to wait: ") + error.what());
  }
}

void NcclWork::wait() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (waited_) return;
  resources_->check_async_error();
  const int device = resources_->device();
  DeviceGuard guard(device);
  TESSERA_CUDA_CHECK(cudaStreamWaitEvent(current_compute_stream(device), done_.get(), 0));
  if (block_host_) {
    // Polling rather than cudaEventSynchronize, so that a failed peer turns
    // into an exception (check_async_error) and a stalled one into a
    // TimeoutError (Note [Timeouts]) instead of a hang.
    auto resources = resources_;
    wait_until([this] { return query_locked(); }, op_, [resources] { resources->abort(); });
  }
  waited_ = true;
}

bool NcclWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return query_locked();
}

bool NcclWork::query_locked() {
  resources_->check_async_error();
  DeviceGuard guard(resources_->device());
  const cudaError_t result = cudaEventQuery(done_.get());
  if (result == cudaSuccess) {
    end_op(op_, OpState::kCompleted);
    return true;
  }
  if (result == cudaErrorNotReady) {
    (void)cudaGetLastError();  // a status, not an error: keep it out of later checks
    return false;
  }
  TESSERA_CUDA_CHECK(result);
  return false;
}

bool uses_torch_streams() {
#ifdef TESSERA_HAVE_C10_CUDA
  return true;
#else
  return false;
#endif
}

cudaStream_t current_compute_stream(int device) {
#ifdef TESSERA_HAVE_C10_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return cudaStreamLegacy;
#endif
}

void record_stream(const std::vector<at::Tensor>& tensors, cudaStream_t stream) {
#ifdef TESSERA_HAVE_C10_CUDA
  for (const auto& tensor : tensors) {
    // An empty tensor may have no allocation to protect.
    if (!tensor.defined() || tensor.numel() == 0) continue;
    tensor.record_stream(c10::cuda::getStreamFromExternal(stream, tensor.device().index()));
  }
#else
  (void)tensors;
  (void)stream;
#endif
}

void divide_on_stream(at::Tensor& tensor, int64_t divisor, cudaStream_t stream) {
#ifdef TESSERA_HAVE_C10_CUDA
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream, tensor.device().index()));
  tensor.div_(divisor);
#else
  (void)tensor;
  (void)divisor;
  (void)stream;
  TORCH_CHECK(false, "ReduceOp::kAvg needs ncclAvg (NCCL >= 2.10) or a LibTorch with CUDA");
#endif
}

bool to_nccl_dtype(c10::ScalarType type, ncclDataType_t* out) {
  switch (type) {
    case c10::kFloat:
      *out = ncclFloat32;
      return true;
    case c10::kDouble:
      *out = ncclFloat64;
      return true;
    case c10::kHalf:
      *out = ncclFloat16;
      return true;
#if TESSERA_NCCL_HAS_BF16
    case c10::kBFloat16:
      *out = ncclBfloat16;
      return true;
#endif
    case c10::kInt:
      *out = ncclInt32;
      return true;
    case c10::kLong:
      *out = ncclInt64;
      return true;
    case c10::kByte:
      *out = ncclUint8;
      return true;
    case c10::kBool:
      *out = ncclUint8;
      return true;  // one byte, 0 or 1
    default:
      return false;
  }
}

}  // namespace detail
}  // namespace comm
}  // namespace tessera
