// Compares two checkpoints' whole state, bit for bit: the same tensor names,
// each tensor read full and equal in dtype, shape and every byte, and the
// same "step" in the metadata. Used by fault_matrix.sh.
//   checkpoint_compare A B    exit 0: equal; 1: they differ (the first
//                             difference printed); 2: one cannot be read
//                             (the reader's message printed)
#include "tessera/infer/checkpoint_reader.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <iostream>
#include <memory>
#include <string>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: checkpoint_compare A B\n";
    return 2;
  }
  std::unique_ptr<tessera::infer::CheckpointReader> a, b;
  try {
    a = std::make_unique<tessera::infer::CheckpointReader>(argv[1]);
    b = std::make_unique<tessera::infer::CheckpointReader>(argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "cannot read: " << e.what() << "\n";
    return 2;
  }
  const auto step = [](const tessera::infer::CheckpointReader& r) {
    return nlohmann::json::parse(r.metadata()).value("step", int64_t{-1});
  };
  if (step(*a) != step(*b)) {
    std::cout << "differ: step " << step(*a) << " against " << step(*b) << "\n";
    return 1;
  }
  const auto names = a->names();
  if (names != b->names()) {
    std::cout << "differ: " << names.size() << " tensors against " << b->names().size() << " (or other names)\n";
    return 1;
  }
  for (const auto& name : names) {
    const at::Tensor x = a->full(name), y = b->full(name);
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes() || !at::equal(x, y)) {
      std::cout << "differ: " << name << " (largest difference "
                << (x.sizes() == y.sizes() ? (x.to(at::kDouble) - y.to(at::kDouble)).abs().max().item<double>() : -1)
                << ")\n";
      return 1;
    }
  }
  std::cout << "equal: " << names.size() << " tensors at step " << step(*a) << ", bit for bit\n";
  return 0;
}
