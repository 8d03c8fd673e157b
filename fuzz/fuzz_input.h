#pragma once
// What every fuzz target shares (docs/fuzzing.md): the input as text, a
// file made of it, and the rule that bad input may only end in c10::Error,
// tessera's user error, with a message. Anything else (another exception,
// a crash, a hang, an allocation out of proportion to the input) is a
// finding: libFuzzer stops on it, and the replay test fails on it.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <unistd.h>

namespace tessera {
namespace fuzz {

inline std::string text(const uint8_t* data, size_t size) { return std::string(reinterpret_cast<const char*>(data), size); }

// A file of its own per process (fuzzers may run in parallel), rewritten
// for each input.
inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const char* dir = std::getenv("TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/tessera_fuzz_" + std::to_string(getpid()) + "_" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

// Runs `parse` on the input; a refusal must say something.
template <typename F>
int run(F&& parse) {
  try {
    parse();
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).empty()) std::abort();  // a refusal that says nothing
  }
  return 0;
}

}  // namespace fuzz
}  // namespace tessera
