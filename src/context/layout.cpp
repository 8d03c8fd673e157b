#include "tessera/context/layout.h"

#include "tessera/context/rank_grid.h"

#include <c10/util/Exception.h>

#include <string>

namespace tessera {
namespace context {
namespace {

bool grid_mode(const ParallelConfig& c) { return c.tensor() > 1 && c.tensor_mode() != TensorMode::k1D; }

void check_divides(int64_t value, int64_t unit, const char* what, const std::string& rule) {
  TORCH_CHECK(value % unit == 0, what, " ", value, " is not divisible by ", unit, ", which ", rule);
}

}  // namespace

void check_supported(const Layout& layout) {
  const ParallelConfig& c = layout.grid();
  const bool grid = grid_mode(c), sp = layout.sequence_parallel();
  const std::string mode = tensor_mode_name(c.tensor_mode());
  TORCH_CHECK(!layout.row_keyed_dropout() || (!grid && !sp && c.sequence() == 1),
              "row-keyed dropout (Note [Row-keyed dropout]) runs on tensor mode 1d without sequence parallelism, "
              "whose block activations hold whole samples; the context has tensor mode ",
              mode, ", sequence size ", c.sequence(), sp ? " and the sequence-parallel variant" : "",
              "; use tensor mode 1d and sequence size 1");
  TORCH_CHECK(!grid || !sp, "the sequence-parallel variant belongs to tensor mode 1d; tensor mode ", mode,
              " already splits every activation over the grid");
  TORCH_CHECK(c.sequence() == 1 || !grid, "sequence size ", c.sequence(), " (mode ",
              sequence_mode_name(c.sequence_mode()), ") runs on tensor mode 1d, but tensor mode ", mode,
              " is configured; use tensor mode 1d with sequence parallelism, or sequence size 1");
  TORCH_CHECK(c.sequence() == 1 || !sp, "sequence size ", c.sequence(),
              " and the 1D layers' sequence-parallel variant both split the sequence; use one of them");
  TORCH_CHECK(c.expert() == 1 || !grid, "expert size ", c.expert(), " runs on tensor mode 1d, but tensor mode ", mode,
              " is configured; use tensor mode 1d with experts, or expert size 1");
  TORCH_CHECK(c.expert() == 1 || !sp, "expert size ", c.expert(),
              " and the 1D layers' sequence-parallel variant do not combine (each tensor rank would route other "
              "tokens); use sequence parallelism (sequence size > 1) instead of the variant, or expert size 1");
  TORCH_CHECK(!layout.expert_tensor_parallel() || (!grid && !sp),
              "expert tensor parallelism splits the experts over the 1D tensor group, whose ranks must hold the same "
              "tokens; the context has tensor mode ",
              mode, sp ? " with the sequence-parallel variant" : "",
              "; use tensor mode 1d without the variant, or whole experts");
}

bool kv_heads_replicated(int64_t kv_heads, int64_t split, bool can_replicate, const std::string& mode) {
  if (kv_heads % split == 0) return false;
  TORCH_CHECK(can_replicate && split % kv_heads == 0, "the ", kv_heads,
              " key/value heads can neither be split over the ", split, " head blocks of ", mode,
              " nor replicated on them (",
              can_replicate ? "the tensor size must be a multiple of them" : "only tensor mode 1d replicates kv heads",
              "); choose kv heads divisible by ", split, can_replicate ? " or a tensor size that they divide" : "");
  return true;
}

void check_shape(const Layout& layout, const ModelShape& shape) {
  check_supported(layout);
  const ParallelConfig& c = layout.grid();
  // The grid's arithmetic (q, batch blocks) depends on the tensor sizes only:
  // an unresolved data size (0) is read as the smallest the expert size allows.
  ParallelConfig sized = c;
  if (sized.data() == 0) sized.data(c.expert());
  const RankGrid g(sized, sized.data() * c.pipeline() * c.tensor() * c.sequence());
  const std::string mode = "tensor mode " + tensor_mode_name(c.tensor_mode()) + " at tensor size " +
                           std::to_string(c.tensor());
  const int64_t q = g.q();
  if (shape.heads() > 0) check_divides(shape.heads(), q, "the number of attention heads", mode + " splits heads over");
  if (shape.kv_heads() > 0) kv_heads_replicated(shape.kv_heads(), q, !grid_mode(c), mode);
  if (c.tensor_mode() == TensorMode::k3D && c.tensor() > 1) {
    if (shape.hidden() > 0) check_divides(shape.hidden(), q * q, "the hidden size", mode + " splits inputs over (q²)");
    if (shape.ffn() > 0) check_divides(shape.ffn(), q * q, "the MLP width", mode + " splits inputs over (q²)");
  } else {
    if (shape.hidden() > 0) check_divides(shape.hidden(), q, "the hidden size", mode + " splits over");
    if (shape.ffn() > 0) check_divides(shape.ffn(), q, "the MLP width", mode + " splits over");
  }
  if (shape.rows() > 0 && g.batch_blocks() > 1)
    TORCH_CHECK(shape.rows() % g.batch_blocks() == 0, "the batch size ", shape.rows(),
                " (rows per micro-batch and replica) is not divisible by ",
                c.tensor_mode() == TensorMode::k3D ? "q*q" : "q*depth", " = ", g.batch_blocks(), ", the batch blocks of ",
                mode, "; choose a batch (or micro-batch) size divisible by it");
  if (shape.seq() > 0) {
    if (layout.sequence_parallel()) check_divides(shape.seq(), c.tensor(), "the sequence length",
                                                  "the sequence-parallel variant splits over the tensor size");
    const int64_t chunks = c.sequence() * (c.sequence_split() == SequenceSplit::kZigzag ? 2 : 1);
    if (c.sequence() > 1)
      check_divides(shape.seq(), chunks, "the sequence length",
                    "sequence size " + std::to_string(c.sequence()) + " (split " +
                        sequence_split_name(c.sequence_split()) + ") cuts it into (its chunks)");
  }
  if (shape.heads() > 0 && c.sequence() > 1 && c.sequence_mode() == SequenceMode::kUlysses)
    check_divides(shape.heads() / q, c.sequence(), "the heads per tensor rank",
                  "Ulysses attention splits over the sequence size");
  if (shape.heads() > 0 && c.sequence() > 1 && c.sequence_mode() == SequenceMode::kHybrid)
    check_divides(shape.heads() / q, c.sequence_ulysses(), "the heads per tensor rank",
                  "hybrid sequence parallelism's Ulysses groups split over (sequence ulysses size)");
  TORCH_CHECK(shape.experts() > 0 || !layout.expert_tensor_parallel(),
              "expert tensor parallelism splits the experts, and this model has no mixture-of-experts blocks; drop "
              "it or give the model experts");
  TORCH_CHECK(shape.experts() > 0 || c.expert() == 1, "expert size ", c.expert(),
              " needs a model with experts, and this one has no mixture-of-experts blocks; set expert size 1 or give "
              "the model experts");
  if (shape.experts() > 0) {
    TORCH_CHECK(!grid_mode(c), "mixture-of-experts layers run on tensor mode 1d (with or without sequence "
                "parallelism), not on ", mode, "; use tensor mode 1d, or a dense model (experts 0)");
    TORCH_CHECK(!layout.sequence_parallel(), "mixture-of-experts layers do not run in the 1D sequence-parallel "
                "variant; use sequence parallelism (sequence size > 1) instead, or a dense model");
    check_divides(shape.experts(), c.expert(), "the number of experts", "the expert size splits them over");
  }
}

}  // namespace context
}  // namespace tessera
