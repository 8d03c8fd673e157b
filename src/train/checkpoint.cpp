#include "tessera/train/checkpoint.h"

#include "tessera/train/safetensors.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

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
  return {{"name", p.name},         {"shape", p.full_shape}, {"dim", p.dim},
          {"offset", p.offset},     {"length", p.length},    {"flat", {p.flat_begin, p.flat_end}},
          {"numel", p.data.numel()}};
}

// Identical pieces (the same elements of the same tensor) have equal keys.
std::string piece_key(const Json& d) {
  return fmt::format("{}|{}|{}|{}|{}|{}", d["name"].get<std::string>(), d["dim"].get<int64_t>(),
                     d["offset"].get<int64_t>(), d["length"].get<int64_t>(), d["flat"][0].get<int64_t>(),
                     d["flat"][1].get<int64_t>());
}

int64_t region_numel(const std::vector<int64_t>& shape, int64_t dim, int64_t length) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) n *= static_cast<int64_t>(i) == dim ? length : shape[i];
  return n;
}

std::string file_name(int rank) { return fmt::format("rank-{:05d}.safetensors", rank); }

void write_text(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    TORCH_CHECK(out.good(), "checkpoint: writing ", tmp, " failed");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint: cannot rename ", tmp, " to ", path);
}

}  // namespace

void save_checkpoint(const std::string& dir, const std::vector<TensorPiece>& pieces, const std::string& metadata_json,
                     const comm::CommunicatorPtr& world, const CheckpointOptions& options) {
  TORCH_CHECK(world != nullptr, "save_checkpoint: the communicator must not be null");
  Json metadata;
  try {
    metadata = Json::parse(metadata_json.empty() ? "{}" : metadata_json);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "save_checkpoint: metadata is not JSON: ", e.what());
  }
  const std::string partial = dir + ".partial";
  const int rank = world->rank();
  if (rank == 0) {
    std::error_code ec;
    fs::remove_all(partial, ec);
    fs::create_directories(partial, ec);
  }
  // Rank 0's error (an unwritable directory) reaches every rank.
  at::Tensor ok = at::tensor({rank == 0 ? (fs::is_directory(partial) ? 1L : 0L) : 1L}, at::kLong);
  world->all_reduce(ok, {comm::ReduceOp::kMin});
  TORCH_CHECK(ok.item<int64_t>() == 1, "save_checkpoint: cannot create the directory ", partial);

  Json mine = Json::array();
  for (const auto& p : pieces) {
    const int64_t region = region_numel(p.full_shape, p.dim, p.length);
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
                                       {"dim", d["dim"]},
                                       {"offset", d["offset"]},
                                       {"length", d["length"]},
                                       {"flat", d["flat"]}});
  }

  std::string error;
  try {
    if (!to_write.empty()) {
      const std::string path = partial + "/" + file_name(rank);
      write_safetensors(path, to_write);
      if (options.after_file()) options.after_file()(path);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  at::Tensor failed = at::tensor({error.empty() ? 0L : 1L}, at::kLong);
  world->all_reduce(failed);
  TORCH_CHECK(failed.item<int64_t>() == 0, "save_checkpoint: ", failed.item<int64_t>(),
              " rank(s) could not write their file", error.empty() ? "" : ": ", error);

  if (rank == 0) {
    Json files = Json::object();
    for (int r = 0; r < world->size(); ++r) {
      const std::string path = partial + "/" + file_name(r);
      if (fs::exists(path)) files[file_name(r)] = fs::file_size(path);
    }
    Json index = {{"format", "tessera-checkpoint"}, {"version", 1},   {"world_size", world->size()},
                  {"metadata", metadata},           {"files", files}, {"tensors", tensors}};
    write_text(partial + "/index.json", index.dump(1));
    std::error_code ec;
    const std::string old = dir + ".old";
    fs::remove_all(old, ec);
    if (fs::exists(dir)) fs::rename(dir, old);
    fs::rename(partial, dir);
    fs::remove_all(old, ec);
  }
  world->barrier();
}

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  const bool partial = dir_.size() > 8 && dir_.compare(dir_.size() - 8, 8, ".partial") == 0;
  TORCH_CHECK(!partial, "checkpoint ", dir_,
              " is a save that did not finish (a '.partial' directory); load an "
              "earlier checkpoint");
  if (!fs::is_directory(dir_)) {
    TORCH_CHECK(!fs::is_directory(dir_ + ".partial"), "checkpoint ", dir_, " is incomplete: only ", dir_,
                ".partial exists (a save that did not finish); load an earlier checkpoint");
    TORCH_CHECK(false, "checkpoint ", dir_, " does not exist");
  }
  const std::string index_path = dir_ + "/index.json";
  TORCH_CHECK(fs::exists(index_path), "checkpoint ", dir_,
              " has no index.json: it is not a tessera checkpoint or "
              "its save did not finish");
  Json index;
  try {
    std::ifstream in(index_path);
    index = Json::parse(in);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint ", dir_, ": index.json is not valid JSON: ", e.what());
  }
  TORCH_CHECK(index.value("format", "") == "tessera-checkpoint", "checkpoint ", dir_,
              ": index.json is not a tessera checkpoint index");
  metadata_ = index["metadata"].dump();
  world_size_ = index["world_size"].get<int>();
  for (auto it = index["files"].begin(); it != index["files"].end(); ++it) {
    const std::string path = dir_ + "/" + it.key();
    TORCH_CHECK(fs::exists(path), "checkpoint ", dir_, " is damaged: ", it.key(), " is missing");
    const auto size = fs::file_size(path);
    TORCH_CHECK(size == it.value().get<uintmax_t>(), "checkpoint ", dir_, " is damaged: ", it.key(), " has ", size,
                " bytes, the index says ", it.value().get<uintmax_t>());
  }
  for (auto it = index["tensors"].begin(); it != index["tensors"].end(); ++it) {
    Entry e;
    e.shape = it.value()["shape"].get<std::vector<int64_t>>();
    for (const auto& p : it.value()["pieces"])
      e.pieces.push_back(Piece{p["file"].get<std::string>(), p["key"].get<std::string>(), p["dim"].get<int64_t>(),
                               p["offset"].get<int64_t>(), p["length"].get<int64_t>(), p["flat"][0].get<int64_t>(),
                               p["flat"][1].get<int64_t>()});
    tensors_[it.key()] = std::move(e);
  }
}

