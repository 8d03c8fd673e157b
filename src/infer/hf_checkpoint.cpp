#include "tessera/infer/hf_checkpoint.h"

#include "tessera/comm/agree.h"
#include "tessera/core/atomic_file.h"
#include "tessera/core/remove_tree.h"
#include "tessera/core/safetensors.h"
#include "tessera/infer/checkpoint_reader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace tessera {
namespace infer {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

constexpr const char* kModelPrefix = "model/";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

void remove_tree_or_throw(const std::string& path) {
  std::string error;
  TORCH_CHECK(remove_tree(path, &error), "Hugging Face export: cannot remove ", path, ": ", error,
              "; remove it by hand or choose another output directory");
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot read ", path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string strip_model(const std::string& name) {
  const std::string p = kModelPrefix;
  return name.compare(0, p.size(), p) == 0 ? name.substr(p.size()) : std::string();
}

// The Hugging Face box of part `p` of `entry` that holds tessera rows
// [lo, hi) and the box `offset`/`length` of the trailing dimensions.
void part_box(const models::HFPart& p, int64_t lo, int64_t hi, const std::vector<int64_t>& offset,
              const std::vector<int64_t>& length, std::vector<int64_t>& ho, std::vector<int64_t>& hl) {
  using Kind = models::HFPart::Kind;
  ho = p.offset;
  switch (p.kind) {
    case Kind::kRows:
      hl = length;
      hl[0] = hi - lo;
      ho[0] += lo - p.begin;
      for (size_t d = 1; d < ho.size(); ++d) ho[d] += offset[d];
      break;
    case Kind::kTransposed:
      hl = {length[1], hi - lo};
      ho[0] += offset[1];
      ho[1] += lo - p.begin;
      break;
    case Kind::kExpert:
      hl.assign(length.begin() + 1, length.end());
      for (size_t d = 0; d < ho.size(); ++d) ho[d] += offset[d + 1];
      break;
  }
}

}  // namespace

std::string hf_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      TORCH_CHECK(false, "Hugging Face weights are float32, bfloat16 or float16, not ", dtype);
  }
}

at::ScalarType hf_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  TORCH_CHECK(false, "dtype '", name, "' is not one of float32 (fp32), bfloat16 (bf16), float16 (fp16)");
}

models::HFConfig read_hf_config(const std::string& dir) {
  TORCH_CHECK(fs::is_directory(dir), "Hugging Face model '", dir, "' is not a directory; pass the directory that "
              "holds config.json and model.safetensors (save_pretrained's output)");
  const std::string config_path = (fs::path(dir) / "config.json").string();
  TORCH_CHECK(fs::exists(config_path), "Hugging Face model ", dir, " has no config.json");
  return models::hf_config_from_json(read_text(config_path), config_path);
}

