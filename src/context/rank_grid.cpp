#include "tessera/context/rank_grid.h"

#include "tessera/core/error.h"

#include <iomanip>
#include <sstream>

namespace tessera {
namespace context {
namespace {

int dim_index(Dim dim) { return static_cast<int>(dim); }

// Which tensor mode a tensor sub-mode belongs to; k1D's own mode is 1d.
bool tensor_mode_of(ParallelMode mode, TensorMode* out) {
  switch (mode) {
    case ParallelMode::k1D:
      *out = TensorMode::k1D;
      return true;
    case ParallelMode::k2DRow:
    case ParallelMode::k2DCol:
      *out = TensorMode::k2D;
      return true;
    case ParallelMode::k2p5DRow:
    case ParallelMode::k2p5DCol:
    case ParallelMode::k2p5DDep:
    case ParallelMode::k2p5DXZ:
      *out = TensorMode::k2p5D;
      return true;
    case ParallelMode::k3DInput:
    case ParallelMode::k3DWeight:
    case ParallelMode::k3DOutput:
    case ParallelMode::k3DInputWeight:
    case ParallelMode::k3DOutputWeight:
      *out = TensorMode::k3D;
      return true;
    default:
      return false;
  }
}

bool hybrid_sub_mode(ParallelMode mode) {
  return mode == ParallelMode::kSequenceUlysses || mode == ParallelMode::kSequenceRing;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// "[0, 1, 2]", shortened for large groups so that describe() stays readable.
std::string short_list(const std::vector<int>& values) {
  constexpr size_t kMaxShown = 16;
  if (values.size() <= kMaxShown) return join_list(values);
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < 8; ++i) out << values[i] << ", ";
  out << "..., " << values.back() << "] (" << values.size() << " ranks)";
  return out.str();
}

}  // namespace

std::string mode_name(ParallelMode mode) {
  switch (mode) {
    case ParallelMode::kGlobal:
      return "global";
    case ParallelMode::kData:
      return "data";
    case ParallelMode::kPipeline:
      return "pipeline";
    case ParallelMode::kTensor:
      return "tensor";
    case ParallelMode::kSequence:
      return "sequence";
    case ParallelMode::kDataSequence:
      return "data_sequence";
    case ParallelMode::kModel:
      return "model";
    case ParallelMode::k1D:
      return "1d";
    case ParallelMode::k2DRow:
      return "2d_row";
    case ParallelMode::k2DCol:
      return "2d_col";
    case ParallelMode::k2p5DRow:
      return "2.5d_row";
    case ParallelMode::k2p5DCol:
      return "2.5d_col";
    case ParallelMode::k2p5DDep:
      return "2.5d_dep";
    case ParallelMode::k2p5DXZ:
      return "2.5d_xz";
    case ParallelMode::k3DInput:
      return "3d_input";
    case ParallelMode::k3DWeight:
      return "3d_weight";
    case ParallelMode::k3DOutput:
      return "3d_output";
    case ParallelMode::k3DInputWeight:
      return "3d_input_weight";
    case ParallelMode::k3DOutputWeight:
      return "3d_output_weight";
    case ParallelMode::kExpert:
      return "expert";
    case ParallelMode::kExpertData:
      return "expert_data";
    case ParallelMode::kSequenceUlysses:
      return "sequence_ulysses";
    case ParallelMode::kSequenceRing:
      return "sequence_ring";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ParallelMode ", static_cast<int>(mode));
}

const std::vector<ParallelMode>& all_modes() {
  // Immutable after initialisation: not global mutable state.
  static const std::vector<ParallelMode> kModes = [] {
    std::vector<ParallelMode> modes;
    for (int m = 0; m <= static_cast<int>(ParallelMode::kSequenceRing); ++m) {
      modes.push_back(static_cast<ParallelMode>(m));
    }
    return modes;
  }();
  return kModes;
}

RankGrid::RankGrid(const ParallelConfig& config, int world_size)
    : config_(resolve(config, world_size)), world_size_(world_size) {
  int stride = 1;
  for (Dim dim : parse_order(config_.order())) {
    stride_[dim_index(dim)] = stride;
    dim_size_[dim_index(dim)] = config_.size(dim);
    stride *= config_.size(dim);
  }
  TORCH_INTERNAL_ASSERT(stride == world_size_, "grid covers ", stride, " ranks, not ", world_size_);

  const int tp = config_.tensor(), q = grid_side(config_);
  switch (config_.tensor_mode()) {
    case TensorMode::k1D:
      axis_size_[kT0] = tp, axis_size_[kT1] = 1, axis_size_[kT2] = 1;
      break;
    case TensorMode::k2D:
      axis_size_[kT0] = q, axis_size_[kT1] = q, axis_size_[kT2] = 1;  // j, i
      break;
    case TensorMode::k2p5D:
      axis_size_[kT0] = q, axis_size_[kT1] = q, axis_size_[kT2] = config_.tensor_depth();  // j, i, k
      break;
    case TensorMode::k3D:
      axis_size_[kT0] = q, axis_size_[kT1] = q, axis_size_[kT2] = q;  // i, j, k
      break;
  }
  TORCH_INTERNAL_ASSERT(axis_size_[kT0] * axis_size_[kT1] * axis_size_[kT2] == tp);
  const int ulysses = config_.sequence_mode() == SequenceMode::kHybrid ? config_.sequence_ulysses() : 1;
  axis_size_[kS0] = ulysses;
  axis_size_[kS1] = config_.sequence() / ulysses;
  axis_size_[kE0] = config_.expert();
  axis_size_[kE1] = config_.data() / config_.expert();
  axis_size_[kPipe] = config_.pipeline();
}

int RankGrid::dim_size(Dim dim) const { return dim_size_[dim_index(dim)]; }

bool RankGrid::grid_tensor_mode() const { return config_.tensor() > 1 && config_.tensor_mode() != TensorMode::k1D; }

int RankGrid::q() const { return grid_side(config_); }

int RankGrid::batch_blocks() const {
  if (!grid_tensor_mode()) return 1;
  // 2d: the q rows; 2.5d: rows × depth; 3d: the q² (i, k) blocks.
  return config_.tensor() / q();
}

int RankGrid::hidden_blocks() const {
  return config_.tensor_mode() == TensorMode::k2p5D ? config_.tensor() / config_.tensor_depth() : config_.tensor();
}

int RankGrid::vocab_unit() const { return q(); }

ParallelMode RankGrid::token_mode() const {
  return config_.sequence() > 1 ? ParallelMode::kDataSequence : ParallelMode::kData;
}

int RankGrid::stride(Dim dim) const { return stride_[dim_index(dim)]; }

int RankGrid::coordinate(Dim dim, int global_rank) const {
  check_rank(global_rank);
  return (global_rank / stride(dim)) % dim_size(dim);
}

int RankGrid::global_rank_at(const std::array<int, kNumDims>& coordinates) const {
  int rank = 0;
  for (int d = 0; d < kNumDims; ++d) {
    TORCH_CHECK(coordinates[d] >= 0 && coordinates[d] < dim_size_[d], "coordinate ", coordinates[d], " of dimension ",
                dim_name(static_cast<Dim>(d)), " is outside [0, ", dim_size_[d], ")");
    rank += coordinates[d] * stride_[d];
  }
  return rank;
}

RankGrid::Coords RankGrid::split(int global_rank) const {
  const int t = coordinate(Dim::kTensor, global_rank);
  const int d = coordinate(Dim::kData, global_rank);
  Coords c{};
  c[kT0] = t % axis_size_[kT0];
  c[kT1] = (t / axis_size_[kT0]) % axis_size_[kT1];
  c[kT2] = t / (axis_size_[kT0] * axis_size_[kT1]);
  const int s = coordinate(Dim::kSequence, global_rank);
  c[kS0] = s % axis_size_[kS0];
  c[kS1] = s / axis_size_[kS0];
  c[kE0] = d % axis_size_[kE0];
  c[kE1] = d / axis_size_[kE0];
  c[kPipe] = coordinate(Dim::kPipeline, global_rank);
  return c;
}

int RankGrid::join(const Coords& c) const {
  const int t = c[kT0] + axis_size_[kT0] * (c[kT1] + axis_size_[kT1] * c[kT2]);
  const int d = c[kE0] + axis_size_[kE0] * c[kE1];
  const int s = c[kS0] + axis_size_[kS0] * c[kS1];
  return t * stride(Dim::kTensor) + s * stride(Dim::kSequence) + d * stride(Dim::kData) +
         c[kPipe] * stride(Dim::kPipeline);
}

std::vector<RankGrid::Axis> RankGrid::varying_axes(ParallelMode mode) const {
  switch (mode) {
    case ParallelMode::kGlobal: {
      // The grid dimensions in order, sub-axes inner first: global rank order.
      std::vector<Axis> axes;
      for (Dim dim : parse_order(config_.order())) {
        switch (dim) {
          case Dim::kTensor:
            axes.insert(axes.end(), {kT0, kT1, kT2});
            break;
          case Dim::kSequence:
            axes.insert(axes.end(), {kS0, kS1});
            break;
          case Dim::kData:
            axes.insert(axes.end(), {kE0, kE1});
            break;
          case Dim::kPipeline:
            axes.push_back(kPipe);
            break;
        }
      }
      return axes;
    }
    case ParallelMode::kData:
      return {kE0, kE1};
    case ParallelMode::kPipeline:
      return {kPipe};
    case ParallelMode::kTensor:
    case ParallelMode::k1D:
      return {kT0, kT1, kT2};
    case ParallelMode::kSequence:
      return {kS0, kS1};
    case ParallelMode::kDataSequence:
      return {kS0, kS1, kE0, kE1};
    case ParallelMode::kModel:
      return {kT0, kT1, kT2, kPipe};
    // 2d and 2.5d: T0 = column j, T1 = row i, T2 = depth k.
    case ParallelMode::k2DRow:
    case ParallelMode::k2p5DRow:
      return {kT0};
    case ParallelMode::k2DCol:
    case ParallelMode::k2p5DCol:
      return {kT1};
    case ParallelMode::k2p5DDep:
      return {kT2};
    case ParallelMode::k2p5DXZ:
      return {kT1, kT2};
    // 3d: T0 = i, T1 = j, T2 = k.
    case ParallelMode::k3DInput:
      return {kT1};
    case ParallelMode::k3DWeight:
      return {kT2};
    case ParallelMode::k3DOutput:
      return {kT0};
    case ParallelMode::k3DInputWeight:
      return {kT1, kT2};
    case ParallelMode::k3DOutputWeight:
      return {kT0, kT2};
    case ParallelMode::kExpert:
      return {kE0};
    case ParallelMode::kExpertData:
      return {kE1};
    case ParallelMode::kSequenceUlysses:
      return {kS0};
    case ParallelMode::kSequenceRing:
      return {kS1};
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ParallelMode ", static_cast<int>(mode));
}

bool RankGrid::has_mode(ParallelMode mode) const {
  if (hybrid_sub_mode(mode)) return config_.sequence_mode() == SequenceMode::kHybrid && config_.sequence() > 1;
  TensorMode needed = TensorMode::k1D;
  return !tensor_mode_of(mode, &needed) || needed == config_.tensor_mode();
}

std::vector<ParallelMode> RankGrid::modes() const {
  std::vector<ParallelMode> result;
  for (ParallelMode mode : all_modes()) {
    if (has_mode(mode)) result.push_back(mode);
  }
  return result;
}

void RankGrid::check_mode(ParallelMode mode) const {
  if (has_mode(mode)) return;
  TORCH_CHECK(!hybrid_sub_mode(mode), "parallel mode ", mode_name(mode),
              " is not available: it exists only in "
              "sequence mode hybrid with sequence size > 1, and this grid has sequence size ",
              config_.sequence(), " in mode ", sequence_mode_name(config_.sequence_mode()));
  TensorMode needed = TensorMode::k1D;
  tensor_mode_of(mode, &needed);
  TORCH_CHECK(false, "parallel mode ", mode_name(mode), " is not available: the tensor mode is ",
              tensor_mode_name(config_.tensor_mode()), ", and ", mode_name(mode), " exists only in tensor mode ",
              tensor_mode_name(needed));
}

void RankGrid::check_rank(int global_rank) const {
  TORCH_CHECK(global_rank >= 0 && global_rank < world_size_, "global rank ", global_rank, " is outside [0, ",
              world_size_, ")");
}

int RankGrid::group_size(ParallelMode mode) const {
  check_mode(mode);
  int size = 1;
  for (Axis axis : varying_axes(mode)) size *= axis_size_[axis];
  return size;
}

int RankGrid::local_rank(ParallelMode mode, int global_rank) const {
  check_mode(mode);
  const Coords c = split(global_rank);
  const std::vector<Axis> axes = varying_axes(mode);
  int rank = 0;
  for (auto it = axes.rbegin(); it != axes.rend(); ++it) rank = rank * axis_size_[*it] + c[*it];
  return rank;
}

std::vector<int> RankGrid::group_of(ParallelMode mode, int global_rank) const {
  const int size = group_size(mode);
  const std::vector<Axis> axes = varying_axes(mode);
  Coords c = split(global_rank);
  std::vector<int> members;
  members.reserve(size);
  for (int index = 0; index < size; ++index) {
    int rest = index;
    for (Axis axis : axes) {
      c[axis] = rest % axis_size_[axis];
      rest /= axis_size_[axis];
    }
    members.push_back(join(c));
  }
  return members;
}

int RankGrid::group_index(ParallelMode mode, int global_rank) const {
  // Groups are ordered by their first member, which has local rank 0 and is
  // the smallest member (strides are positive).
  const int first = group_of(mode, global_rank).front();
  int index = 0;
  for (int r = 0; r < first; ++r) {
    if (local_rank(mode, r) == 0) ++index;
  }
  return index;
}

std::vector<std::vector<int>> RankGrid::groups(ParallelMode mode) const {
  check_mode(mode);
  std::vector<std::vector<int>> result;
  for (int r = 0; r < world_size_; ++r) {
    if (local_rank(mode, r) == 0) result.push_back(group_of(mode, r));
  }
  return result;
}

uint64_t RankGrid::seed_for(ParallelMode mode, int global_rank, uint64_t base_seed) const {
  check_mode(mode);
  check_rank(global_rank);
  if (mode == ParallelMode::kGlobal) return base_seed;
  // Each step is a bijection of its input, so two ranks that differ in one
  // field differ in the seed.
  uint64_t h = splitmix64(base_seed);
  h = splitmix64(h ^ static_cast<uint64_t>(static_cast<int>(mode) + 1));
  h = splitmix64(h ^ static_cast<uint64_t>(local_rank(mode, global_rank)));
  h = splitmix64(h ^ static_cast<uint64_t>(coordinate(Dim::kPipeline, global_rank)));
  return h;
}

std::string RankGrid::describe(int global_rank) const {
  check_rank(global_rank);
  std::ostringstream out;
  out << "rank " << global_rank << " of " << world_size_ << ": " << to_string(config_) << '\n';
  out << "  coordinates:";
  for (Dim dim : parse_order(config_.order())) {
    out << ' ' << dim_name(dim) << '=' << coordinate(dim, global_rank);
  }
  const Coords c = split(global_rank);
  switch (config_.tensor_mode()) {
    case TensorMode::k1D:
      break;
    case TensorMode::k2D:
      out << " (2d i=" << c[kT1] << " j=" << c[kT0] << ')';
      break;
    case TensorMode::k2p5D:
      out << " (2.5d k=" << c[kT2] << " i=" << c[kT1] << " j=" << c[kT0] << ')';
      break;
    case TensorMode::k3D:
      out << " (3d i=" << c[kT0] << " j=" << c[kT1] << " k=" << c[kT2] << ')';
      break;
  }
  out << '\n';
  for (ParallelMode mode : modes()) {
    out << "  " << std::left << std::setw(17) << mode_name(mode) << std::right << " rank "
        << local_rank(mode, global_rank) << '/' << group_size(mode) << " members "
        << short_list(group_of(mode, global_rank)) << " seed 0x" << std::hex
        << seed_for(mode, global_rank, config_.seed()) << std::dec << '\n';
  }
  return out.str();
}

}  // namespace context
}  // namespace tessera
