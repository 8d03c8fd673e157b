#include "tessera/core/safetensors.h"

#include "tessera/core/hash.h"
#include "core/json_int.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>

namespace tessera {
namespace {

using Json = nlohmann::json;

const std::vector<std::pair<at::ScalarType, const char*>>& safetensors_dtypes() {
  static const std::vector<std::pair<at::ScalarType, const char*>> names = {
      {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"}, {at::kLong, "I64"},
      {at::kInt, "I32"},   {at::kShort, "I16"},  {at::kChar, "I8"},       {at::kByte, "U8"},  {at::kBool, "BOOL"}};
  return names;
}

constexpr const char* kChecksumKey = "tessera.hash64.";

const char* safetensors_dtype(at::ScalarType t) {
  for (const auto& [type, name] : safetensors_dtypes())
    if (type == t) return name;
  TORCH_CHECK(false, "safetensors: cannot store dtype ", t);
}

at::ScalarType dtype_of(const std::string& name, const std::string& path) {
  for (const auto& [type, n] : safetensors_dtypes())
    if (name == n) return type;
  TORCH_CHECK(false, "safetensors: ", path, " has a tensor of dtype '", name, "', which tessera does not read");
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata, const WriteHook& hook) {
  Json header = Json::object();
  std::map<std::string, std::string> meta = metadata;
  std::vector<at::Tensor> data;
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(!header.contains(name), "safetensors: tensor name '", name, "' given twice");
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const int64_t bytes = c.numel() * static_cast<int64_t>(c.element_size());
    header[name] = {{"dtype", safetensors_dtype(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    meta[kChecksumKey + name] = fmt::format("{:016x}", hash_bytes(c.data_ptr(), static_cast<size_t>(bytes)));
    data.push_back(std::move(c));
  }
  if (!meta.empty()) header["__metadata__"] = meta;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the format pads the header with spaces to 8 bytes
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.good(), "safetensors: cannot write ", tmp);
    uint64_t n = text.size();
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(n >> (8 * i));
    out.write(reinterpret_cast<const char*>(le), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    const auto total = static_cast<int64_t>(8 + text.size()) + offset;
    int64_t written = total - offset;
    if (hook) hook(out, written, total);
    for (const auto& c : data) {
      out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * c.element_size()));
      written += c.numel() * static_cast<int64_t>(c.element_size());
      if (hook) {
        out.flush();
        hook(out, written, total);
      }
    }
    out.flush();
    TORCH_CHECK(out.good(), "safetensors: writing ", tmp, " failed (disk full?)");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "safetensors: cannot rename ", tmp, " to ", path);
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  std::ifstream in(path_, std::ios::binary);
  TORCH_CHECK(in.good(), "safetensors: cannot open ", path_);
  unsigned char le[8];
  in.read(reinterpret_cast<char*>(le), 8);
  TORCH_CHECK(in.gcount() == 8, "safetensors: ", path_, " is shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(le[i]) << (8 * i);
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  TORCH_CHECK(n <= size - 8, "safetensors: ", path_, " declares a ", n, "-byte header but has ", size, " bytes");
  std::string text(n, '\0');
  in.seekg(8);
  in.read(text.data(), static_cast<std::streamsize>(n));
  Json header;
  try {
    header = Json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "safetensors: ", path_, " has a header that is not JSON: ", e.what());
  }
  data_start_ = static_cast<int64_t>(8 + n);
  TORCH_CHECK(header.is_object(), "safetensors: ", path_, " has a header that is not a JSON object");
  // A header with the right syntax and the wrong types (a shape that is a
  // string, a dtype that is a number) is as damaged as one that is not JSON.
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it.value().begin(); m != it.value().end(); ++m) metadata_[m.key()] = m.value().get<std::string>();
        continue;
      }
      Entry e;
      e.dtype = dtype_of(it.value().at("dtype").get<std::string>(), path_);
      e.shape = json_ints(it.value().at("shape"));
      const auto offsets = json_ints(it.value().at("data_offsets"));
      const uint64_t data_bytes = size - 8 - n;
      TORCH_CHECK(offsets.size() == 2 && 0 <= offsets[0] && offsets[0] <= offsets[1] &&
                      static_cast<uint64_t>(offsets[1]) <= data_bytes,
                  "safetensors: ", path_, ": tensor '", it.key(), "' lies outside the file (truncated?)");
      e.begin = offsets[0];
      e.end = offsets[1];
      // Its bytes bound the element count, so a product past them is refused
      // before it can overflow.
      const bool empty = std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end();
      int64_t numel = empty ? 0 : 1;
      for (int64_t d : e.shape) {
        TORCH_CHECK(d >= 0 && (empty || numel <= (e.end - e.begin) / d), "safetensors: ", path_, ": tensor '", it.key(),
                    "' has shape ", c10::IntArrayRef(e.shape), ", which its ", e.end - e.begin, " bytes cannot hold");
        if (!empty) numel *= d;
      }
      TORCH_CHECK(numel * static_cast<int64_t>(c10::elementSize(e.dtype)) == e.end - e.begin, "safetensors: ", path_,
                  ": tensor '", it.key(), "' has ", e.end - e.begin, " bytes for its shape");
      entries_[it.key()] = e;
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "safetensors: ", path_, " has a damaged header: ", e.what());
  }
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.first);
  return out;
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), "safetensors: ", path_, " has no tensor '", name, "'");
  return it->second;
}

std::vector<int64_t> SafetensorsFile::shape(const std::string& name) const { return entry(name).shape; }

SafetensorsFile::Location SafetensorsFile::location(const std::string& name) const {
  const Entry& e = entry(name);
  Location loc{e.dtype, e.shape, data_start_ + e.begin, e.end - e.begin};
  auto it = metadata_.find(kChecksumKey + name);
  if (it != metadata_.end()) {
    size_t used = 0;
    try {
      loc.checksum = std::stoull(it->second, &used, 16);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used == 16 && it->second.size() == 16, "safetensors: ", path_, ": the checksum of '", name, "' ('",
                it->second, "') is not 16 hex digits; the file is damaged");
    loc.has_checksum = true;
  }
  return loc;
}

void SafetensorsFile::check(const std::string& name, const void* data, int64_t bytes) const {
  const Location loc = location(name);
  TORCH_CHECK(bytes == loc.bytes, "safetensors: checking '", name, "' of ", path_, " needs its ", loc.bytes,
              " bytes, got ", bytes);
  if (!loc.has_checksum) return;
  const uint64_t got = hash_bytes(data, static_cast<size_t>(bytes));
  TORCH_CHECK(got == loc.checksum, "safetensors: ", path_, " is damaged: tensor '", name, "' has checksum ",
              fmt::format("{:016x}", got), ", the file's header says ", fmt::format("{:016x}", loc.checksum),
              "; write the file again (or restore it from a copy)");
}

at::Tensor SafetensorsFile::read(const std::string& name) const {
  const Entry& e = entry(name);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  std::ifstream in(path_, std::ios::binary);
  in.seekg(data_start_ + e.begin);
  in.read(static_cast<char*>(t.data_ptr()), e.end - e.begin);
  TORCH_CHECK(in.gcount() == e.end - e.begin, "safetensors: ", path_, ": short read of '", name, "'");
  check(name, t.data_ptr(), e.end - e.begin);
  return t;
}

}  // namespace tessera