HFCheckpoint::HFCheckpoint(std::string dir, int io_threads) : dir_(std::move(dir)) {
  hf_ = read_hf_config(dir_);

  // Which file holds each tensor: the index, or the one file.
  std::map<std::string, std::string> file_names;
  const fs::path index = fs::path(dir_) / kIndexFile;
  std::vector<std::string> files;
  if (fs::exists(index)) {
    Json j;
    try {
      j = Json::parse(read_text(index.string()));
      for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it)
        file_names[it.key()] = it.value().get<std::string>();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, index.string(), " is not a safetensors index (JSON with \"weight_map\": {tensor: file}): ",
                  e.what());
    }
    for (const auto& [tensor, file] : file_names) {
      TORCH_CHECK(file.find('/') == std::string::npos && file != ".." && !file.empty(), index.string(),
                  ": tensor '", tensor, "' lies in '", file, "', not a file of the directory");
      if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
    }
  } else {
    TORCH_CHECK(fs::exists(fs::path(dir_) / kSingleFile), "Hugging Face model ", dir_, " has neither ", kSingleFile,
                " nor ", kIndexFile, " (PyTorch .bin weights are not read: save the model with safetensors)");
    files.push_back(kSingleFile);
  }
  for (const auto& file : files) {
    const std::string path = (fs::path(dir_) / file).string();
    TORCH_CHECK(fs::exists(path), "Hugging Face model ", dir_, ": shard ", file, " named by ", kIndexFile,
                " is missing");
    files_.push_back(std::make_unique<StoredWeights>(path, StoredWeightsOptions().io_threads(io_threads)));
    const int id = static_cast<int>(files_.size()) - 1;
    for (const auto& name : files_.back()->names()) {
      auto listed = file_names.find(name);
      TORCH_CHECK(file_names.empty() || (listed != file_names.end() && listed->second == file), path, " holds '",
                  name, "', which ", kIndexFile, " places in ",
                  listed == file_names.end() ? std::string("no file") : listed->second);
      TORCH_CHECK(file_of_.emplace(name, id).second, "Hugging Face model ", dir_, ": tensor '", name,
                  "' is stored twice");
    }
  }
  for (const auto& [tensor, file] : file_names)
    TORCH_CHECK(file_of_.count(tensor), kIndexFile, " places '", tensor, "' in ", file, ", which does not hold it");

  // GPT-2 under transformers' names, or the original files' (no prefix).
  const bool bare = hf_.architecture == models::HFArchitecture::kGPT2 && file_of_.count("wte.weight");
  table_ = models::hf_table(hf_.architecture, hf_.model, bare ? "" : "transformer.");
  const auto shapes = models::hf_shapes(table_);
  const std::string arch = models::hf_architecture_name(hf_.architecture);
  for (const auto& [name, shape] : shapes) {
    auto it = file_of_.find(name);
    TORCH_CHECK(it != file_of_.end(), "Hugging Face model ", dir_, " has no tensor '", name, "', which its ", arch,
                " (config.json) needs");
    const auto stored = files_[it->second]->shape(name);
    TORCH_CHECK(stored == shape, files_[it->second]->path(), ": tensor '", name, "' has shape ",
                c10::IntArrayRef(stored), ", config.json's ", arch, " has ", c10::IntArrayRef(shape));
  }
  bool first = true;
  for (const auto& [name, id] : file_of_) {
    if (models::hf_ignored_tensor(hf_.architecture, name)) continue;
    TORCH_CHECK(shapes.count(name), files_[id]->path(), " holds '", name, "', which is not a weight of config.json's ",
                arch, " (an option config.json does not state, or another model's tensor)");
    const at::ScalarType t = files_[id]->dtype(name);
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, files_[id]->path(), ": tensor '", name,
                "' is ", t, "; weights are read from float32, bfloat16 or float16");
    if (first) stored_dtype_ = t, first = false;
  }
}

HFCheckpoint::~HFCheckpoint() = default;

const std::string& HFCheckpoint::file_of(const std::string& hf_name) const {
  auto it = file_of_.find(hf_name);
  TORCH_CHECK(it != file_of_.end(), describe(), " has no tensor '", hf_name, "'");
  return files_.at(it->second)->path();
}

std::vector<std::string> HFCheckpoint::names(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : table_) {
    const std::string full = kModelPrefix + name;
    if (full.compare(0, prefix.size(), prefix) == 0) out.push_back(full);
  }
  return out;
}

bool HFCheckpoint::contains(const std::string& name) const { return table_.count(strip_model(name)) > 0; }

const models::HFEntry& HFCheckpoint::entry(const std::string& name) const {
  auto it = table_.find(strip_model(name));
  TORCH_CHECK(it != table_.end(), describe(), " has no tensor '", name, "'");
  return it->second;
}

std::vector<int64_t> HFCheckpoint::full_shape(const std::string& name) const { return entry(name).shape; }

at::Tensor HFCheckpoint::full(const std::string& name) const {
  const auto shape = full_shape(name);
  return region(name, std::vector<int64_t>(shape.size(), 0), shape);
}

at::Tensor HFCheckpoint::flat(const std::string& name, const std::vector<int64_t>& offset,
                              const std::vector<int64_t>& length, int64_t begin, int64_t end) const {
  const auto shape = full_shape(name);
  const bool whole = offset.empty();
  const at::Tensor box = region(name, whole ? std::vector<int64_t>(shape.size(), 0) : offset, whole ? shape : length);
  return box.reshape({-1}).slice(0, begin, end);  // a view: the box is its only copy
}

at::Tensor HFCheckpoint::read_box(const std::string& hf_name, const std::vector<int64_t>& offset,
                                  const std::vector<int64_t>& length, const at::Tensor& into) const {
  StoredWeights& file = *files_.at(file_of_.at(hf_name));
  const auto plan = file.plan(hf_name, offset, length);
  // Straight into the caller's box when it has the stored dtype and layout;
  // otherwise through a read buffer.
  at::Tensor out = into;
  if (!out.defined() || out.scalar_type() != plan.dtype || !out.is_contiguous()) {
    out = at::empty(length, at::TensorOptions().dtype(plan.dtype));
    largest_read_ = std::max(largest_read_, plan.bytes);
  }
  std::vector<IoWork> works;
  file.issue(plan, out.data_ptr(), works);
  for (const auto& w : works) w.wait();
  file.complete(plan, out.data_ptr());
  return out;
}

