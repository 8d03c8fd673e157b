#pragma once
// Removing a directory tree without std::filesystem::remove_all
// (Note [remove_all under LibTorch 2.11] in src/core/remove_tree.cpp).
#include <string>

namespace tessera {

// Removes `path` and, for a directory, everything under it; symbolic links
// are removed, not followed. A path that does not exist is not an error.
// Returns false on failure with the OS's message in *error (if given).
bool remove_tree(const std::string& path, std::string* error = nullptr);

}  // namespace tessera
