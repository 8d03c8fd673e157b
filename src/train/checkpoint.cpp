#include "tessera/train/checkpoint.h"

#include "tessera/comm/factory.h"
#include "tessera/core/atomic_file.h"
#include "tessera/core/remove_tree.h"
#include "tessera/core/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace tessera {
namespace train {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

Json describe(const TensorPiece& p) {
  // The region spelled out: the whole tensor is offset 0, length full_shape.
  const bool whole = p.offset.empty();
  return {{"name", p.name},
          {"shape", p.full_shape},
          {"offset", whole ? std::vector<int64_t>(p.full_shape.size(), 0) : p.offset},
          {"length", whole ? p.full_shape : p.length},
          {"flat", {p.flat_begin, p.flat_end}},
          {"numel", p.data.numel()}};
}

// Identical pieces (the same elements of the same tensor) have equal keys.
std::string piece_key(const Json& d) {
  return fmt::format("{}|{}|{}|{}|{}", d["name"].get<std::string>(), d["offset"].dump(), d["length"].dump(),
                     d["flat"][0].get<int64_t>(), d["flat"][1].get<int64_t>());
}

std::string file_name(int rank) { return fmt::format("rank-{:05d}.safetensors", rank); }


}  // namespace

void save_checkpoint(const std::string& dir, const std::vector<TensorPiece>& pieces, const std::string& metadata_json,
                     const comm::CommunicatorPtr& world, const CheckpointOptions& options) {
  TORCH_CHECK(world != nullptr, "save_checkpoint: the communicator must not be null");
  // Note [Fault injection]: the save is a place faults fire in.
  const std::shared_ptr<FaultInjector> faults = comm::fault_injector_of(world);
  if (faults) faults->begin_save();
  struct EndSave {
    FaultInjector* faults;
    ~EndSave() {
      if (faults) faults->end_save();
    }
  } end_save{faults.get()};
  // Flags, descriptions and the barrier are host data (Note [Control traffic]).
  const comm::CommunicatorPtr control = world->control();
  Json metadata;
  try {
    metadata = Json::parse(metadata_json.empty() ? "{}" : metadata_json);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "save_checkpoint: metadata is not JSON: ", e.what());
  }
  const std::string partial = dir + ".partial";
  const int rank = world->rank();
  const std::string old = dir + ".old";
  if (rank == 0) {
    std::error_code ec;
    // A save killed between its two renames (Note [Atomic checkpoints]):
    // the previous checkpoint goes back to DIR before this save replaces it.
    if (!fs::exists(dir) && fs::is_directory(old)) fs::rename(old, dir);
    remove_tree(partial);
    fs::create_directories(partial, ec);
  }
  // Rank 0's error (an unwritable directory) reaches every rank.
  at::Tensor ok = at::tensor({rank == 0 ? (fs::is_directory(partial) ? 1L : 0L) : 1L}, at::kLong);
  control->all_reduce(ok, {comm::ReduceOp::kMin});
  TORCH_CHECK(ok.item<int64_t>() == 1, "save_checkpoint: cannot create the directory ", partial);

  Json mine = Json::array();
  for (const auto& p : pieces) {
    TORCH_CHECK(p.offset.size() == p.length.size() && (p.offset.empty() || p.offset.size() == p.full_shape.size()),
                "save_checkpoint: piece of '", p.name, "' has a region of ", p.offset.size(), " offsets and ",
                p.length.size(), " lengths for a tensor of ", p.full_shape.size(), " dimensions");
    const int64_t region = c10::multiply_integers(p.offset.empty() ? p.full_shape : p.length);
    const int64_t expect = p.flat_end < 0 ? region : p.flat_end - p.flat_begin;
    TORCH_CHECK(p.data.defined() && p.data.numel() == expect, "save_checkpoint: piece of '", p.name, "' holds ",
                p.data.defined() ? p.data.numel() : 0, " elements where its description says ", expect);
    mine.push_back(describe(p));
  }
  const auto all = comm::all_gather_strings(*world, mine.dump());

  // Who writes each distinct piece (the same decision on every rank).
  std::map<std::string, std::vector<std::pair<int, size_t>>> holders;  // key -> (rank, index there)
  std::vector<std::string> order;
  std::vector<Json> described(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    described[r] = Json::parse(all[r]);
    for (size_t i = 0; i < described[r].size(); ++i) {
      const std::string key = piece_key(described[r][i]);
      auto& h = holders[key];
      if (h.empty()) order.push_back(key);
      h.emplace_back(static_cast<int>(r), i);
    }
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  std::vector<std::pair<std::string, at::Tensor>> to_write;
  Json tensors = Json::object();
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& h = holders[order[k]];
    const auto [writer, index] = h[k % h.size()];
    const Json& d = described[writer][index];
    const std::string name = d["name"].get<std::string>();
    const auto shape = d["shape"].get<std::vector<int64_t>>();
    auto [it, fresh] = shapes.emplace(name, shape);
    TORCH_CHECK(fresh || it->second == shape, "save_checkpoint: ranks disagree on the full shape of '", name, "'");
    const std::string key = fmt::format("{}#{}", name, k);
    if (writer == rank) to_write.emplace_back(key, pieces[index].data.reshape({-1}));
    if (!tensors.contains(name)) tensors[name] = {{"shape", shape}, {"pieces", Json::array()}};
    tensors[name]["pieces"].push_back({{"file", file_name(writer)},
                                       {"key", key},
                                       {"offset", d["offset"]},
                                       {"length", d["length"]},
                                       {"flat", d["flat"]}});
  }

  std::string error;
  try {
    if (!to_write.empty()) {
      const std::string path = partial + "/" + file_name(rank);
      write_safetensors(path, to_write, {}, faults ? faults->file_hook() : nullptr);
      if (options.after_file()) options.after_file()(path);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Every rank learns which ranks failed, and why.
  const auto errors = comm::all_gather_strings(*control, error);
  std::string failed, first;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    if (first.empty()) first = fmt::format("rank {}: {}", r, errors[r]);
  }
  TORCH_CHECK(failed.empty(), "save_checkpoint: rank(s) ", failed, " of the world could not write their file into ",
              partial, " (", first, "). ", dir, " was left as it was; free space or fix the directory and save again.");

  if (rank == 0) {
    Json files = Json::object();
    for (int r = 0; r < world->size(); ++r) {
      const std::string path = partial + "/" + file_name(r);
      if (fs::exists(path)) files[file_name(r)] = fs::file_size(path);
    }
    Json index = {{"format", "tessera-checkpoint"}, {"version", 2},   {"world_size", world->size()},
                  {"metadata", metadata},           {"files", files}, {"tensors", tensors}};
    write_file_atomically(partial + "/index.json", index.dump(1), faults ? faults->index_hook() : nullptr);
    remove_tree(old);
    if (fs::exists(dir)) fs::rename(dir, old);
    if (options.before_move_in()) options.before_move_in()();
    fs::rename(partial, dir);
    remove_tree(old);
  }
  control->barrier();
}

void consolidate_checkpoint(const std::string& dir, const std::string& out_file, const std::string& prefix) {
  infer::CheckpointReader reader(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& name : reader.names(prefix)) tensors.emplace_back(name.substr(prefix.size()), reader.full(name));
  TORCH_CHECK(!tensors.empty(), "consolidate_checkpoint: ", dir, " has no tensors named ", prefix, "...");
  write_safetensors(out_file, tensors,
                    {{"format", "pt"},
                     {"source", "tessera checkpoint " + dir},
                     {"tessera.checkpoint_metadata", reader.metadata()}});
}

}  // namespace train
}  // namespace tessera
