#include "tessera/context/parallel_config.h"

#include "tessera/core/cli.h"
#include "tessera/core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

namespace tessera {
namespace context {
namespace {

constexpr const char* kOrderRule =
    "order must name each of tp, sp, dp, pp exactly once, separated by '-', "
    "innermost first";

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

// Largest r with r^power <= value, for small non-negative values.
int64_t integer_root(int64_t value, int power) {
  int64_t r = 0;
  auto pow_le = [&](int64_t x) {
    int64_t p = 1;
    for (int i = 0; i < power; ++i) p *= x;
    return p <= value;
  };
  while (pow_le(r + 1)) ++r;
  return r;
}

// Both parse helpers return false for anything but a complete decimal number.
bool parse_int64(const std::string& text, int64_t* out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  *out = value;
  return true;
}

bool parse_uint64(const std::string& text, uint64_t* out) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  *out = value;
  return true;
}

int flag_int(const std::string& flag, const std::string& value) {
  int64_t parsed = 0;
  TORCH_CHECK(parse_int64(value, &parsed) && parsed >= std::numeric_limits<int>::min() &&
                  parsed <= std::numeric_limits<int>::max(),
              "flag ", flag, " expects an integer, got '", value, "'");
  return static_cast<int>(parsed);
}

void apply_flag(ParallelConfig& config, const std::string& flag, const std::string& value) {
  if (flag == "--dp") {
    config.data(flag_int(flag, value));
  } else if (flag == "--pp") {
    config.pipeline(flag_int(flag, value));
  } else if (flag == "--tp") {
    config.tensor(flag_int(flag, value));
  } else if (flag == "--tp-mode") {
    config.tensor_mode(parse_tensor_mode(value));
  } else if (flag == "--tp-depth") {
    config.tensor_depth(flag_int(flag, value));
  } else if (flag == "--sp") {
    config.sequence(flag_int(flag, value));
  } else if (flag == "--sp-mode") {
    config.sequence_mode(parse_sequence_mode(value));
  } else if (flag == "--sp-split") {
    config.sequence_split(parse_sequence_split(value));
  } else if (flag == "--sp-ulysses") {
    config.sequence_ulysses(flag_int(flag, value));
  } else if (flag == "--ep") {
    config.expert(flag_int(flag, value));
  } else if (flag == "--order") {
    config.order(value);
  } else if (flag == "--seed") {
    uint64_t seed = 0;
    TORCH_CHECK(parse_uint64(value, &seed), "flag --seed expects a non-negative integer, got '", value, "'");
    config.seed(seed);
  } else {
    TORCH_INTERNAL_ASSERT(false, "unhandled flag ", flag);
  }
}

bool known_flag(const std::string& flag) {
  static constexpr std::array<const char*, 12> kFlags = {"--dp",         "--pp", "--tp",      "--tp-mode",
                                                         "--tp-depth",   "--sp", "--sp-mode", "--sp-split",
                                                         "--sp-ulysses", "--ep", "--order",   "--seed"};
  return std::any_of(kFlags.begin(), kFlags.end(), [&](const char* known) { return flag == known; });
}

using Json = nlohmann::json;

int json_int(const Json& value, const std::string& key) {
  TORCH_CHECK(value.is_number_integer(), "parallel config key '", key, "' must be an integer, got ", value.dump());
  constexpr int kMax = std::numeric_limits<int>::max();
  // Unsigned first: a value above 2^63 would wrap when read as int64.
  const bool in_range = value.is_number_unsigned()
                            ? value.get<uint64_t>() <= static_cast<uint64_t>(kMax)
                            : value.get<int64_t>() >= std::numeric_limits<int>::min() && value.get<int64_t>() <= kMax;
  TORCH_CHECK(in_range, "parallel config key '", key, "' is out of range: ", value.dump());
  return static_cast<int>(value.get<int64_t>());
}

std::string json_string(const Json& value, const std::string& key) {
  TORCH_CHECK(value.is_string(), "parallel config key '", key, "' must be a string, got ", value.dump());
  return value.get<std::string>();
}

void check_keys(const Json& object, const std::string& where, const std::vector<std::string>& allowed) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    TORCH_CHECK(std::find(allowed.begin(), allowed.end(), it.key()) != allowed.end(), "unknown parallel config key '",
                where, it.key(), "'; accepted keys are ", join_list(allowed));
  }
}

}  // namespace

