#pragma once
#include <string>

namespace tessera {

// Writes `text` to `path` through path + ".tmp" and a rename, so a failed
// write (a full disk) leaves an earlier file whole; the temporary is
// removed on failure. Throws naming the file and what to do.
void write_file_atomically(const std::string& path, const std::string& text);

}  // namespace tessera
