#pragma once
// Integers read from JSON that tessera did not write (safetensors headers,
// checkpoint indexes, comm_bench lines). nlohmann's get<int64_t>() converts a
// float such as 1e77 by a cast whose result is undefined; these refuse
// anything but a JSON integer with the type_error any other wrong type
// raises, so the caller's handler names the file. Private to the library
// (src/ is on its private include path): nlohmann/json is not installed.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

inline int64_t json_int(const nlohmann::json& v) {
  if (!v.is_number_integer())
    throw nlohmann::json::type_error::create(302, std::string("type must be an integer, but is ") + v.type_name(), &v);
  return v.get<int64_t>();
}

inline std::vector<int64_t> json_ints(const nlohmann::json& v) {
  if (!v.is_array())
    throw nlohmann::json::type_error::create(302, std::string("type must be an array, but is ") + v.type_name(), &v);
  std::vector<int64_t> out;
  for (const auto& x : v) out.push_back(json_int(x));
  return out;
}

}  // namespace tessera
