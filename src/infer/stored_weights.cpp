#include "tessera/infer/stored_weights.h"

#include "tessera/infer/checkpoint_reader.h"
#include "tessera/infer/hf_checkpoint.h"
#include "tessera/core/safetensors.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <filesystem>
#include <map>

namespace tessera {
namespace infer {

namespace fs = std::filesystem;

namespace {

// One stored piece of a tensor, in the coordinates of Note [Checkpoint layout].
struct Piece {
  int file = 0;
  std::string key;
  const SafetensorsFile* source = nullptr;  // for its checksum
  SafetensorsFile::Location location;
  std::vector<int64_t> offset, length;
  int64_t flat_begin = 0, flat_end = 0;
};

struct Tensor {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  std::vector<int> pieces;
};

}  // namespace

struct StoredWeights::Impl {
  std::string path;
  StoredWeightsOptions options;
  std::unique_ptr<SafetensorsFile> single;
  std::unique_ptr<CheckpointReader> checkpoint;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> hf_files;
  std::string metadata = "{}";
  std::vector<std::string> file_paths;
  std::vector<std::unique_ptr<AsyncFile>> files;
  std::vector<Piece> pieces;
  std::vector<char> checked;
  std::map<std::string, Tensor> tensors;

  int file_index(const std::string& file) {
    for (const auto i : c10::irange(file_paths.size()))
      if (file_paths[i] == file) return static_cast<int>(i);
    file_paths.push_back(file);
    files.push_back(std::make_unique<AsyncFile>(AsyncFile::open_read(file, {options.io_threads(), false})));
    return static_cast<int>(file_paths.size() - 1);
  }