std::vector<std::string> CheckpointReader::names(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& t : tensors_)
    if (t.first.compare(0, prefix.size(), prefix) == 0) out.push_back(t.first);
  return out;
}

std::vector<int64_t> CheckpointReader::full_shape(const std::string& name) const {
  auto it = tensors_.find(name);
  TORCH_CHECK(it != tensors_.end(), "checkpoint ", dir_, " has no tensor '", name, "'");
  return it->second.shape;
}

at::Tensor CheckpointReader::full(const std::string& name) const {
  auto it = tensors_.find(name);
  TORCH_CHECK(it != tensors_.end(), "checkpoint ", dir_, " has no tensor '", name, "'");
  const Entry& e = it->second;
  auto read = [&](const Piece& p) {
    auto& f = files_[p.file];
    if (!f) f = std::make_unique<SafetensorsFile>(dir_ + "/" + p.file);
    return f->read(p.key);
  };
  // Pieces grouped by region; each region filled flat, then placed.
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<const Piece*>> regions;
  for (const auto& p : e.pieces) regions[{p.dim, p.offset, p.length}].push_back(&p);
  at::Tensor out;
  int64_t covered = 0, total = 1;
  for (int64_t d : e.shape) total *= d;
  for (const auto& [where, list] : regions) {
    const auto [dim, offset, length] = where;
    std::vector<int64_t> shape = e.shape;
    if (dim >= 0) shape[dim] = length;
    at::Tensor region;
    int64_t filled = 0;
    for (const Piece* p : list) {
      at::Tensor data = read(*p).view({-1});
      if (!out.defined()) out = at::zeros(e.shape, data.options());
      if (!region.defined()) region = at::zeros(shape, data.options());
      const int64_t begin = p->flat_end < 0 ? 0 : p->flat_begin;
      region.view({-1}).narrow(0, begin, data.numel()).copy_(data);
      filled += data.numel();
    }
    TORCH_CHECK(filled == region.numel(), "checkpoint ", dir_, ": tensor '", name, "' has ", region.numel() - filled,
                " elements that no piece holds");
    (dim >= 0 ? out.narrow(dim, offset, length) : out).copy_(region);
    covered += region.numel();
  }
  TORCH_CHECK(out.defined() && covered == total, "checkpoint ", dir_, ": tensor '", name, "' has ", total - covered,
              " elements that no piece holds");
  return out;
}

void consolidate_checkpoint(const std::string& dir, const std::string& out_file, const std::string& prefix) {
  CheckpointReader reader(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& name : reader.names(prefix)) tensors.emplace_back(name.substr(prefix.size()), reader.full(name));
  TORCH_CHECK(!tensors.empty(), "consolidate_checkpoint: ", dir, " has no tensors named ", prefix, "...");
  write_safetensors(out_file, tensors, {{"format", "pt"}, {"source", "tessera checkpoint " + dir}});
}

}  // namespace train
}  // namespace tessera