std::string tensor_mode_name(TensorMode mode) {
  switch (mode) {
    case TensorMode::k1D:
      return "1d";
    case TensorMode::k2D:
      return "2d";
    case TensorMode::k2p5D:
      return "2.5d";
    case TensorMode::k3D:
      return "3d";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown TensorMode ", static_cast<int>(mode));
}

TensorMode parse_tensor_mode(const std::string& name) {
  for (TensorMode mode : {TensorMode::k1D, TensorMode::k2D, TensorMode::k2p5D, TensorMode::k3D}) {
    if (lower(name) == tensor_mode_name(mode)) return mode;
  }
  TORCH_CHECK(false, "unknown tensor mode '", name, "'; accepted tensor modes are 1d, 2d, 2.5d, 3d");
}

std::string sequence_mode_name(SequenceMode mode) {
  switch (mode) {
    case SequenceMode::kUlysses:
      return "ulysses";
    case SequenceMode::kRing:
      return "ring";
    case SequenceMode::kRsa:
      return "rsa";
    case SequenceMode::kHybrid:
      return "hybrid";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown SequenceMode ", static_cast<int>(mode));
}

SequenceMode parse_sequence_mode(const std::string& name) {
  for (SequenceMode mode : {SequenceMode::kUlysses, SequenceMode::kRing, SequenceMode::kRsa, SequenceMode::kHybrid}) {
    if (lower(name) == sequence_mode_name(mode)) return mode;
  }
  TORCH_CHECK(false, "unknown sequence mode '", name, "'; accepted sequence modes are ulysses, ring, rsa, hybrid");
}

std::string sequence_split_name(SequenceSplit split) {
  switch (split) {
    case SequenceSplit::kContiguous:
      return "contiguous";
    case SequenceSplit::kZigzag:
      return "zigzag";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown SequenceSplit ", static_cast<int>(split));
}

SequenceSplit parse_sequence_split(const std::string& name) {
  for (SequenceSplit split : {SequenceSplit::kContiguous, SequenceSplit::kZigzag}) {
    if (lower(name) == sequence_split_name(split)) return split;
  }
  TORCH_CHECK(false, "unknown sequence split '", name, "'; accepted sequence splits are contiguous, zigzag");
}

std::string dim_name(Dim dim) {
  switch (dim) {
    case Dim::kTensor:
      return "tp";
    case Dim::kSequence:
      return "sp";
    case Dim::kData:
      return "dp";
    case Dim::kPipeline:
      return "pp";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Dim ", static_cast<int>(dim));
}

std::vector<Dim> parse_order(const std::string& order) {
  const std::array<Dim, kNumDims> all = {Dim::kTensor, Dim::kSequence, Dim::kData, Dim::kPipeline};
  std::vector<Dim> dims;
  std::istringstream in(order);
  std::string token;
  // getline drops a trailing empty token; check for it by hand.
  TORCH_CHECK(order.empty() || order.back() != '-', "order '", order, "' has an empty dimension name; ", kOrderRule);
  while (std::getline(in, token, '-')) {
    auto it = std::find_if(all.begin(), all.end(), [&](Dim d) { return dim_name(d) == token; });
    TORCH_CHECK(it != all.end(), "order '", order, "' has unknown dimension '", token, "'; ", kOrderRule);
    TORCH_CHECK(std::find(dims.begin(), dims.end(), *it) == dims.end(), "order '", order, "' repeats dimension '",
                token, "'; ", kOrderRule);
    dims.push_back(*it);
  }
  for (Dim d : all) {
    TORCH_CHECK(std::find(dims.begin(), dims.end(), d) != dims.end(), "order '", order, "' is missing dimension '",
                dim_name(d), "'; ", kOrderRule);
  }
  return dims;
}

int ParallelConfig::size(Dim dim) const {
  switch (dim) {
    case Dim::kTensor:
      return tensor_;
    case Dim::kSequence:
      return sequence_;
    case Dim::kData:
      return data_;
    case Dim::kPipeline:
      return pipeline_;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Dim ", static_cast<int>(dim));
}

bool operator==(const ParallelConfig& a, const ParallelConfig& b) {
  return a.data() == b.data() && a.pipeline() == b.pipeline() && a.tensor() == b.tensor() &&
         a.tensor_mode() == b.tensor_mode() && a.tensor_depth() == b.tensor_depth() && a.sequence() == b.sequence() &&
         a.sequence_mode() == b.sequence_mode() && a.sequence_split() == b.sequence_split() &&
         a.sequence_ulysses() == b.sequence_ulysses() && a.expert() == b.expert() && a.order() == b.order() &&
         a.seed() == b.seed();
}

bool operator!=(const ParallelConfig& a, const ParallelConfig& b) { return !(a == b); }

int grid_side(const ParallelConfig& config) {
  const int64_t tp = config.tensor();
  switch (config.tensor_mode()) {
    case TensorMode::k1D:
      return config.tensor();
    case TensorMode::k2D:
      return static_cast<int>(integer_root(tp, 2));
    case TensorMode::k2p5D:
      return static_cast<int>(integer_root(config.tensor_depth() > 0 ? tp / config.tensor_depth() : 0, 2));
    case TensorMode::k3D:
      return static_cast<int>(integer_root(tp, 3));
  }
  TORCH_INTERNAL_ASSERT(false, "unknown tensor mode");
}

namespace {
// Note [Hybrid sequence groups]
// Hybrid splits the sequence group (size sp) into U·R, U = sequence_ulysses:
// sequence rank s = r·U + u, so the Ulysses group (fixed r, vary u) is U
// adjacent ranks, which the grid's order keeps inside a host, and the ring
// group (fixed u, vary r) crosses hosts once per ring hop. U = 1 would be
// ring and U = sp Ulysses: both are refused as hybrid so that a layout has
// one name.
void check_sequence_ulysses(const ParallelConfig& c) {
  const int u = c.sequence_ulysses(), sp = c.sequence();
  if (c.sequence_mode() != SequenceMode::kHybrid || sp == 1) {
    TORCH_CHECK(u == 1, "sequence ulysses size ", u, " is set but sequence mode ",
                sequence_mode_name(c.sequence_mode()), " at sequence size ", sp,
                " has no Ulysses sub-group; only sequence mode hybrid with sequence size > 1 uses it");
    return;
  }
  TORCH_CHECK(u > 1 && u < sp && sp % u == 0, "sequence ulysses size ", u, " does not fit sequence size ", sp,
              ": sequence mode hybrid needs 1 < ulysses < sequence with ulysses dividing it (Ulysses over ulysses "
              "ranks, ring across sequence/ulysses); use mode ring for ulysses 1, mode ulysses for ulysses = sequence");
}
}  // namespace

ParallelConfig resolve(const ParallelConfig& config, int world_size) {
  TORCH_CHECK(world_size >= 1, "world size ", world_size, " is invalid: it must be at least 1");
  const std::pair<const char*, int> sizes[] = {{"pipeline", config.pipeline()},
                                               {"tensor", config.tensor()},
                                               {"sequence", config.sequence()},
                                               {"expert", config.expert()}};
  for (const auto& entry : sizes) {
    TORCH_CHECK(entry.second >= 1, entry.first, " size ", entry.second,
                " is invalid: every parallel size must be at least 1");
  }
  TORCH_CHECK(config.data() >= 0, "data size ", config.data(),
              " is invalid: it must be at least 1, or 0 to derive it from the world size");
  parse_order(config.order());

  // Tensor arrangement. tensor_depth is checked first so that a depth given
  // with the wrong mode is reported as such, not as a shape error.
  const int tp = config.tensor();
  const int depth = config.tensor_depth();
  const std::string mode = tensor_mode_name(config.tensor_mode());
  if (config.tensor_mode() != TensorMode::k2p5D) {
    TORCH_CHECK(depth == 1, "tensor depth ", depth, " is set but tensor mode ", mode,
                " has no depth; only tensor mode 2.5d uses it");
  }
  const int64_t q = grid_side(config);
  switch (config.tensor_mode()) {
    case TensorMode::k1D:
      break;
    case TensorMode::k2D:
      TORCH_CHECK(q * q == tp, "tensor size ", tp, " is not a perfect square, which tensor mode 2d requires");
      break;
    case TensorMode::k2p5D:
      TORCH_CHECK(depth >= 1, "tensor depth ", depth, " is invalid: tensor mode 2.5d needs a depth of at least 1");
      TORCH_CHECK(tp % depth == 0, "tensor size ", tp, " is not divisible by tensor depth ", depth,
                  ", which tensor mode 2.5d requires (tensor = q*q*depth)");
      TORCH_CHECK(q * q == tp / depth, "tensor size ", tp, " divided by tensor depth ", depth, " is ", tp / depth,
                  ", which is not a perfect square; tensor mode 2.5d requires tensor = q*q*depth");
      break;
    case TensorMode::k3D:
      TORCH_CHECK(q * q * q == tp, "tensor size ", tp, " is not a perfect cube, which tensor mode 3d requires");
      break;
  }

  // World = dp·pp·tp·sp, in 64 bits so that absurd sizes cannot overflow.
  const int64_t model = int64_t{config.pipeline()} * int64_t{config.tensor()} * int64_t{config.sequence()};
  ParallelConfig resolved = config;
  if (config.data() == 0) {
    TORCH_CHECK(world_size % model == 0, "world size ", world_size,
                " is not divisible by pipeline*tensor*sequence = ", model, " (pp=", config.pipeline(), " tp=", tp,
                " sp=", config.sequence(), "), so the data size cannot be derived");
    resolved.data(static_cast<int>(world_size / model));
  } else {
    const int64_t product = int64_t{config.data()} * model;
    TORCH_CHECK(product == world_size, "world size ", world_size,
                " does not equal data*pipeline*tensor*sequence = ", config.data(), "*", config.pipeline(), "*", tp, "*",
                config.sequence(), " = ", product);
  }

  check_sequence_ulysses(config);
  TORCH_CHECK(resolved.data() % config.expert() == 0, "expert size ", config.expert(), " does not divide data size ",
              resolved.data(), "; expert groups are carved out of the data dimension");
  return resolved;
}

// Note [Flag parsing]
// The user's program shares argv with us: a "--flag" we do not know is
// skipped, and so is every argument not starting with "--" (positionals and
// the values of unknown flags). A known flag followed by another "--" token is
// reported as missing its value rather than swallowing that flag.
ParallelConfig config_from_args(int argc, const char* const* argv, const ParallelConfig& base) {
  ParallelConfig config = base;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.rfind("--", 0) != 0) continue;
    const size_t eq = arg.find('=');
    const std::string flag = arg.substr(0, eq);
    if (!known_flag(flag)) continue;
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      TORCH_CHECK(!value.empty(), "flag ", flag, " is missing its value");
    } else {
      TORCH_CHECK(i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0, "flag ", flag, " is missing its value");
      value = argv[++i];
    }
    apply_flag(config, flag, value);
  }
  return config;
}

bool is_parallel_flag(const std::string& flag) { return known_flag(flag); }

void add_grid_options(cli::Command& c, ParallelConfig& g) {
  c.add("dp", &g.data(), "data-parallel size; 0: what the other sizes leave of the world");
  c.add("pp", &g.pipeline(), "pipeline stages");
  c.add("tp", &g.tensor(), "tensor-parallel size (2d: q², 2.5d: q²·depth, 3d: q³)");
  c.add("tp-mode", &g.tensor_mode(), "tensor-parallel arrangement", "1d|2d|2.5d|3d", parse_tensor_mode,
        tensor_mode_name);
  c.add("tp-depth", &g.tensor_depth(), "depth of the 2.5d arrangement");
  c.add("sp", &g.sequence(), "sequence-parallel size (tensor mode 1d)");
  c.add("sp-mode", &g.sequence_mode(), "sequence-parallel attention", "ulysses|ring|rsa|hybrid", parse_sequence_mode,
        sequence_mode_name);
  c.add("sp-split", &g.sequence_split(), "tokens per sequence rank: contiguous chunks, or zigzag pairs",
        "contiguous|zigzag", parse_sequence_split, sequence_split_name);
  c.add("sp-ulysses", &g.sequence_ulysses(),
        "sp-mode hybrid: Ulysses over this many adjacent sequence ranks, ring across the groups");
  c.add("ep", &g.expert(), "expert-parallel size, carved out of the data size");
  c.add("order", &g.order(), "grid dimensions, innermost first");
}

ParallelConfig config_from_json(const std::string& json_text) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "parallel config is not valid JSON: ", e.what());
  }
  TORCH_CHECK(root.is_object(), "parallel config must be a JSON object, got ", root.dump());
  check_keys(root, "", {"data", "pipeline", "tensor", "sequence", "expert", "order", "seed"});

  ParallelConfig config;
  if (root.contains("data")) config.data(json_int(root["data"], "data"));
  if (root.contains("pipeline")) config.pipeline(json_int(root["pipeline"], "pipeline"));
  if (root.contains("expert")) config.expert(json_int(root["expert"], "expert"));
  if (root.contains("order")) config.order(json_string(root["order"], "order"));
  if (root.contains("seed")) {
    const Json& seed = root["seed"];
    TORCH_CHECK(seed.is_number_unsigned() || (seed.is_number_integer() && seed.get<int64_t>() >= 0),
                "parallel config key 'seed' must be a non-negative integer, got ", seed.dump());
    config.seed(seed.get<uint64_t>());
  }
  if (root.contains("tensor")) {
    const Json& tensor = root["tensor"];
    if (tensor.is_object()) {
      check_keys(tensor, "tensor.", {"size", "mode", "depth"});
      if (tensor.contains("size")) config.tensor(json_int(tensor["size"], "tensor.size"));
      if (tensor.contains("mode")) {
        config.tensor_mode(parse_tensor_mode(json_string(tensor["mode"], "tensor.mode")));
      }
      if (tensor.contains("depth")) config.tensor_depth(json_int(tensor["depth"], "tensor.depth"));
    } else {
      config.tensor(json_int(tensor, "tensor"));
    }
  }
  if (root.contains("sequence")) {
    const Json& sequence = root["sequence"];
    if (sequence.is_object()) {
      check_keys(sequence, "sequence.", {"size", "mode", "split", "ulysses"});
      if (sequence.contains("size")) config.sequence(json_int(sequence["size"], "sequence.size"));
      if (sequence.contains("mode")) {
        config.sequence_mode(parse_sequence_mode(json_string(sequence["mode"], "sequence.mode")));
      }
      if (sequence.contains("split")) {
        config.sequence_split(parse_sequence_split(json_string(sequence["split"], "sequence.split")));
      }
      if (sequence.contains("ulysses")) config.sequence_ulysses(json_int(sequence["ulysses"], "sequence.ulysses"));
    } else {
      config.sequence(json_int(sequence, "sequence"));
    }
  }
  return config;
}

ParallelConfig config_from_json_file(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot open parallel config file '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  ParallelConfig config;
  std::string error;
  try {
    config = config_from_json(text.str());
  } catch (const c10::Error& e) {
    error = e.msg();
  }
  TORCH_CHECK(error.empty(), "in parallel config file '", path, "': ", error);
  return config;
}

std::string to_string(const ParallelConfig& config) {
  std::ostringstream out;
  out << "dp=";
  if (config.data() == 0) {
    out << "auto";
  } else {
    out << config.data();
  }
  out << " pp=" << config.pipeline() << " tp=" << config.tensor() << '(' << tensor_mode_name(config.tensor_mode());
  if (config.tensor_mode() == TensorMode::k2p5D) out << ",depth=" << config.tensor_depth();
  out << ") sp=" << config.sequence() << '(' << sequence_mode_name(config.sequence_mode());
  if (config.sequence_mode() == SequenceMode::kHybrid) out << ",ulysses=" << config.sequence_ulysses();
  if (config.sequence_split() != SequenceSplit::kContiguous) out << ',' << sequence_split_name(config.sequence_split());
  out << ") ep=" << config.expert()
      << " order=" << config.order() << " seed=" << config.seed();
  return out.str();
}

}  // namespace context
}  // namespace tessera
