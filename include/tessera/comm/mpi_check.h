#pragma once
// TESSERA_MPI_CHECK(call): throws c10::Error with the call, the caller's file
// and line, and MPI's own error string. Communicators created by tessera set
// MPI_ERRORS_RETURN, so MPI failures arrive here instead of aborting the job.
#include <c10/util/Exception.h>
#include <mpi.h>

#include <string>

namespace tessera {
namespace comm {

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<size_t>(length));
}

}  // namespace comm
}  // namespace tessera

#define TESSERA_MPI_CHECK(call)                                                                       \
  do {                                                                                                \
    int tessera_mpi_rc_ = (call);                                                                     \
    TORCH_CHECK(tessera_mpi_rc_ == MPI_SUCCESS, "MPI call failed: ", #call, ": ",                     \
                ::tessera::comm::mpi_error_string(tessera_mpi_rc_), " (code ", tessera_mpi_rc_, ")"); \
  } while (0)
