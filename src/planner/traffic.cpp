#include "tessera/planner/traffic.h"

#include "grid_math.h"

#include "tessera/parallel/pipeline_partition.h"
#include "tessera/parallel/sharding_spec.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <set>

namespace tessera {
namespace planner {
namespace {

using comm::OpType;
using context::ParallelMode;
using context::TensorMode;
using detail::pad_to;

// Tokens of one micro-batch that one rank's layers see, and the hidden width they hold.
double tokens(const TrafficInput& in) { return in.rows * in.model.seq() / in.plan.grid.sequence(); }

}  // namespace

double bus_bytes_of(OpType op, int n, double bytes) {
  if (n <= 1) return 0;
  switch (op) {
    case OpType::kAllReduce:
      return 2.0 * (n - 1) / n * bytes;
    case OpType::kAllGather:
    case OpType::kReduceScatter:
    case OpType::kAllToAll:
      return static_cast<double>(n - 1) / n * bytes;
    case OpType::kRecv:
    case OpType::kBarrier:
      return 0;
    default:
      return bytes;
  }
}

void Traffic::add(const std::string& component, ParallelMode mode, const std::string& group, int size, OpType op,
                  double calls, double elements, double element_bytes, bool overlapped) {
  if (calls <= 0) return;
  const double bytes = calls * elements * element_bytes;
  for (Collective& c : items_) {
    if (c.component == component && c.group == group && c.op == op && c.overlapped == overlapped) {
      c.calls += calls;
      c.bytes += bytes;
      c.bus_bytes += bus_bytes_of(op, size, bytes);
      return;
    }
  }
  Collective c;
  c.component = component;
  c.mode = mode;
  c.group = group;
  c.size = size;
  c.op = op;
  c.calls = calls;
  c.bytes = bytes;
  c.bus_bytes = bus_bytes_of(op, size, bytes);
  c.overlapped = overlapped;
  items_.push_back(c);
}

double Traffic::bytes(const std::string& group, OpType op) const {
  double b = 0;
  for (const Collective& c : items_)
    if (c.group == group && c.op == op) b += c.bytes;
  return b;
}

double Traffic::total_bytes() const {
  double b = 0;
  for (const Collective& c : items_) b += c.bytes;
  return b;
}

double Traffic::total_bus_bytes() const {
  double b = 0;
  for (const Collective& c : items_) b += c.bus_bytes;
  return b;
}

std::vector<StageShape> stages_of(const ModelDesc& model, const Plan& plan, int pp_rank) {
  const int pp = plan.grid.pipeline(), stages = pp * plan.chunks;
  if (model.opaque() || pp == 1) return {StageShape{0, 0, model.opaque() ? 0 : model.layers(), true, true}};
  // The trainer's sequence: embed, blocks, head (GPTImpl::as_sequential).
  const auto bounds = parallel::partition_by_count(model.layers() + 2, stages);
  std::vector<StageShape> out;
  for (int s = pp_rank; s < stages; ++s) {
    if (plan.pipeline_rank_of(s) != pp_rank) continue;
    const int64_t lo = bounds[s], hi = bounds[s + 1];
    StageShape st;
    st.stage = s;
    st.embed = lo == 0;
    st.head = hi == model.layers() + 2;
    st.first_block = std::max<int64_t>(lo - 1, 0);
    st.blocks = std::min<int64_t>(hi - 1, model.layers()) - st.first_block;
    out.push_back(st);
  }
  return out;
}

namespace {
int64_t moe_blocks_of(const TrafficInput& in) {
  int64_t moe = 0;
  for (int64_t b = in.stage.first_block; b < in.stage.first_block + in.stage.blocks; ++b)
    moe += in.model.moe_block(b) ? 1 : 0;
  return moe;
}
}  // namespace

// Megatron's 1D layers (column_parallel_linear.cpp, row_parallel_linear.cpp,
// vocab_parallel_embedding.cpp, vocab_parallel_cross_entropy.cpp): per block
// the attention's and the MLP's output all-reduce in forward and their
// input's in backward (a MoE block has no tensor-parallel MLP: its experts'
// sums, if split, are expert_traffic's); the vocabulary embedding's forward
// sum, the LM head's input gradient and the cross entropy's three [tokens] sums.
void tensor_traffic_1d(const TrafficInput& in, Traffic& out) {
  const int tp = in.plan.grid.tensor();
  const double T = tokens(in), h = static_cast<double>(in.model.hidden());
  const std::string g = detail::mode_group(ParallelMode::kTensor);
  // A group of one skips the layers' sums but not the loss's.
  const double calls =
      tp == 1 ? 0
              : 4.0 * in.stage.blocks - 2.0 * moe_blocks_of(in) + (in.stage.embed ? 1 : 0) + (in.stage.head ? 1 : 0);
  out.add("tensor", ParallelMode::kTensor, g, tp, OpType::kAllReduce, calls, T * h, in.act_bytes);
  if (in.stage.head) out.add("tensor", ParallelMode::kTensor, g, tp, OpType::kAllReduce, 3, T, 4);
}

// SUMMA (summa.cpp) over 2d_row / 2d_col, with depth for 2.5d: each of a
// block's seven [T, h/q]-shaped products broadcasts activations along rows
// and weights along columns, twice in backward, and reduces once; LayerNorm's
// statistics over rows; the embedding's batch reshuffle along columns.
void grid_traffic(const TrafficInput& in, Traffic& out, bool deep) {
  const auto& c = in.plan.grid;
  const int q = detail::rank_grid(c).q(), d = deep ? c.tensor_depth() : 1;
  const double h = static_cast<double>(in.model.hidden());
  const double T = in.rows / (q * d) * in.model.seq() / c.sequence(), H = h / q;
  const double Vq = static_cast<double>(pad_to(in.model.vocab(), q) / q);
  const double L = static_cast<double>(in.stage.blocks);
  const bool head = in.stage.head, embed = in.stage.embed;
  // Per linear: its input broadcast along rows twice and reduced once, its
  // weight broadcast along columns twice and reduced once (summa.cpp).
  double inputs = 0, products = 0;
  for (const auto& l : in.model.block_linears()) inputs += l.in, products += static_cast<double>(l.in) * l.out;
  const double acts = L * T * inputs / q + (head ? T * Vq : 0);
  const double weights = L * products / (q * q) + (head ? Vq * H : 0);
  // Each norm's statistics (LayerNorm: mean and variance; RMSNorm: the mean
  // square), summed forward and backward.
  const double stats = in.model.rms_norm() ? 2 : 4;
  const ParallelMode row = deep ? ParallelMode::k2p5DRow : ParallelMode::k2DRow;
  const ParallelMode col = deep ? ParallelMode::k2p5DCol : ParallelMode::k2DCol;
  const double e = in.act_bytes;
  out.add("tensor", row, detail::mode_group(row), q, OpType::kBroadcast, 1, 2 * q * acts, e);
  out.add("tensor", row, detail::mode_group(row), q, OpType::kReduce, 1, q * acts, e);
  out.add("tensor", row, detail::mode_group(row), q, OpType::kAllReduce, 1,
          2 * stats * L * T + (head ? (stats + 3) * T : 0), 4);
  out.add("tensor", col, detail::mode_group(col), q, OpType::kBroadcast, 1, 2 * q * weights, e);
  out.add("tensor", col, detail::mode_group(col), q, OpType::kReduce, 1, q * weights, e);
  if (embed) {
    out.add("tensor", col, detail::mode_group(col), q, OpType::kReduceScatter, 1, q * T * H, e);
    out.add("tensor", col, detail::mode_group(col), q, OpType::kAllGather, 1, q * T * H, e);
  }
  if (head) {
    const ParallelMode xz = deep ? ParallelMode::k2p5DXZ : col;
    out.add("tensor", xz, detail::mode_group(xz), deep ? q * d : q, OpType::kAllReduce, 1, 1, 4);
  }
}

void tensor_traffic_2d(const TrafficInput& in, Traffic& out) { grid_traffic(in, out, false); }
void tensor_traffic_2p5d(const TrafficInput& in, Traffic& out) { grid_traffic(in, out, true); }

// The 3D products (matmul_3d.cpp): inputs gathered along 3d_input and
// outputs reduce-scattered along 3d_output, weights gathered along
// 3d_weight, each reversed in backward; LayerNorm statistics on 3d_output.
void tensor_traffic_3d(const TrafficInput& in, Traffic& out) {
  const auto& c = in.plan.grid;
  const int q = detail::rank_grid(c).q();
  const double h = static_cast<double>(in.model.hidden());
  const double T = in.rows / (q * q) * in.model.seq() / c.sequence();
  const double Vp = static_cast<double>(pad_to(in.model.vocab(), q));
  const double L = static_cast<double>(in.stage.blocks);
  const bool head = in.stage.head, embed = in.stage.embed;
  const double e = in.act_bytes;
  // A column-role layer gathers its input along 3d_input and scatters its
  // output along 3d_output; a row-role layer the other way round.
  double on_input = 0, on_output = 0, products = 0;
  for (const auto& l : in.model.block_linears()) {
    on_input += l.row ? l.out : l.in;
    on_output += l.row ? l.in : l.out;
    products += static_cast<double>(l.in) * l.out;
  }
  for (OpType op : {OpType::kAllGather, OpType::kReduceScatter}) {
    out.add("tensor", ParallelMode::k3DInput, detail::mode_group(ParallelMode::k3DInput), q, op, 1,
            (L * on_input + ((embed ? 1 : 0) + (head ? 1 : 0)) * h) * T, e);
    out.add("tensor", ParallelMode::k3DOutput, detail::mode_group(ParallelMode::k3DOutput), q, op, 1,
            L * T * on_output + (head ? T * Vp : 0), e);
    out.add("tensor", ParallelMode::k3DWeight, detail::mode_group(ParallelMode::k3DWeight), q, op, 1,
            (L * products + ((embed ? 1 : 0) + (head ? 1 : 0)) * Vp * h) / (q * q), e);
  }
  const double stats = in.model.rms_norm() ? 2 : 4;  // as grid_traffic's
  if (head)
    out.add("tensor", ParallelMode::k3DInput, detail::mode_group(ParallelMode::k3DInput), q, OpType::kAllReduce, 1,
            3 * T, 4);
  out.add("tensor", ParallelMode::k3DOutput, detail::mode_group(ParallelMode::k3DOutput), q, OpType::kAllReduce, 1,
          2 * stats * L * T + (head ? stats * T : 0), 4);
  if (head)
    out.add("tensor", ParallelMode::k3DOutputWeight, detail::mode_group(ParallelMode::k3DOutputWeight), q * q,
            OpType::kAllReduce, 1, 1, 4);
}

namespace {
// Per block, elements of one rank's [rows, n/p, h/tp] attention input: E.
double sequence_e(const TrafficInput& in) {
  return in.rows * (in.model.seq() / in.plan.grid.sequence()) * in.model.attention_width() / in.plan.grid.tensor();
}
void sequence_common(const TrafficInput& in, Traffic& out) {
  // The loss: this rank's summed cross entropy over the sequence group, and
  // the vocabulary-parallel cross entropy's sums on the tensor group.
  if (!in.stage.head) return;
  const int sp = in.plan.grid.sequence();
  out.add("sequence", ParallelMode::kSequence, detail::mode_group(ParallelMode::kSequence), sp, OpType::kAllReduce, 1,
          1, 4);
}
}  // namespace

// Ulysses (ulysses_attention.cpp): q, k, v to a head split and the output
// back, all-to-all; the same four in backward.
void sequence_traffic_ulysses(const TrafficInput& in, Traffic& out) {
  const int sp = in.plan.grid.sequence();
  const double E = sequence_e(in);
  out.add("sequence", ParallelMode::kSequence, detail::mode_group(ParallelMode::kSequence), sp, OpType::kAllToAll,
          8.0 * in.stage.blocks, E, in.act_bytes);
  sequence_common(in, out);
}

// Ring attention (ring_attention.cpp): keys and values go around the ring
// (p-1 hops), and in backward keys, values and their gradients; each hop is
// a send and a receive.
void sequence_traffic_ring(const TrafficInput& in, Traffic& out) {
  const int sp = in.plan.grid.sequence();
  const double E = sequence_e(in), per_block = (3.0 * sp - 2) * E;
  for (OpType op : {OpType::kSend, OpType::kRecv})
    out.add("sequence", ParallelMode::kSequence, detail::mode_group(ParallelMode::kSequence), sp, op, in.stage.blocks,
            2 * per_block, in.act_bytes);
  sequence_common(in, out);
}

// Hybrid (hybrid_attention.cpp): Ulysses' all-to-alls over the U adjacent
// ranks, then ring attention over the R = sp/U ring on heads/U heads of
// U·n tokens. That block is the same E elements, so the ring's part is the
// ring formula with R ranks in place of sp.
void sequence_traffic_hybrid(const TrafficInput& in, Traffic& out) {
  const int u = in.plan.grid.sequence_ulysses(), r = in.plan.grid.sequence() / u;
  const double E = sequence_e(in), per_block = (3.0 * r - 2) * E;
  out.add("sequence", ParallelMode::kSequenceUlysses, detail::mode_group(ParallelMode::kSequenceUlysses), u,
          OpType::kAllToAll, 8.0 * in.stage.blocks, E, in.act_bytes);
  for (OpType op : {OpType::kSend, OpType::kRecv})
    out.add("sequence", ParallelMode::kSequenceRing, detail::mode_group(ParallelMode::kSequenceRing), r, op,
            in.stage.blocks, 2 * per_block, in.act_bytes);
  sequence_common(in, out);
}

// Ring self-attention (ring_self_attention.cpp): keys, then values around
// the ring in forward; in backward the scores' and values' gradients; each
// hop is a send and a receive.
void sequence_traffic_rsa(const TrafficInput& in, Traffic& out) {
  const int sp = in.plan.grid.sequence();
  const double E = sequence_e(in), per_block = (6.0 * sp - 4) * E;
  for (OpType op : {OpType::kSend, OpType::kRecv})
    out.add("sequence", ParallelMode::kSequence, detail::mode_group(ParallelMode::kSequence), sp, op, in.stage.blocks,
            per_block, in.act_bytes);
  sequence_common(in, out);
}

// Dropless MoE (moe.cpp): per MoE block the routed rows go to their experts
// and back, in forward and in backward (4 all-to-alls of tokens · top_k
// rows: exact for what a rank sends first, the mean over the expert group
// for what comes back), after an exchange of the counts per expert (int64);
// and the routing statistics (2·experts + 3 doubles) summed over the ranks
// that split the tokens.
void expert_traffic(const TrafficInput& in, Traffic& out) {
  const auto& c = in.plan.grid;
  const int64_t moe = moe_blocks_of(in);
  if (moe == 0) return;
  const ParallelMode tokens_mode = detail::rank_grid(c).token_mode();
  const int token_ranks = c.data() * c.sequence();
  if (token_ranks > 1)
    out.add("expert", tokens_mode, detail::mode_group(tokens_mode), token_ranks, OpType::kAllReduce,
            static_cast<double>(moe), 2.0 * in.model.experts() + 3, 8);
  const double rows = tokens(in) * in.model.top_k();
  // Expert tensor parallelism (Note [Expert tensor parallelism]): the rows
  // a rank's experts ran summed over the tensor group forward (their mean:
  // what a rank sends, dropless), the tokens' gradient backward.
  if (in.plan.expert_tensor_parallel && c.tensor() > 1) {
    const std::string t = detail::mode_group(ParallelMode::kTensor);
    for (double n : {rows, tokens(in)})
      out.add("expert", ParallelMode::kTensor, t, c.tensor(), OpType::kAllReduce, static_cast<double>(moe),
              n * in.model.hidden(), in.act_bytes);
  }
  const int ep = c.expert();
  if (ep == 1) return;
  const std::string g = detail::mode_group(ParallelMode::kExpert);
  out.add("expert", ParallelMode::kExpert, g, ep, OpType::kAllToAll, 4.0 * moe, rows * in.model.hidden(),
          in.act_bytes);
  out.add("expert", ParallelMode::kExpert, g, ep, OpType::kAllToAll, static_cast<double>(moe),
          static_cast<double>(in.model.experts()), 8);
}

TrafficFn tensor_traffic(TensorMode mode) {
  switch (mode) {
    case TensorMode::k1D:
      return &tensor_traffic_1d;
    case TensorMode::k2D:
      return &tensor_traffic_2d;
    case TensorMode::k2p5D:
      return &tensor_traffic_2p5d;
    case TensorMode::k3D:
      return &tensor_traffic_3d;
  }
  TORCH_INTERNAL_ASSERT(false, "tensor mode without a traffic function");
}

TrafficFn sequence_traffic(context::SequenceMode mode) {
  switch (mode) {
    case context::SequenceMode::kUlysses:
      return &sequence_traffic_ulysses;
    case context::SequenceMode::kRing:
      return &sequence_traffic_ring;
    case context::SequenceMode::kRsa:
      return &sequence_traffic_rsa;
    case context::SequenceMode::kHybrid:
      return &sequence_traffic_hybrid;
  }
  TORCH_INTERNAL_ASSERT(false, "sequence mode without a traffic function");
}

}  // namespace planner
}  // namespace tessera
