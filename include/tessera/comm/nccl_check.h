#pragma once
// Error checks for the CUDA runtime and NCCL (see core/error.h).
//
// Both macros throw c10::Error through TORCH_CHECK, so the file and line in
// the message are the caller's. Only the NCCL backend and its tests include
// this header: it pulls in <nccl.h> and the CUDA runtime API.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <c10/util/Exception.h>

#include <string>

namespace tessera {
namespace comm {
namespace detail {

// ncclGetLastError (NCCL >= 2.13) often says more than the result code, e.g.
// which peer or which transport failed. Its comm argument is unused by NCCL.
inline std::string nccl_last_error_suffix() {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') return std::string("; last NCCL error: ") + last;
#endif
  return std::string();
}

}  // namespace detail
}  // namespace comm
}  // namespace tessera

// Throws c10::Error if `call` (an expression of type ncclResult_t) failed.
#define TESSERA_NCCL_CHECK(call)                                                                                       \
  do {                                                                                                                 \
    const ::ncclResult_t tessera_nccl_result_ = (call);                                                                \
    if (C10_UNLIKELY(tessera_nccl_result_ != ::ncclSuccess)) {                                                         \
      TORCH_CHECK(false, "NCCL call `", #call, "` failed with error ", static_cast<int>(tessera_nccl_result_), " (",   \
                  ::ncclGetErrorString(tessera_nccl_result_), ")", ::tessera::comm::detail::nccl_last_error_suffix()); \
    }                                                                                                                  \
  } while (0)

// Throws c10::Error if `call` (an expression of type cudaError_t) failed. The
// error is also cleared from the thread's last-error slot (sticky errors stay)
// so that a later, unrelated check does not report it again.
#define TESSERA_CUDA_CHECK(call)                                                                                 \
  do {                                                                                                           \
    const ::cudaError_t tessera_cuda_result_ = (call);                                                           \
    if (C10_UNLIKELY(tessera_cuda_result_ != ::cudaSuccess)) {                                                   \
      (void)::cudaGetLastError();                                                                                \
      TORCH_CHECK(false, "CUDA call `", #call, "` failed with ", ::cudaGetErrorName(tessera_cuda_result_), " (", \
                  ::cudaGetErrorString(tessera_cuda_result_), ")");                                              \
    }                                                                                                            \
  } while (0)
