#pragma once
// ParallelConfig: how the ranks of a job are divided between data, pipeline,
// tensor, sequence and expert parallelism (see docs/parallel-context.md).
//
// A config is written in code, read from command-line flags or from JSON, and
// checked against the world size by resolve(), which every rank runs before
// any communication so that a bad config fails the same way everywhere.
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace cli {
class Command;
}
namespace context {

// How the tensor-parallel ranks are arranged.
//   1d:   tp ranks in a line (Megatron)
//   2d:   tp = q·q, SUMMA over rows and columns
//   2.5d: tp = q·q·depth, SUMMA replicated over depth (Tesseract)
//   3d:   tp = q·q·q
enum class TensorMode { k1D, k2D, k2p5D, k3D };
// How attention is split over the sequence ranks (docs/sequence-parallel.md):
//   ulysses: all-to-all from a sequence split to a head split and back
//   ring:    ring attention, keys and values passed around with an online softmax
//   rsa:     ring self-attention (keys, then values, around the ring)
//   hybrid:  Ulysses over sequence_ulysses adjacent ranks (inside a host),
//            ring attention across the sequence / sequence_ulysses groups
enum class SequenceMode { kUlysses, kRing, kRsa, kHybrid };
// Which tokens of a sequence a sequence rank holds: P contiguous chunks, or
// 2P chunks with rank r holding r and 2P-1-r (balances causal work).
enum class SequenceSplit { kContiguous, kZigzag };

// "1d", "2d", "2.5d", "3d".
std::string tensor_mode_name(TensorMode mode);
// Parses the names above (case-insensitive); throws c10::Error listing them.
TensorMode parse_tensor_mode(const std::string& name);
// "ulysses", "ring", "rsa", "hybrid".
std::string sequence_mode_name(SequenceMode mode);
SequenceMode parse_sequence_mode(const std::string& name);
// "contiguous", "zigzag".
std::string sequence_split_name(SequenceSplit split);
SequenceSplit parse_sequence_split(const std::string& name);

// The four dimensions of the rank grid. Expert parallelism is not a dimension
// of its own: expert groups are carved out of the data dimension.
enum class Dim { kTensor, kSequence, kData, kPipeline };
constexpr int kNumDims = 4;

// "tp", "sp", "dp", "pp": the tokens of the order string.
std::string dim_name(Dim dim);
// Splits an order string ("tp-sp-dp-pp", innermost first) into dimensions.
// Throws unless it names each of tp, sp, dp, pp exactly once.
std::vector<Dim> parse_order(const std::string& order);

// Built in LibTorch's options style:
//   ParallelConfig().data(2).tensor(4).tensor_mode(TensorMode::k2D)
// Sizes are not checked here; resolve() checks them against the world size.
struct ParallelConfig {
  // Data-parallel size; 0 derives it as world / (pipeline·tensor·sequence).
  TORCH_ARG(int, data) = 0;
  TORCH_ARG(int, pipeline) = 1;
  TORCH_ARG(int, tensor) = 1;
  TORCH_ARG(TensorMode, tensor_mode) = TensorMode::k1D;
  // Depth of the 2.5d arrangement; must stay 1 in every other mode.
  TORCH_ARG(int, tensor_depth) = 1;
  TORCH_ARG(int, sequence) = 1;
  TORCH_ARG(SequenceMode, sequence_mode) = SequenceMode::kUlysses;
  TORCH_ARG(SequenceSplit, sequence_split) = SequenceSplit::kContiguous;
  // Sequence mode hybrid: the Ulysses group's size U (1 < U < sequence,
  // dividing it); 1 in every other mode. The ring spans sequence / U ranks.
  TORCH_ARG(int, sequence_ulysses) = 1;
  // Expert-parallel size; divides data.
  TORCH_ARG(int, expert) = 1;
  // Grid dimensions, innermost (adjacent ranks) first.
  TORCH_ARG(std::string, order) = "tp-sp-dp-pp";
  // Base of every per-mode seed (RankGrid::seed_for).
  TORCH_ARG(uint64_t, seed) = 42;

 public:
  // Size of one grid dimension (data as stored, possibly 0 before resolve).
  int size(Dim dim) const;
};

bool operator==(const ParallelConfig& a, const ParallelConfig& b);
bool operator!=(const ParallelConfig& a, const ParallelConfig& b);

// Checks config against world_size and returns it with data derived.
// Throws c10::Error naming the value and the rule it breaks, for example
// "tensor size 8 is not a perfect square, which tensor mode 2d requires".
// Pure: every rank given the same inputs throws the same error.
ParallelConfig resolve(const ParallelConfig& config, int world_size);

// Reads --dp --pp --tp --tp-mode --tp-depth --sp --sp-mode --sp-split
// --sp-ulysses --ep --order --seed, as "--dp 2" or "--dp=2", over the values of base. Unknown flags and
// other arguments are ignored (they belong to the user's program); parsing
// stops at "--". A known flag without a value, or with a value that is not a
// number where one is needed, throws. argv[0] is the program name.
ParallelConfig config_from_args(int argc, const char* const* argv, const ParallelConfig& base = ParallelConfig());

// Adds --dp --pp --tp --tp-mode --tp-depth --sp --sp-mode --sp-split
// --sp-ulysses --ep --order to a command's option table, bound to `config`'s fields (Note
// [One option table] in tessera/core/cli.h): what every command with a
// grid reads. --seed is the command's own.
void add_grid_options(cli::Command& command, ParallelConfig& config);

// True for the flags config_from_args reads ("--dp", "--tp-mode", ...; the
// flag alone, without "=value"): for programs that parse the rest of argv
// strictly and leave the grid's dimensions to config_from_args.
bool is_parallel_flag(const std::string& flag);

// Reads a JSON object with the keys
//   {"data": 2, "pipeline": 1, "tensor": {"size": 4, "mode": "2d", "depth": 1},
//    "sequence": {"size": 4, "mode": "hybrid", "split": "zigzag", "ulysses": 2},
//    "expert": 1,
//    "order": "tp-sp-dp-pp", "seed": 42}
// all optional; "tensor" and "sequence" may also be plain numbers (the size).
// Unknown keys and values of the wrong type throw, naming the key.
ParallelConfig config_from_json(const std::string& json_text);
ParallelConfig config_from_json_file(const std::string& path);

// The side q of the tensor arrangement: tp = q² in 2d, q²·depth in 2.5d,
// q³ in 3d; tp itself in 1d. The largest such q for sizes resolve() refuses.
int grid_side(const ParallelConfig& config);

// One line: "dp=2 pp=2 tp=2(1d) sp=1(ulysses) ep=1 order=tp-sp-dp-pp seed=42";
// hybrid shows its Ulysses size: "sp=4(hybrid,ulysses=2,zigzag)".
std::string to_string(const ParallelConfig& config);

}  // namespace context
}  // namespace tessera
