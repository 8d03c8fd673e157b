#pragma once
// Token streams for language-model training, and the windows a step trains
// on (docs/train-gpt.md, "Data"):
//   text    the bytes of a file, or of every file of a directory in name
//           order (a vocabulary of 256)
//   uint16  token ids as little-endian uint16 (nanoGPT's .bin; llm.c's with
//           its 256-word header, magic 20240520)
//   uint32  the same as uint32, for vocabularies above 65 535
// A token file FILE may have a metadata file FILE.json beside it
// (scripts/tokenize.py writes one): {"dtype": "uint16"|"uint32",
// "vocab_size": N, ...}; its dtype is the format and N the vocabulary, and
// an id >= N is refused.
// Windows are drawn from (seed, step) alone, so every rank draws the same
// ones and a resumed run continues the data where it stopped.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>

namespace tessera {
namespace train {

// auto: uint16 for a file ending in .bin, text otherwise.
enum class TokenFormat { kAuto, kText, kUint16, kUint32 };

std::string token_format_name(TokenFormat format);
TokenFormat parse_token_format(const std::string& name);

// The first 90 % of the tokens train, the rest validate.
enum class Split { kTrain, kValidation };

struct TokenWindows {
  at::Tensor inputs;   // [rows, seq] int64
  at::Tensor targets;  // [rows, seq] int64, the inputs shifted by one token
};

class TokenData {
 public:
  // Reads every token of `path` into memory. Throws naming the path when it
  // does not exist, cannot be read, is not whole tokens, or holds fewer
  // than 1000 bytes of text.
  static TokenData load(const std::string& path, TokenFormat format = TokenFormat::kAuto);
  // From tokens in memory (int64, one dimension).
  TokenData(at::Tensor tokens, int64_t vocab, std::string source);

  const at::Tensor& tokens() const { return tokens_; }
  int64_t size() const { return tokens_.numel(); }
  // 256 for text; for ids, the metadata's vocab_size, else the largest id
  // + 1, at least GPT-2's 50257.
  int64_t vocab() const { return vocab_; }
  // The vocabulary a model needs for these tokens: the metadata's
  // vocab_size, else the largest id + 1 (256 for text).
  int64_t needed_vocab() const { return needed_vocab_; }
  // The path, and what it held ("... (12 files)", "uint16").
  const std::string& source() const { return source_; }
  // Throws unless both splits hold a window of seq + 1 tokens.
  void check_window(int64_t seq) const;

  // `rows` windows of seq + 1 tokens of the split, their starts drawn
  // uniformly from a generator seeded with `seed`.
  TokenWindows windows(Split split, int64_t rows, int64_t seq, uint64_t seed) const;

 private:
  std::pair<int64_t, int64_t> range(Split split) const;

  at::Tensor tokens_;
  int64_t vocab_ = 256;
  int64_t needed_vocab_ = 256;
  std::string source_;
};

// The seed of step `step`'s training windows in a run seeded with `run_seed`,
// and of its validation windows.
uint64_t window_seed(uint64_t run_seed, int64_t step, Split split);

}  // namespace train
}  // namespace tessera