at::Tensor HFCheckpoint::region(const std::string& name, const std::vector<int64_t>& offset,
                                const std::vector<int64_t>& length) const {
  const models::HFEntry& e = entry(name);
  TORCH_CHECK(offset.size() == e.shape.size() && length.size() == e.shape.size(), describe(), ": a box of '", name,
              "' needs ", e.shape.size(), " offsets and lengths");
  at::Tensor out = at::empty(length, at::kFloat);
  if (out.numel() == 0) return out;
  const int64_t first = offset[0], last = offset[0] + length[0];
  std::vector<int64_t> ho, hl;
  for (const auto& p : e.parts) {
    const int64_t lo = std::max(first, p.begin), hi = std::min(last, p.begin + p.rows);
    if (lo >= hi) continue;
    part_box(p, lo, hi, offset, length, ho, hl);
    at::Tensor dst = out.narrow(0, lo - first, hi - lo);
    const bool direct = p.kind == models::HFPart::Kind::kRows;
    at::Tensor box = read_box(p.name, ho, hl, direct ? dst : at::Tensor());
    if (box.data_ptr() == dst.data_ptr()) continue;  // read in place
    box = box.to(at::kFloat);
    if (p.kind == models::HFPart::Kind::kTransposed) box = box.t();
    if (p.kind == models::HFPart::Kind::kExpert) box = box.unsqueeze(0);
    dst.copy_(box);
  }
  return out;
}

namespace {

// The Hugging Face tensor `hf_name` from the checkpoint's pieces, through the
// parts that write it.
at::Tensor assemble(const CheckpointReader& reader, const std::vector<int64_t>& shape,
                    const std::vector<std::pair<const models::HFEntry*, std::pair<std::string, models::HFPart>>>& parts,
                    at::ScalarType dtype) {
  at::Tensor out = at::empty(shape, at::kFloat);
  std::vector<int64_t> ho, hl;
  for (const auto& [entry, named] : parts) {
    const auto& [name, p] = named;
    std::vector<int64_t> offset(entry->shape.size(), 0), length = entry->shape;
    offset[0] = p.begin, length[0] = p.rows;
    at::Tensor box = reader.region(kModelPrefix + name, offset, length).to(at::kFloat);
    part_box(p, p.begin, p.begin + p.rows, offset, length, ho, hl);
    if (p.kind == models::HFPart::Kind::kTransposed) box = box.t();
    if (p.kind == models::HFPart::Kind::kExpert) box = box.squeeze(0);
    at::Tensor dst = out;
    for (size_t d = 0; d < ho.size(); ++d) dst = dst.narrow(static_cast<int64_t>(d), ho[d], hl[d]);
    dst.copy_(box);
  }
  return out.to(dtype).contiguous();
}

}  // namespace

namespace {

// What a checkpoint holds for export: its model, the architecture and the
// config.json it came with (when imported).
struct ExportModel {
  models::GPTConfig config;
  std::string original;
  models::HFArchitecture architecture = models::HFArchitecture::kLlama;
};

ExportModel export_model(const CheckpointReader& reader, const std::string& dir) {
  // As the trainer recorded it: under "extra" (Trainer::save), or at the top.
  Json meta = Json::parse(reader.metadata());
  if (!meta.contains("gpt") && meta.contains("extra") && meta["extra"].is_object()) meta = meta["extra"];
  TORCH_CHECK(meta.contains("gpt"), "checkpoint ", dir, " does not record a tessera GPT (its metadata has no "
              "\"gpt\"); export_hf writes the decoder models (train_gpt's checkpoints)");
  ExportModel m;
  m.config = models::GPTConfig::from_json(meta["gpt"].dump());
  m.original = meta.contains("hf") ? meta["hf"].get<std::string>() : std::string();
  m.architecture = m.original.empty()
                       ? models::hf_architecture_for(m.config)
                       : models::hf_config_from_json(m.original, dir + " (imported config.json)").architecture;
  return m;
}

// Tensors in name order, cut into shards of at most `limit` bytes.
std::vector<std::vector<std::string>> plan_shards(const std::map<std::string, std::vector<int64_t>>& shapes,
                                                  int64_t element, int64_t limit, int64_t& total) {
  std::vector<std::vector<std::string>> shards(1);
  int64_t in_shard = 0;
  total = 0;
  for (const auto& [name, shape] : shapes) {
    const int64_t bytes = c10::multiply_integers(shape) * element;
    if (!shards.back().empty() && in_shard + bytes > limit) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(name);
    in_shard += bytes, total += bytes;
  }
  return shards;
}

std::string shard_file(int k, int n) {
  return n == 1 ? std::string(kSingleFile) : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
}

// Rank 0, once every shard is written: the JSON files, then the directory
// in place of any earlier one.
void finish_export(const ExportModel& m, const std::vector<std::vector<std::string>>& shards, int64_t total,
                   const std::string& dtype, const std::string& staging, const std::string& out_dir) {
  const int n = static_cast<int>(shards.size());
  const std::string config_json = models::hf_config_json(m.architecture, m.config, m.original, dtype);
  write_file_atomically((fs::path(staging) / "config.json").string(), config_json + "\n");
  write_file_atomically((fs::path(staging) / "generation_config.json").string(),
                        models::hf_generation_config_json(config_json) + "\n");
  if (n > 1) {
    Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", Json::object()}};
    for (int k = 0; k < n; ++k)
      for (const auto& name : shards[k]) index["weight_map"][name] = shard_file(k, n);
    write_file_atomically((fs::path(staging) / kIndexFile).string(), index.dump(2) + "\n");
  }
  // An earlier directory is moved aside, the finished one moved in, the
  // earlier one removed: OUT_DIR is never a partial export.
  const std::string old = out_dir + ".old";
  remove_tree_or_throw(old);
  if (fs::exists(out_dir)) fs::rename(out_dir, old);
  fs::rename(staging, out_dir);
  remove_tree_or_throw(old);
}

}  // namespace

