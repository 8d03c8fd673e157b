#include "tessera/infer/checkpoint_reader.h"

#include "core/json_int.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace tessera {
namespace infer {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// The elements of a box of `length` at `offset` in a tensor of `shape` (no
// offset and shape: a tensor's own extent), checked as an index from outside
// must be: no negative extent, the box inside the tensor, and no more
// elements than the checkpoint's files have bytes, which also keeps the
// product from overflowing and a damaged index from allocating terabytes.
int64_t check_extent(const std::string& dir, const std::vector<int64_t>& length, const std::vector<int64_t>& offset,
                     const std::vector<int64_t>& shape, uintmax_t stored, const std::string& name) {
  const bool piece = !offset.empty();
  const bool empty = std::find(length.begin(), length.end(), 0) != length.end();
  int64_t numel = empty ? 0 : 1;
  for (size_t d = 0; d < length.size(); ++d) {
    if (piece) {
      TORCH_CHECK(offset[d] >= 0 && length[d] >= 0 && offset[d] <= shape[d] && length[d] <= shape[d] - offset[d],
                  "checkpoint ", dir, " is damaged: '", name, "' has a piece at offset ", c10::IntArrayRef(offset),
                  " of extent ", c10::IntArrayRef(length), " outside its shape ", c10::IntArrayRef(shape));
    } else {
      TORCH_CHECK(length[d] >= 0, "checkpoint ", dir, " is damaged: '", name, "' has shape ", c10::IntArrayRef(length));
    }
    if (empty) continue;
    TORCH_CHECK(static_cast<uintmax_t>(length[d]) <= stored / static_cast<uintmax_t>(numel), "checkpoint ", dir,
                " is damaged: '", name, "' has ", piece ? "a piece of extent " : "shape ", c10::IntArrayRef(length),
                ", more elements than its files (", stored, " bytes) can hold");
    numel *= length[d];
  }
  return numel;
}

}  // namespace

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  const bool partial = dir_.size() > 8 && dir_.compare(dir_.size() - 8, 8, ".partial") == 0;
  TORCH_CHECK(!partial, "checkpoint ", dir_,
              " is a save that did not finish (a '.partial' directory); load an "
              "earlier checkpoint");
  if (!fs::is_directory(dir_)) {
    TORCH_CHECK(!fs::is_directory(dir_ + ".old"), "checkpoint ", dir_, " is missing: a save was replacing it when it ",
                "stopped. The previous checkpoint is in ", dir_, ".old",
                fs::exists(dir_ + ".partial/index.json")
                    ? " and the new one, written in full, in " + dir_ + ".partial"
                    : std::string(" (the new one did not finish)"),
                ". Rename the one to load to ", dir_, ", or save into ", dir_,
                " again: a save puts the previous checkpoint back first");
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
  // Compared as JSON: a "format" that is not a string is just not ours.
  TORCH_CHECK(index.is_object() && index.contains("format") && index.at("format") == "tessera-checkpoint",
              "checkpoint ", dir_, ": index.json is not a tessera checkpoint index");
  // The right syntax with the wrong types (a size that is a string, a piece
  // without its key) is a damaged index, said so, like one that is not JSON.
  try {
    const int64_t version = index.contains("version") ? json_int(index.at("version")) : 0;
    TORCH_CHECK(version == 1 || version == 2, "checkpoint ", dir_, ": index.json has format version ", version,
                "; this tessera reads versions 1 and 2 (a newer tessera wrote it: load it with that one)");
    metadata_ = index.value("metadata", Json::object()).dump();
    world_size_ = static_cast<int>(json_int(index.at("world_size")));
    std::set<std::string> files;
    uintmax_t stored = 0;  // bytes in the rank files: no tensor holds more elements
    for (auto it = index.at("files").begin(); it != index.at("files").end(); ++it) {
      TORCH_CHECK(!it.key().empty() && it.key().find('/') == std::string::npos && it.key() != "." && it.key() != "..",
                  "checkpoint ", dir_, " is damaged: index.json names a file '", it.key(),
                  "' that is not a plain name in the checkpoint's directory");
      files.insert(it.key());
      const std::string path = dir_ + "/" + it.key();
      TORCH_CHECK(fs::exists(path), "checkpoint ", dir_, " is damaged: ", it.key(), " is missing");
      const auto size = fs::file_size(path);
      const int64_t said = json_int(it.value());
      TORCH_CHECK(said >= 0 && size == static_cast<uintmax_t>(said), "checkpoint ", dir_, " is damaged: ", it.key(),
                  " has ", size, " bytes, the index says ", said);
      stored += size;
    }
    for (auto it = index.at("tensors").begin(); it != index.at("tensors").end(); ++it) {
      Entry e;
      e.shape = json_ints(it.value().at("shape"));
      check_extent(dir_, e.shape, {}, {}, stored, it.key());
      for (const auto& p : it.value().at("pieces")) {
        Piece piece{p.at("file").get<std::string>(), p.at("key").get<std::string>(), {}, {},
                    json_int(p.at("flat").at(0)),    json_int(p.at("flat").at(1))};
        if (version >= 2) {
          piece.offset = json_ints(p.at("offset"));
          piece.length = json_ints(p.at("length"));
        } else {  // one sharded dimension, or dim -1 for the whole tensor
          piece.offset.assign(e.shape.size(), 0);
          piece.length = e.shape;
          const auto dim = json_int(p.at("dim"));
          TORCH_CHECK(dim < static_cast<int64_t>(e.shape.size()), "checkpoint ", dir_, ": a piece of '", it.key(),
                      "' is cut along dimension ", dim, " of a tensor of ", e.shape.size());
          if (dim >= 0) {
            piece.offset.at(dim) = json_int(p.at("offset"));
            piece.length.at(dim) = json_int(p.at("length"));
          }
        }
        TORCH_CHECK(piece.offset.size() == e.shape.size() && piece.length.size() == e.shape.size(), "checkpoint ", dir_,
                    ": a piece of '", it.key(), "' has a region of another rank than its tensor");
        TORCH_CHECK(files.count(piece.file), "checkpoint ", dir_, ": a piece of '", it.key(), "' is in '", piece.file,
                    "', which index.json does not list among its files");
        const int64_t region = check_extent(dir_, piece.length, piece.offset, e.shape, stored, it.key());
        TORCH_CHECK(piece.flat_begin >= 0 &&
                        (piece.flat_end == -1 || (piece.flat_begin <= piece.flat_end && piece.flat_end <= region)),
                    "checkpoint ", dir_, ": a piece of '", it.key(), "' has the flat range [", piece.flat_begin, ", ",
                    piece.flat_end, ") of a region of ", region, " elements");
        e.pieces.push_back(std::move(piece));
      }
      tensors_[it.key()] = std::move(e);
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "checkpoint ", dir_, " is damaged: index.json does not have the layout of a tessera index (",
                e.what(), ")");
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
  const auto shape = full_shape(name);
  return region(name, std::vector<int64_t>(shape.size(), 0), shape);
}

at::Tensor CheckpointReader::flat(const std::string& name, const std::vector<int64_t>& offset,
                                  const std::vector<int64_t>& length, int64_t begin, int64_t end) const {
  return region(name, offset, length).reshape({-1}).narrow(0, begin, end - begin);
}

at::Tensor CheckpointReader::region(const std::string& name, const std::vector<int64_t>& offset,
                                    const std::vector<int64_t>& length) const {
  auto it = tensors_.find(name);
  TORCH_CHECK(it != tensors_.end(), "checkpoint ", dir_, " has no tensor '", name, "'");
  const Entry& e = it->second;
  const size_t nd = e.shape.size();
  TORCH_CHECK(offset.size() == nd && length.size() == nd, "checkpoint ", dir_, ": region of '", name, "' needs ", nd,
              " offsets and lengths");
  for (size_t d = 0; d < nd; ++d)
    TORCH_CHECK(offset[d] >= 0 && length[d] >= 0 && offset[d] + length[d] <= e.shape[d], "checkpoint ", dir_,
                ": region of '", name, "' lies outside its shape ", c10::IntArrayRef(e.shape));
  at::Tensor out;
  // Elements of the box filled so far, counted per element to find holes.
  at::Tensor filled = at::zeros(length, at::kBool);
  for (const auto& p : e.pieces) {
    // The overlap of the piece's region with the box, per dimension.
    std::vector<int64_t> lo(nd), hi(nd);
    bool overlaps = true;
    for (size_t d = 0; d < nd; ++d) {
      lo[d] = std::max(offset[d], p.offset[d]);
      hi[d] = std::min(offset[d] + length[d], p.offset[d] + p.length[d]);
      overlaps = overlaps && lo[d] < hi[d];
    }
    if (!overlaps && nd > 0) continue;
    // The rows (dimension 0 of the piece's region) its flat range touches.
    const int64_t region_numel = c10::multiply_integers(p.length);
    const int64_t row = nd == 0 ? 1 : std::max<int64_t>(1, region_numel / std::max<int64_t>(p.length[0], 1));
    const int64_t begin = p.flat_end < 0 ? 0 : p.flat_begin;
    const int64_t end = p.flat_end < 0 ? region_numel : p.flat_end;
    const int64_t r0 = begin / row, r1 = (end + row - 1) / row;
    const at::Tensor data = file(dir_ + "/" + p.file).read(p.key).view({-1});
    std::vector<int64_t> rows_shape = p.length;
    if (nd > 0) rows_shape[0] = r1 - r0;
    at::Tensor rows = at::zeros(rows_shape, data.options());
    at::Tensor mask = at::zeros(rows_shape, at::kBool);
    rows.view({-1}).narrow(0, begin - r0 * row, data.numel()).copy_(data);
    mask.view({-1}).narrow(0, begin - r0 * row, data.numel()).fill_(true);
    if (!out.defined()) out = at::zeros(length, data.options());
    // Narrow both sides to the overlap (piece rows start at region row r0).
    at::Tensor src = rows, src_mask = mask, dst = out, dst_mask = filled;
    bool empty = false;
    for (size_t d = 0; d < nd; ++d) {
      const auto dim = static_cast<int64_t>(d);
      const int64_t base = p.offset[d] + (d == 0 ? r0 : 0);
      const int64_t a = std::max(lo[d], base), b = std::min(hi[d], base + rows_shape[d]);
      if (a >= b) {
        empty = true;
        break;
      }
      src = src.narrow(dim, a - base, b - a);
      src_mask = src_mask.narrow(dim, a - base, b - a);
      dst = dst.narrow(dim, a - offset[d], b - a);
      dst_mask = dst_mask.narrow(dim, a - offset[d], b - a);
    }
    if (empty) continue;
    dst.copy_(at::where(src_mask, src, dst));
    dst_mask.logical_or_(src_mask);
  }
  const int64_t holes = filled.numel() - filled.sum().item<int64_t>();
  TORCH_CHECK(out.defined() && holes == 0, "checkpoint ", dir_, ": tensor '", name, "' has ",
              out.defined() ? holes : filled.numel(), " elements that no piece holds");
  return out;
}

const SafetensorsFile& CheckpointReader::file(const std::string& path) const {
  auto& f = files_[path];
  if (!f) f = std::make_unique<SafetensorsFile>(path);
  return *f;
}

std::vector<CheckpointReader::StoredPiece> CheckpointReader::stored_pieces(const std::string& name) const {
  auto it = tensors_.find(name);
  TORCH_CHECK(it != tensors_.end(), "checkpoint ", dir_, " has no tensor '", name, "'");
  std::vector<StoredPiece> out;
  for (const auto& p : it->second.pieces) {
    StoredPiece s;
    s.path = dir_ + "/" + p.file;
    s.key = p.key;
    s.location = file(s.path).location(p.key);
    s.offset = p.offset;
    s.length = p.length;
    const int64_t region = c10::multiply_integers(p.length);
    s.flat_begin = p.flat_end < 0 ? 0 : p.flat_begin;
    s.flat_end = p.flat_end < 0 ? region : p.flat_end;
    const int64_t elements = s.location.bytes / static_cast<int64_t>(c10::elementSize(s.location.dtype));
    TORCH_CHECK(s.flat_begin >= 0 && s.flat_begin <= s.flat_end && s.flat_end <= region &&
                    elements == s.flat_end - s.flat_begin,
                "checkpoint ", dir_, " is damaged: piece '", p.key, "' of ", p.file, " holds ", elements,
                " elements, the index says [", s.flat_begin, ", ", s.flat_end, ") of a region of ", region);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace infer
}  // namespace tessera
