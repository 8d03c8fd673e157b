#include "tessera/train/token_data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace tessera {
namespace train {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kLlmcMagic = 20240520;
constexpr size_t kLlmcHeaderBytes = 256 * 4;
constexpr int64_t kMinTextBytes = 1000;

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot read the data file ", p.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The bytes of a file, or of every regular file of a directory in name order.
std::string read_source(const std::string& path, std::string* what) {
  TORCH_CHECK(fs::exists(path), "the data path ", path, " does not exist",
              path == "/usr/share/games/fortunes"
                  ? ": install Debian's 'fortunes' package (apt-get install fortunes) or pass --data FILE"
                  : "");
  if (!fs::is_directory(path)) return read_bytes(path);
  std::set<fs::path> files;
  for (const auto& e : fs::directory_iterator(path))
    if (e.is_regular_file() && !e.is_symlink() && e.path().extension().empty()) files.insert(e.path());
  std::string bytes;
  for (const auto& f : files) bytes += read_bytes(f);
  *what = fmt::format("{} files", files.size());
  return bytes;
}

template <class T>
at::Tensor ids_from(const std::string& bytes, size_t skip, const std::string& path) {
  TORCH_CHECK((bytes.size() - skip) % sizeof(T) == 0, "the token file ", path, " holds ", bytes.size() - skip,
              " bytes of ids, not a whole number of ", sizeof(T), "-byte tokens; check --data-format");
  const int64_t n = static_cast<int64_t>((bytes.size() - skip) / sizeof(T));
  std::vector<T> ids(static_cast<size_t>(n));
  std::memcpy(ids.data(), bytes.data() + skip, static_cast<size_t>(n) * sizeof(T));
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(ids[static_cast<size_t>(i)]);
  return out;
}

}  // namespace

std::string token_format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::kAuto:
      return "auto";
    case TokenFormat::kText:
      return "text";
    case TokenFormat::kUint16:
      return "uint16";
    case TokenFormat::kUint32:
      return "uint32";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown token format");
}

TokenFormat parse_token_format(const std::string& name) {
  for (auto f : {TokenFormat::kAuto, TokenFormat::kText, TokenFormat::kUint16, TokenFormat::kUint32})
    if (token_format_name(f) == name) return f;
  TORCH_CHECK(false, "unknown token format '", name, "'; use auto, text, uint16 or uint32");
}

TokenData::TokenData(at::Tensor tokens, int64_t vocab, std::string source)
    : tokens_(std::move(tokens)), vocab_(vocab), needed_vocab_(vocab), source_(std::move(source)) {
  TORCH_CHECK(tokens_.dim() == 1 && tokens_.scalar_type() == at::kLong, "TokenData: tokens must be int64 [n], got ",
              tokens_.sizes(), " ", tokens_.scalar_type());
}

TokenData TokenData::load(const std::string& path, TokenFormat format) {
  std::string what;
  const std::string bytes = read_source(path, &what);
  // FILE.json (scripts/tokenize.py): the ids' dtype and vocabulary.
  int64_t declared_vocab = 0;
  const std::string meta_path = path + ".json";
  if (fs::is_regular_file(path) && fs::exists(meta_path)) {
    nlohmann::json meta;
    try {
      std::ifstream in(meta_path);
      meta = nlohmann::json::parse(in);
      declared_vocab = meta.at("vocab_size").get<int64_t>();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "the token metadata ", meta_path, " is not JSON with \"vocab_size\" and \"dtype\": ",
                  e.what());
    }
    const nlohmann::json dtype = meta.contains("dtype") ? meta.at("dtype") : nlohmann::json("uint16");
    TORCH_CHECK(dtype.is_string(), "the token metadata ", meta_path, ": \"dtype\" must be a string (\"uint16\"), got ",
                dtype.dump());
    const TokenFormat declared = parse_token_format(dtype.get<std::string>());
    TORCH_CHECK(format == TokenFormat::kAuto || format == declared, "--data-format ", token_format_name(format),
                ", but ", meta_path, " says the ids are ", token_format_name(declared));
    format = declared;
  }
  if (format == TokenFormat::kAuto)
    format = fs::path(path).extension() == ".bin" ? TokenFormat::kUint16 : TokenFormat::kText;
  if (format == TokenFormat::kText) {
    TORCH_CHECK(static_cast<int64_t>(bytes.size()) >= kMinTextBytes, "the corpus ", path, " has only ", bytes.size(),
                " bytes; give at least ", kMinTextBytes);
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    return TokenData(t.to(at::kLong), 256, what.empty() ? path : fmt::format("{} ({})", path, what));
  }
  // llm.c's files start with a 256-int32 header whose first word is its magic; nanoGPT's have none.
  int32_t magic = 0;
  if (bytes.size() >= kLlmcHeaderBytes) std::memcpy(&magic, bytes.data(), sizeof(magic));
  const size_t skip = magic == kLlmcMagic ? kLlmcHeaderBytes : 0;
  at::Tensor ids = format == TokenFormat::kUint16 ? ids_from<uint16_t>(bytes, skip, path)
                                                  : ids_from<uint32_t>(bytes, skip, path);
  TORCH_CHECK(ids.numel() > 0, "the token file ", path, " holds no tokens");
  const int64_t largest = ids.max().item<int64_t>();
  TORCH_CHECK(declared_vocab == 0 || largest < declared_vocab, "the token file ", path, " holds id ", largest,
              ", but its metadata ", meta_path, " gives a vocabulary of ", declared_vocab,
              "; tokenize it again with the model's tokenizer");
  TokenData data(ids, declared_vocab > 0 ? declared_vocab : std::max<int64_t>(50257, largest + 1),
                 fmt::format("{} ({})", path, token_format_name(format)));
  data.needed_vocab_ = declared_vocab > 0 ? declared_vocab : largest + 1;
  return data;
}

std::pair<int64_t, int64_t> TokenData::range(Split split) const {
  const int64_t n = size(), cut = n * 9 / 10;
  return split == Split::kTrain ? std::make_pair(int64_t{0}, cut) : std::make_pair(cut, n);
}

void TokenData::check_window(int64_t seq) const {
  for (Split s : {Split::kTrain, Split::kValidation}) {
    const auto [begin, end] = range(s);
    TORCH_CHECK(end - begin > seq + 2, "the data ", source_, " is too small for sequences of ", seq, ": its ",
                s == Split::kTrain ? "training" : "validation", " split holds ", end - begin,
                " tokens; give more data or a shorter --seq");
  }
}

TokenWindows TokenData::windows(Split split, int64_t rows, int64_t seq, uint64_t seed) const {
  const auto [begin, end] = range(split);
  TORCH_CHECK(end - begin > seq + 1, "TokenData::windows: the split holds ", end - begin,
              " tokens, too few for a window of ", seq + 1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor starts = at::randint(begin, end - seq - 1, {rows, 1}, gen, at::kLong);
  at::Tensor idx = starts + at::arange(seq + 1, at::kLong).view({1, -1});
  at::Tensor w = tokens_.index_select(0, idx.view({-1})).view({rows, seq + 1});
  return {w.narrow(1, 0, seq).contiguous(), w.narrow(1, 1, seq).contiguous()};
}

uint64_t window_seed(uint64_t run_seed, int64_t step, Split split) {
  return split == Split::kTrain ? run_seed * 1000003 + static_cast<uint64_t>(step) : 7 + static_cast<uint64_t>(step);
}

}  // namespace train
}  // namespace tessera
