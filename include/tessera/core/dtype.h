#pragma once
#include <c10/core/ScalarType.h>

#include <string>

namespace tessera {

// Short lower-case name used in messages, traces and benchmark JSON
// ("float32", "bfloat16", ...).
std::string dtype_name(c10::ScalarType type);

// Parses the names above; throws c10::Error listing the accepted ones.
c10::ScalarType dtype_from_name(const std::string& name);

// The dtypes every communicator backend supports.
bool is_supported_comm_dtype(c10::ScalarType type);

}  // namespace tessera
