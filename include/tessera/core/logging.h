#pragma once
// Rank-tagged logging through fmt. Messages go to stderr with a
// "[tessera rank R]" prefix so that interleaved output of many ranks can be
// told apart; log_rank0 prints only on the given rank 0.
#include <fmt/format.h>

#include <cstdio>
#include <string>

namespace tessera {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Level from TESSERA_LOG_LEVEL (debug|info|warning|error), default info.
LogLevel log_level_from_env();

void log_message(LogLevel level, int rank, const std::string& message);

template <typename... Args>
void log_info(int rank, fmt::format_string<Args...> format, Args&&... args) {
  log_message(LogLevel::kInfo, rank, fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
void log_warning(int rank, fmt::format_string<Args...> format, Args&&... args) {
  log_message(LogLevel::kWarning, rank, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace tessera
