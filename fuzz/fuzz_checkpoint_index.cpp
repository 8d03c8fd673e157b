// A checkpoint directory's index.json (versions 1 and 2: tensors, pieces,
// boxes, flat ranges, rank files) beside one valid rank file, and every
// tensor it lists assembled.
#include "fuzz_input.h"

#include "tessera/core/safetensors.h"
#include "tessera/infer/checkpoint_reader.h"

#include <ATen/ATen.h>

#include <filesystem>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const std::string dir = [] {
    const std::string d = fs::path(tessera::fuzz::write_file("ckpt_probe", nullptr, 0)).string() + ".d";
    fs::create_directories(d);
    // rank-00000.safetensors: a [4, 3] float tensor and a scalar, as the seeds' index describes.
    tessera::write_safetensors(d + "/rank-00000.safetensors",
                               {{"model/w#0", at::arange(12, at::kFloat).reshape({4, 3})}, {"model/s#0", at::ones({1})}});
    return d;
  }();
  {
    std::ofstream out(dir + "/index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  return tessera::fuzz::run([&] {
    tessera::infer::CheckpointReader reader(dir);
    for (const auto& name : reader.names()) reader.full(name);
  });
}
