#include "tessera/core/dtype.h"

#include "tessera/core/error.h"

#include <utility>
#include <vector>

namespace tessera {
namespace {

const std::vector<std::pair<c10::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<c10::ScalarType, const char*>> names = {
      {c10::kFloat, "float32"}, {c10::kDouble, "float64"}, {c10::kBFloat16, "bfloat16"}, {c10::kHalf, "float16"},
      {c10::kInt, "int32"},     {c10::kLong, "int64"},     {c10::kByte, "uint8"},        {c10::kBool, "bool"},
  };
  return names;
}

}  // namespace

std::string dtype_name(c10::ScalarType type) {
  for (const auto& entry : dtype_names()) {
    if (entry.first == type) return entry.second;
  }
  return c10::toString(type);
}

c10::ScalarType dtype_from_name(const std::string& name) {
  std::vector<std::string> accepted;
  for (const auto& entry : dtype_names()) {
    if (name == entry.second) return entry.first;
    accepted.emplace_back(entry.second);
  }
  TORCH_CHECK(false, "unknown dtype '", name, "'; accepted: ", join_list(accepted));
}

bool is_supported_comm_dtype(c10::ScalarType type) {
  for (const auto& entry : dtype_names()) {
    if (entry.first == type) return true;
  }
  return false;
}

}  // namespace tessera