  const Tensor& tensor(const std::string& name) const {
    auto it = tensors.find(name);
    TORCH_CHECK(it != tensors.end(), "weights ", path, " have no tensor '", name, "'");
    return it->second;
  }
};

StoredWeights::StoredWeights(const std::string& path, StoredWeightsOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  m.options = options;
  TORCH_CHECK(options.io_threads() >= 1, "StoredWeights: io_threads must be >= 1, got ", options.io_threads());
  if (path.rfind("hf:", 0) == 0) {
    open_hf(path.substr(3));
    return;
  }
  TORCH_CHECK(fs::exists(path) || fs::is_directory(path + ".old"), "weights '", path,
              "' do not exist; pass a safetensors file (tessera_consolidate writes one) or a checkpoint directory");
  if (!fs::is_directory(path) && fs::exists(path)) {
    m.single = std::make_unique<SafetensorsFile>(path);
    const int file = m.file_index(path);
    auto meta = m.single->metadata().find("tessera.checkpoint_metadata");
    if (meta != m.single->metadata().end()) m.metadata = meta->second;
    for (const auto& name : m.single->names()) {
      Piece p;
      p.file = file;
      p.key = name;
      p.source = m.single.get();
      p.location = m.single->location(name);
      p.length = p.location.shape;
      p.offset.assign(p.length.size(), 0);
      p.flat_end = p.location.bytes / static_cast<int64_t>(c10::elementSize(p.location.dtype));
      m.tensors[name] = Tensor{p.location.shape, p.location.dtype, {static_cast<int>(m.pieces.size())}};
      m.pieces.push_back(std::move(p));
    }
  } else {
    m.checkpoint = std::make_unique<CheckpointReader>(path);  // refuses damaged and unfinished directories
    m.metadata = m.checkpoint->metadata();
    for (const auto& full : m.checkpoint->names(options.prefix())) {
      Tensor t;
      t.shape = m.checkpoint->full_shape(full);
      bool first = true;
      for (auto& s : m.checkpoint->stored_pieces(full)) {
        TORCH_CHECK(first || s.location.dtype == t.dtype, "checkpoint ", path, ": the pieces of '", full,
                    "' have different dtypes (", t.dtype, ", ", s.location.dtype, ")");
        t.dtype = s.location.dtype;
        first = false;
        Piece p;
        p.file = m.file_index(s.path);
        p.key = s.key;
        p.source = &m.checkpoint->file(s.path);
        p.location = s.location;
        p.offset = s.offset;
        p.length = s.length;
        p.flat_begin = s.flat_begin;
        p.flat_end = s.flat_end;
        t.pieces.push_back(static_cast<int>(m.pieces.size()));
        m.pieces.push_back(std::move(p));
      }
      m.tensors[full.substr(options.prefix().size())] = std::move(t);
    }
    TORCH_CHECK(!m.tensors.empty(), "checkpoint ", path, " has no tensors named ", options.prefix(), "...");
  }
  m.checked.assign(m.pieces.size(), 0);
}

// Each part of a tessera tensor is a stored piece (Note [Checkpoint layout]):
// rows [begin, begin + rows) of it lie contiguous in the Hugging Face
// tensor's bytes from its row offset on; an expert is a whole tensor.
void StoredWeights::open_hf(const std::string& dir) {
  Impl& m = *impl_;
  const HFCheckpoint hf(dir, m.options.io_threads());  // checks config.json, the files and every shape
  m.metadata = "{\"gpt\": " + hf.config().to_json() + "}";
  for (const auto& [name, entry] : hf.table()) {
    Tensor t;
    t.shape = entry.shape;
    for (const auto& part : entry.parts) {
      TORCH_CHECK(part.kind != models::HFPart::Kind::kTransposed, "weights hf:", dir, " are GPT-2's, whose "
                  "Conv1D matrices are stored transposed and cannot be read in row boxes; import them with train_gpt "
                  "--init-from and stream the checkpoint it saves");
      const std::string& file = hf.file_of(part.name);
      auto& opened = m.hf_files[file];
      if (!opened) opened = std::make_unique<SafetensorsFile>(file);
      Piece p;
      p.file = m.file_index(file);
      p.key = part.name;
      p.source = opened.get();
      p.location = opened->location(part.name);
      const std::vector<int64_t> rest(entry.shape.begin() + 1, entry.shape.end());
      int64_t row = 1;
      for (int64_t d : rest) row *= d;
      const int64_t es = static_cast<int64_t>(c10::elementSize(p.location.dtype));
      p.offset.assign(entry.shape.size(), 0);
      p.offset[0] = part.begin;
      p.length = entry.shape;
      p.length[0] = part.rows;
      // The part starts at its row of the Hugging Face tensor and spans its
      // trailing dimensions whole (the Llama family's tables: offsets in
      // dimension 0 alone).
      for (size_t d = 1; d < part.offset.size(); ++d)
        TORCH_INTERNAL_ASSERT(part.offset[d] == 0, "a Hugging Face part that starts inside a row");
      if (part.kind == models::HFPart::Kind::kRows) p.location.offset += part.offset.at(0) * row * es;
      // A part of a Hugging Face tensor has no checksum of its own (Note [Tensor checksums]).
      const int64_t whole = p.location.bytes;
      p.location.bytes = part.rows * row * es;
      p.location.has_checksum = p.location.has_checksum && p.location.bytes == whole;
      p.flat_end = part.rows * row;
      t.dtype = p.location.dtype;
      t.pieces.push_back(static_cast<int>(m.pieces.size()));
      m.pieces.push_back(std::move(p));
    }
    m.tensors[name] = std::move(t);
  }
  m.checked.assign(m.pieces.size(), 0);
}

StoredWeights::~StoredWeights() = default;

const std::string& StoredWeights::path() const { return impl_->path; }

std::vector<std::string> StoredWeights::names() const {
  std::vector<std::string> out;
  for (const auto& t : impl_->tensors) out.push_back(t.first);
  return out;
}

bool StoredWeights::contains(const std::string& name) const { return impl_->tensors.count(name) > 0; }
std::vector<int64_t> StoredWeights::shape(const std::string& name) const { return impl_->tensor(name).shape; }
at::ScalarType StoredWeights::dtype(const std::string& name) const { return impl_->tensor(name).dtype; }
std::string StoredWeights::metadata_json() const { return impl_->metadata; }

StoredWeights::ReadPlan StoredWeights::plan_whole(const std::string& name) const {
  const auto s = shape(name);
  return plan(name, std::vector<int64_t>(s.size(), 0), s);
}

StoredWeights::ReadPlan StoredWeights::plan(const std::string& name, const std::vector<int64_t>& box_offset,
                                            const std::vector<int64_t>& box_length) const {
  const Impl& m = *impl_;
  const Tensor& t = m.tensor(name);
  const size_t nd0 = t.shape.size();
  TORCH_CHECK(box_offset.size() == nd0 && box_length.size() == nd0, "weights ", m.path, ": a read of '", name,
              "' needs ", nd0, " offsets and lengths");
  for (const auto d : c10::irange(nd0))
    TORCH_CHECK(box_offset[d] >= 0 && box_length[d] >= 0 && box_offset[d] + box_length[d] <= t.shape[d], "weights ",
                m.path, ": the box of '", name, "' at ", c10::IntArrayRef(box_offset), " of ",
                c10::IntArrayRef(box_length), " lies outside its shape ", c10::IntArrayRef(t.shape));
  ReadPlan plan;
  plan.dtype = t.dtype;
  plan.length = box_length;
  const int64_t es = static_cast<int64_t>(c10::elementSize(t.dtype));
  int64_t box_numel = 1;
  for (int64_t l : box_length) box_numel *= l;
  plan.bytes = box_numel * es;
  if (box_numel == 0) return plan;

  for (const int id : t.pieces) {
    const Piece& p = m.pieces[id];
    // 0-d tensors as [1]; then merge the trailing dimensions that box and
    // region both span whole (Note [Reads in extents]).
    std::vector<int64_t> shape = t.shape, bo = box_offset, bl = box_length, ro = p.offset, rl = p.length;
    if (shape.empty()) {
      shape = bl = rl = {1};
      bo = ro = {0};
    }
    int64_t k = static_cast<int64_t>(shape.size()) - 1, inner = 1;
    auto whole = [&](int64_t d) { return bo[d] == 0 && bl[d] == shape[d] && ro[d] == 0 && rl[d] == shape[d]; };
    while (k > 0 && whole(k)) inner *= shape[k--];
    shape.resize(k + 1), bo.resize(k + 1), bl.resize(k + 1), ro.resize(k + 1), rl.resize(k + 1);
    shape[k] *= inner, bo[k] *= inner, bl[k] *= inner, ro[k] *= inner, rl[k] *= inner;
    std::vector<int64_t> lo(k + 1), hi(k + 1), rs(k + 1, 1), bs(k + 1, 1);
    bool empty = false;
    for (int64_t d = 0; d <= k; ++d) {
      lo[d] = std::max(bo[d], ro[d]);
      hi[d] = std::min(bo[d] + bl[d], ro[d] + rl[d]);
      empty = empty || lo[d] >= hi[d];
    }
    if (empty) continue;
    for (int64_t d = k - 1; d >= 0; --d) rs[d] = rs[d + 1] * rl[d + 1], bs[d] = bs[d + 1] * bl[d + 1];
    std::vector<Extent> extents;
    std::vector<int64_t> idx(lo.begin(), lo.begin() + k);  // the row, over dimensions 0..k-1
    for (;;) {
      int64_t f0 = lo[k] - ro[k], dst = lo[k] - bo[k];
      for (int64_t d = 0; d < k; ++d) f0 += (idx[d] - ro[d]) * rs[d], dst += (idx[d] - bo[d]) * bs[d];
      const int64_t a = std::max(f0, p.flat_begin), b = std::min(f0 + hi[k] - lo[k], p.flat_end);
      if (a < b) {
        Extent e{p.file, p.location.offset + (a - p.flat_begin) * es, (b - a) * es, (dst + a - f0) * es};
        if (!extents.empty() && extents.back().file_offset + extents.back().bytes == e.file_offset &&
            extents.back().dst_offset + extents.back().bytes == e.dst_offset)
          extents.back().bytes += e.bytes;
        else
          extents.push_back(e);
      }
      int64_t d = k - 1;
      while (d >= 0 && ++idx[d] == hi[d]) idx[d] = lo[d], --d;
      if (d < 0) break;
    }
    if (p.location.has_checksum && extents.size() == 1 && extents[0].bytes == p.location.bytes)
      plan.checks.push_back(Check{id, extents[0].dst_offset, extents[0].bytes});
    plan.extents.insert(plan.extents.end(), extents.begin(), extents.end());
  }
  // Every byte of the box must come from some piece.
  std::vector<Extent> sorted = plan.extents;
  std::sort(sorted.begin(), sorted.end(), [](const Extent& a, const Extent& b) { return a.dst_offset < b.dst_offset; });
  int64_t covered = 0, holes = 0;
  for (const auto& e : sorted) {
    holes += std::max<int64_t>(0, e.dst_offset - covered);
    covered = std::max(covered, e.dst_offset + e.bytes);
  }
  holes += plan.bytes - covered;
  TORCH_CHECK(holes == 0, "weights ", m.path, ": ", holes / es, " elements of '", name, "' at ",
              c10::IntArrayRef(box_offset), " of ", c10::IntArrayRef(box_length), " are in no stored piece");
  return plan;
}

void StoredWeights::issue(const ReadPlan& plan, void* dst, std::vector<IoWork>& works) {
  // Large extents are split between the I/O threads; small ones (rows of a
  // shard, pieces of a checkpoint) go to each file as one batch.
  constexpr int64_t kLarge = int64_t(1) << 20;
  auto* base = static_cast<char*>(dst);
  std::map<int, std::vector<IoRequest>> small;
  for (const auto& e : plan.extents) {
    if (e.bytes >= kLarge)
      works.push_back(impl_->files[e.file]->read(base + e.dst_offset, e.bytes, e.file_offset));
    else
      small[e.file].push_back(IoRequest{base + e.dst_offset, e.bytes, e.file_offset});
  }
  for (const auto& [file, requests] : small) works.push_back(impl_->files[file]->read_batch(requests));
}

void StoredWeights::complete(const ReadPlan& plan, const void* dst) {
  Impl& m = *impl_;
  if (m.options.drop_cache())
    for (const auto& e : plan.extents) m.files[e.file]->drop_cache(e.file_offset, e.bytes);
  for (const auto& c : plan.checks) {
    if (m.checked[c.piece]) continue;
    const Piece& p = m.pieces[c.piece];
    p.source->check(p.key, static_cast<const char*>(dst) + c.dst_offset, c.bytes);
    m.checked[c.piece] = 1;
  }
}

}  // namespace infer
}  // namespace tessera
