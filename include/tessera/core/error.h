#pragma once
// Error conventions of tessera.
//
// User errors (bad configuration, wrong shapes, unsupported dtypes) are
// reported with TORCH_CHECK, which throws c10::Error with file and line.
// Broken invariants of tessera itself use TORCH_INTERNAL_ASSERT. Backend
// failures go through TESSERA_MPI_CHECK / TESSERA_NCCL_CHECK (comm/), which
// throw c10::Error carrying the backend's own message. Library code never
// calls exit() or abort().
#include <c10/util/Exception.h>

#include <sstream>
#include <string>
#include <vector>

namespace tessera {

// "[0, 1, 2]" for error messages.
template <typename T>
std::string join_list(const std::vector<T>& values) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out << ", ";
    out << values[i];
  }
  out << ']';
  return out.str();
}

}  // namespace tessera
