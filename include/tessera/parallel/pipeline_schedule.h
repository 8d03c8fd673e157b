#pragma once
// Pipeline schedules as data: for each pipeline rank, the list of actions it
// runs in one training step. Generators build GPipe, 1F1B, interleaved 1F1B
// and zero-bubble H1 and H2 (Qi et al. 2023); the executor (pipeline_executor.h) runs any schedule
// and the simulator (pipeline_simulator.h) checks any schedule; ZB-V and
// DualPipeV place each rank's two chunks in a V. See docs/pipeline.md.
//
// Note [Pipeline stages and messages]
// A model cut into S = pp · v stages puts stage s on pipeline rank s % pp as
// its local chunk s / pp (Megatron's interleaved layout; v = 1 is the plain
// pipeline). The V layout of ZB-V and DualPipeV instead puts stage s < pp on rank s and stage
// s >= pp on rank 2pp - 1 - s: rank r holds stages r and 2pp - 1 - r, so
// rank 0 holds the first and the last, and rank pp - 1 hands its chunk 0's
// output to its own chunk 1 without a message. Every action names a
// micro-batch and the stage it runs for on its own rank:
//   F  forward of the stage              B  backward (input and weight parts)
//   I  backward, input gradient only     W  backward, weight gradient only
//   SA send the stage's output to s + 1   RA receive the stage's input from s - 1
//   SG send the gradient of the stage's input to s - 1
//   RG receive the gradient of the stage's output from s + 1
// so SA(mb, s) is matched by RA(mb, s + 1) and SG(mb, s) by RG(mb, s - 1).
// A forward marked `paired` and the backward right after it are one F&B
// block (DualPipeV, Note [DualPipeV order]): both receives come before the
// forward and both sends after the backward, so the pair exchanges its
// messages at two points instead of four.
// Sends do not block (they complete by the end of the step); a receive
// blocks until its message has arrived. A schedule is valid when, run that
// way, every rank reaches its end: the simulator checks exactly that.
#include <string>
#include <vector>

namespace tessera {
namespace parallel {

enum class ActionKind : unsigned char {
  kForward,
  kBackward,
  kBackwardInput,
  kBackwardWeight,
  kSendActivation,
  kRecvActivation,
  kSendGrad,
  kRecvGrad,
};

struct Action {
  ActionKind kind;
  int microbatch;
  int stage;
  // A forward that forms an F&B block with the backward after it.
  bool paired = false;

  bool is_compute() const { return kind <= ActionKind::kBackwardWeight; }
  // "F3@1": kind, micro-batch, stage; "F3@1&" for a paired forward.
  std::string to_string() const;
  bool operator==(const Action& o) const {
    return kind == o.kind && microbatch == o.microbatch && stage == o.stage && paired == o.paired;
  }
};

enum class ScheduleKind {
  kGPipe,
  k1F1B,
  kInterleaved1F1B,
  kZeroBubbleH1,
  kZeroBubbleH2,
  kZeroBubbleV,
  kDualPipeV,
};

// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"
// (also "interleaved-1f1b", "zbh1", "zbh2", "zbv", "dualpipe-v").
ScheduleKind parse_schedule_kind(const std::string& text);
std::string to_string(ScheduleKind kind);
// zb-v and dualpipev: two chunks per rank in a V (Note [Pipeline stages and messages]).
bool runs_in_a_v(ScheduleKind kind);

struct Schedule {
  std::string name;
  int pp = 1;      // pipeline ranks
  int chunks = 1;  // stages per rank (virtual stages)
  int microbatches = 1;
  // Forwards only (evaluation): no backward actions, no gradient messages.
  bool forward_only = false;
  // The V layout of zb-v and dualpipev (two chunks per rank; Note [Pipeline
  // stages and messages]).
  bool v_shape = false;
  std::vector<std::vector<Action>> ranks;  // [pp][actions in order]

  int stages() const { return pp * chunks; }
  int rank_of(int stage) const { return v_shape && stage >= pp ? 2 * pp - 1 - stage : stage % pp; }
  int chunk_of(int stage) const { return stage / pp; }
  // The stage of rank `rank`'s chunk `chunk`.
  int stage_of(int rank, int chunk) const { return v_shape && chunk == 1 ? 2 * pp - 1 - rank : chunk * pp + rank; }
  // One line per rank, compute actions only unless `communication`.
  std::string to_string(bool communication = false) const;
};

// The schedule of `kind` for pp ranks, m micro-batches and `chunks` stages
// per rank (interleaved: 2 or more; zb-v and dualpipev: 2, in a V; the
// others take 1). Any m >= 1 is accepted, except that dualpipev needs
// m >= 2 pp; with m < pp the pipeline never fills (the simulator reports
// the bubble).
// Communication actions are included (insert_communication).
Schedule make_schedule(ScheduleKind kind, int pp, int microbatches, int chunks = 1);

// Forwards only, for evaluation: the forwards in the order of 1F1B
// (interleaved 1F1B with chunks > 1), each receive right before its forward and
// each send right after; no activation is kept past its send. `v_shape`
// places the stages in a V, as zb-v and dualpipev do (chunks 2).
Schedule make_forward_schedule(int pp, int microbatches, int chunks = 1, bool v_shape = false);

// Adds, around the compute actions of `compute_order` (one list per rank),
// the receive right before the action that needs it and the send right after
// the action that produces it (an F&B block's before and after the block);
// then align_receives.
Schedule insert_communication(Schedule compute_order);

// Moves receives earlier so that every rank receives the messages of each
// sender in the order that sender sends them (Note [Pipeline message
// batches]: there are no tags). A message that arrives before its action
// waits in the executor's mailbox. Interleaved 1F1B needs it: a rank sends
// the next rank both activations (its later chunk) and gradients (its
// earlier chunk's partner), in an order the receiver's compute does not
// follow.
Schedule align_receives(Schedule schedule);

}  // namespace parallel
}  // namespace tessera
