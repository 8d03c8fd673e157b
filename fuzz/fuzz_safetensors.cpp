// A safetensors file: its header (JSON, dtypes, shapes, offsets, metadata,
// checksums) and every tensor it lists read back.
#include "fuzz_input.h"

#include "tessera/core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = tessera::fuzz::write_file("model.safetensors", data, size);
  return tessera::fuzz::run([&] {
    tessera::SafetensorsFile f(path);
    for (const auto& name : f.names()) f.read(name);
  });
}