HFExportStats export_hf(const std::string& checkpoint_dir, const std::string& out_dir,
                        const comm::CommunicatorPtr& world, const HFExportOptions& options) {
  TORCH_CHECK(options.shard_bytes() > 0, "export_hf: the shard size must be positive, got ", options.shard_bytes());
  const CheckpointReader reader(checkpoint_dir);
  const ExportModel m = export_model(reader, checkpoint_dir);
  const auto table = models::hf_table(m.architecture, m.config);
  const auto shapes = models::hf_shapes(table);
  // Hugging Face tensor -> the (tessera tensor, part) pairs that write it.
  std::map<std::string, std::vector<std::pair<const models::HFEntry*, std::pair<std::string, models::HFPart>>>> writes;
  for (const auto& [name, entry] : table) {
    const std::string key = kModelPrefix + name;
    TORCH_CHECK(reader.contains(key), "checkpoint ", checkpoint_dir, " has no '", key, "', which its model (",
                m.config.to_json(), ") has");
    TORCH_CHECK(reader.full_shape(key) == entry.shape, "checkpoint ", checkpoint_dir, ": '", name, "' has shape ",
                c10::IntArrayRef(reader.full_shape(key)), ", its model's is ", c10::IntArrayRef(entry.shape));
    for (const auto& p : entry.parts) writes[p.name].push_back({&entry, {name, p}});
  }
  at::ScalarType dtype = at::kFloat;  // the stored values' (fp32 masters), unless asked
  if (options.dtype()) {
    dtype = *options.dtype();
  } else if (!table.empty()) {
    const auto pieces = reader.stored_pieces(kModelPrefix + table.begin()->first);
    if (!pieces.empty()) dtype = pieces.front().location.dtype;
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  HFExportStats stats;
  const auto shards = plan_shards(shapes, element, options.shard_bytes(), stats.bytes);
  const int n = static_cast<int>(shards.size());
  stats.architecture = models::hf_architecture_name(m.architecture);
  stats.tensors = static_cast<int64_t>(shapes.size()), stats.shards = n;

  const std::string staging = out_dir + ".partial";
  comm::on_every_rank(world, "Hugging Face export (preparing " + staging + ")", [&] {
    if (world->rank() != 0) return;
    remove_tree_or_throw(staging);
    fs::create_directories(staging);
  });
  // Shard k by rank k mod N: one shard in memory at a time.
  comm::on_every_rank(world, "Hugging Face export (writing shards)", [&] {
    for (int k = world->rank(); k < n; k += world->size()) {
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const auto& name : shards[k]) {
        tensors.emplace_back(name, assemble(reader, shapes.at(name), writes.at(name), dtype));
        stats.bytes_written_here += tensors.back().second.numel() * element;
      }
      write_safetensors((fs::path(staging) / shard_file(k, n)).string(), tensors, {{"format", "pt"}});
    }
  });
  comm::on_every_rank(world, "Hugging Face export (config and index)", [&] {
    if (world->rank() == 0) finish_export(m, shards, stats.bytes, hf_dtype_name(dtype), staging, out_dir);
  });
  return stats;
}

}  // namespace infer
}  // namespace tessera
