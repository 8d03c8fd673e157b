#include "tessera/core/logging.h"

#include <cstdlib>
#include <cstring>

namespace tessera {

LogLevel log_level_from_env() {
  const char* value = std::getenv("TESSERA_LOG_LEVEL");
  if (value == nullptr) return LogLevel::kInfo;
  if (std::strcmp(value, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(value, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(value, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

void log_message(LogLevel level, int rank, const std::string& message) {
  if (static_cast<int>(level) < static_cast<int>(log_level_from_env())) return;
  static constexpr const char* kNames[] = {"debug", "info", "warning", "error"};
  fmt::print(stderr, "[tessera rank {}] {}: {}\n", rank, kNames[static_cast<int>(level)], message);
  std::fflush(stderr);
}

}  // namespace tessera
