#pragma once
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>

namespace tessera {

// A writer's hook (Note [Fault injection] in core/fault_injection.h): called
// with the stream and the bytes written so far of `total`, at least once
// midway through the file. It may fail the stream or end the process.
using WriteHook = std::function<void(std::ostream& out, int64_t written, int64_t total)>;

// Writes `text` to `path` through path + ".tmp" and a rename, so a failed
// write (a full disk) leaves an earlier file whole; the temporary is
// removed on failure. Throws naming the file and what to do.
void write_file_atomically(const std::string& path, const std::string& text, const WriteHook& hook = nullptr);

}  // namespace tessera
