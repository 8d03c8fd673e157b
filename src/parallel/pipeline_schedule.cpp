#include "tessera/parallel/pipeline_schedule.h"

#include "v_schedules.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <deque>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace tessera {
namespace parallel {

namespace {

const char* short_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackward:
      return "B";
    case ActionKind::kBackwardInput:
      return "I";
    case ActionKind::kBackwardWeight:
      return "W";
    case ActionKind::kSendActivation:
      return "SA";
    case ActionKind::kRecvActivation:
      return "RA";
    case ActionKind::kSendGrad:
      return "SG";
    case ActionKind::kRecvGrad:
      return "RG";
  }
  return "?";
}

// Note [Generating schedules]
// Each generator is a list scheduler run on uniform costs (F = 1, I = W = 1,
// B = 2): every rank has an order of forwards and an order of backwards, and
// at each moment the rank whose next action can start earliest runs the
// action its policy prefers among those whose inputs have arrived:
//   GPipe        all forwards, then the backwards;
//   1F1B         backward first; at most min(pp - r, m) forwards in flight;
//   interleaved  the same with Megatron's orders (micro-batches in groups of
//                pp, chunk by chunk) and its warm-up 2(pp - r - 1) + (v - 1)pp;
//   ZB-H1        1F1B's order of F and I (B split into I and W, at most
//                pp - r micro-batches between F and I), and W only when
//                nothing else is ready or when rank r would otherwise hold
//                more than pp micro-batches between F and W: every rank
//                holds at most 1F1B's peak (rank 0's pp), the last ranks
//                defer up to pp W's into the cool-down, and with
//                F = I = W the bubble is the published (pp - 1)/(3m + pp - 1);
//   ZB-H2        the same with 2(pp - r) - 1 micro-batches between F and I
//                and 2pp - 1 held: the warm-up fills the wait for the first
//                gradient and the W's fill the cool-down, so for
//                m >= 2pp - 1 every rank works without a gap from its first
//                action to its last (the published parallelogram). In one
//                synchronous step the last rank still starts pp - 1 late,
//                so the bubble of the step equals ZB-H1's; the gain is that
//                rank 0 finishes pp - 1 earlier (docs/pipeline.md);
//   ZB-V         two chunks per rank in a V (stages r and 2pp - 1 - r),
//                ZB-H's split backward, forwards in groups of pp
//                micro-batches chunk by chunk, backwards chunk 1 then
//                chunk 0, and at most 2pp chunks held per rank: 1F1B's
//                activation memory (pp micro-batches of a whole stage).
//                A chunk is half a stage, so the last rank starts
//                (pp - 1)/2 stage-times late instead of pp - 1, and with
//                F = I = W no rank idles between its first and last
//                action: the step's bubble is (pp - 1)/(6m + pp - 1).
// Because an action is only placed once what it needs has run, the orders
// are deadlock-free by construction for any m, also where the closed-form
// schedules assume pp divides m. If the in-flight limits ever leave no rank
// able to move, the limits are raised by one and the run continues.
// (micro-batch, chunk) in the order a rank runs its forwards: chunk by chunk
// in groups of pp micro-batches (Megatron's interleaved order; micro-batch
// order when v = 1).
std::vector<std::pair<int, int>> forward_order(int pp, int m, int v) {
  std::vector<std::pair<int, int>> out;
  for (int g = 0; g * pp < m; ++g)
    for (int c = 0; c < v; ++c)
      for (int mb = g * pp; mb < std::min(m, (g + 1) * pp); ++mb) out.emplace_back(mb, c);
  return out;
}

class Generator {
 public:
  Generator(ScheduleKind kind, int pp, int m, int v)
      : kind_(kind), pp_(pp), m_(m), v_(v), stages_(pp * v), v_shape_(kind == ScheduleKind::kZeroBubbleV) {
    fwd_done_.assign(stages_, std::vector<double>(m_, kUnknown));
    bwd_done_.assign(stages_, std::vector<double>(m_, kUnknown));
    ranks_.resize(pp_);
    for (int r = 0; r < pp_; ++r) init_rank(r);
  }

  Schedule run() {
    Schedule s;
    s.name = to_string(kind_);
    s.pp = pp_;
    s.chunks = v_;
    s.microbatches = m_;
    s.v_shape = v_shape_;
    s.ranks.resize(pp_);
    while (true) {
      int best_rank = -1;
      double best_start = std::numeric_limits<double>::infinity();
      Action best{};
      bool work_left = false;
      for (int r = 0; r < pp_; ++r) {
        RankState& st = ranks_[r];
        if (st.finished()) continue;
        work_left = true;
        Action a{};
        double start = 0;
        if (choose(r, &a, &start) && start < best_start) {
          best_start = start;
          best_rank = r;
          best = a;
        }
      }
      if (!work_left) break;
      if (best_rank < 0) {
        relax_limits();
        continue;
      }
      execute(best_rank, best, best_start);
      s.ranks[best_rank].push_back(best);
    }
    return s;
  }

 private:
  static constexpr double kUnknown = -1.0;

  struct RankState {
    std::vector<std::pair<int, int>> forwards, backwards;  // (micro-batch, chunk) in order
    size_t next_f = 0, next_b = 0;
    std::array<int, 2> v_next_f{0, 0}, v_next_b{0, 0};  // ZB-V: the next micro-batch of each chunk
    std::deque<std::pair<int, int>> pending_w;
    int inflight = 0, limit = 0;  // forwards whose B (or I) has not run
    int held = 0;                 // forwards whose B (or W) has not run
    int hold_limit = std::numeric_limits<int>::max();
    double free_at = 0;
    bool finished() const { return next_f == forwards.size() && next_b == backwards.size() && pending_w.empty(); }
  };

  void init_rank(int r) {
    RankState& st = ranks_[r];
    if (kind_ == ScheduleKind::kInterleaved1F1B || v_shape_) {
      st.forwards = forward_order(pp_, m_, v_);
      for (int g = 0; g * pp_ < m_; ++g) {
        const int end = std::min(m_, (g + 1) * pp_);
        for (int c = v_ - 1; c >= 0; --c)
          for (int mb = g * pp_; mb < end; ++mb) st.backwards.emplace_back(mb, c);
      }
      st.limit = std::min(m_ * v_, 2 * (pp_ - r - 1) + (v_ - 1) * pp_ + 1);
      if (v_shape_) st.limit = st.hold_limit = std::min(m_ * v_, 2 * pp_);
    } else {
      for (int mb = 0; mb < m_; ++mb) {
        st.forwards.emplace_back(mb, 0);
        st.backwards.emplace_back(mb, 0);
      }
      switch (kind_) {
        case ScheduleKind::kGPipe:
          st.limit = m_;
          break;
        case ScheduleKind::kZeroBubbleH1:
          st.limit = std::min(m_, pp_ - r);
          st.hold_limit = std::min(m_, pp_);
          break;
        case ScheduleKind::kZeroBubbleH2:
          st.limit = std::min(m_, 2 * (pp_ - r) - 1);
          st.hold_limit = std::min(m_, 2 * pp_ - 1);
          break;
        default:
          st.limit = std::min(m_, pp_ - r);
      }
    }
  }

  struct Candidate {
    Action action;
    double ready;
    int priority;  // lower is preferred
  };

  int stage(int r, int chunk) const { return v_shape_ && chunk == 1 ? 2 * pp_ - 1 - r : chunk * pp_ + r; }

  // The action rank r prefers and when it can start; false if none can be
  // placed yet (inputs not produced, or the in-flight limit reached).
  bool choose(int r, Action* out, double* start) {
    RankState& st = ranks_[r];
    const bool split = kind_ == ScheduleKind::kZeroBubbleH1 || kind_ == ScheduleKind::kZeroBubbleH2 || v_shape_;
    std::vector<Candidate> cands;
    if (v_shape_) {
      v_candidates(r, &cands);
    } else if (st.next_f < st.forwards.size() && st.inflight < st.limit && st.held < st.hold_limit) {
      const auto [mb, c] = st.forwards[st.next_f];
      const int s = stage(r, c);
      const double ready = s == 0 ? 0.0 : fwd_done_[s - 1][mb];
      // 1F1B and ZB-H1 prefer the backward; GPipe and interleaved (whose
      // steady state is Megatron's "one forward, then one backward") the forward.
      const bool forward_first = kind_ == ScheduleKind::kGPipe || kind_ == ScheduleKind::kInterleaved1F1B;
      if (ready != kUnknown) cands.push_back({{ActionKind::kForward, mb, s}, ready, forward_first ? 0 : 1});
    }
    const bool backward_allowed = kind_ != ScheduleKind::kGPipe || st.next_f == st.forwards.size();
    if (!v_shape_ && st.next_b < st.backwards.size() && backward_allowed) {
      const auto [mb, c] = st.backwards[st.next_b];
      const int s = stage(r, c);
      const double own = fwd_done_[s][mb];
      const double ready = s == stages_ - 1 ? own : (own == kUnknown ? kUnknown : bwd_done_[s + 1][mb]);
      if (ready != kUnknown) {
        cands.push_back({{split ? ActionKind::kBackwardInput : ActionKind::kBackward, mb, s},
                         std::max(ready, own),
                         kind_ == ScheduleKind::kGPipe || kind_ == ScheduleKind::kInterleaved1F1B ? 1 : 0});
      }
    }
    if (!st.pending_w.empty()) {
      const auto [mb, s] = st.pending_w.front();
      const bool forced = st.held >= st.hold_limit && st.next_f < st.forwards.size();
      cands.push_back({{ActionKind::kBackwardWeight, mb, s}, 0.0, forced ? -1 : 3});
    }
    if (cands.empty()) return false;
    double earliest = std::numeric_limits<double>::infinity();
    for (const auto& c : cands) earliest = std::min(earliest, std::max(st.free_at, c.ready));
    const Candidate* pick = nullptr;
    for (const auto& c : cands) {
      if (std::max(st.free_at, c.ready) > earliest) continue;
      if (pick == nullptr || c.priority < pick->priority) pick = &c;
    }
    *out = pick->action;
    *start = earliest;
    return true;
  }

  // ZB-V: either chunk's next forward or input backward, whichever can
  // start first; input backwards before forwards, chunk 1's forward (nearer
  // the loss) before chunk 0's, and W's last unless the memory limit forces one.
  void v_candidates(int r, std::vector<Candidate>* cands) const {
    const RankState& st = ranks_[r];
    for (int c : {1, 0}) {
      const int mb = st.v_next_f[c], s = stage(r, c);
      if (mb >= m_ || st.inflight >= st.limit || st.held >= st.hold_limit) continue;
      const double ready = s == 0 ? 0.0 : fwd_done_[s - 1][mb];
      if (ready != kUnknown) cands->push_back({{ActionKind::kForward, mb, s}, ready, c == 1 ? 1 : 2});
    }
    for (int c : {0, 1}) {
      const int mb = st.v_next_b[c], s = stage(r, c);
      if (mb >= m_) continue;
      const double own = fwd_done_[s][mb];
      const double ready = s == stages_ - 1 ? own : (own == kUnknown ? kUnknown : bwd_done_[s + 1][mb]);
      if (ready != kUnknown) cands->push_back({{ActionKind::kBackwardInput, mb, s}, std::max(ready, own), 0});
    }
  }

  void execute(int r, const Action& a, double start) {
    RankState& st = ranks_[r];
    double cost = 1.0;
    if (v_shape_ && a.kind == ActionKind::kForward) ++st.v_next_f[a.stage < pp_ ? 0 : 1];
    if (v_shape_ && a.kind == ActionKind::kBackwardInput) ++st.v_next_b[a.stage < pp_ ? 0 : 1];
    switch (a.kind) {
      case ActionKind::kForward:
        ++st.next_f;
        ++st.inflight;
        ++st.held;
        fwd_done_[a.stage][a.microbatch] = start + cost;
        break;
      case ActionKind::kBackward:
        cost = 2.0;
        [[fallthrough]];
      case ActionKind::kBackwardInput:
        ++st.next_b;
        --st.inflight;
        bwd_done_[a.stage][a.microbatch] = start + cost;
        if (a.kind == ActionKind::kBackwardInput) st.pending_w.emplace_back(a.microbatch, a.stage);
        break;
      case ActionKind::kBackwardWeight:
        st.pending_w.pop_front();
        --st.held;
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "generator placed a communication action");
    }
    st.free_at = start + cost;
  }

  void relax_limits() {
    bool raised = false;
    for (auto& st : ranks_) {
      if (st.next_f < st.forwards.size() && st.inflight >= st.limit) {
        ++st.limit;
        raised = true;
      }
      if (st.next_f < st.forwards.size() && st.held >= st.hold_limit) {
        ++st.hold_limit;
        raised = true;
      }
    }
    TORCH_INTERNAL_ASSERT(raised, "pipeline schedule generator is stuck with no in-flight limit to raise");
  }

  ScheduleKind kind_;
  int pp_, m_, v_, stages_;
  bool v_shape_;
  std::vector<std::vector<double>> fwd_done_, bwd_done_;  // [stage][micro-batch] completion time
  std::vector<RankState> ranks_;
};

}  // namespace

std::string Action::to_string() const {
  return std::string(short_name(kind)) + std::to_string(microbatch) + "@" + std::to_string(stage) + (paired ? "&" : "");
}

ScheduleKind parse_schedule_kind(const std::string& text) {
  std::string t;
  for (char c : text) t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "gpipe") return ScheduleKind::kGPipe;
  if (t == "1f1b") return ScheduleKind::k1F1B;
  if (t == "interleaved" || t == "interleaved-1f1b" || t == "interleaved1f1b") return ScheduleKind::kInterleaved1F1B;
  if (t == "zb-h1" || t == "zbh1") return ScheduleKind::kZeroBubbleH1;
  if (t == "zb-h2" || t == "zbh2") return ScheduleKind::kZeroBubbleH2;
  if (t == "zb-v" || t == "zbv") return ScheduleKind::kZeroBubbleV;
  if (t == "dualpipev" || t == "dualpipe-v") return ScheduleKind::kDualPipeV;
  TORCH_CHECK(false, "unknown pipeline schedule '", text,
              "'; schedules: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipev");
}

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved";
    case ScheduleKind::kZeroBubbleH1:
      return "zb-h1";
    case ScheduleKind::kZeroBubbleH2:
      return "zb-h2";
    case ScheduleKind::kZeroBubbleV:
      return "zb-v";
    case ScheduleKind::kDualPipeV:
      return "dualpipev";
  }
  return "?";
}

bool runs_in_a_v(ScheduleKind kind) { return kind == ScheduleKind::kZeroBubbleV || kind == ScheduleKind::kDualPipeV; }

std::string Schedule::to_string(bool communication) const {
  std::ostringstream os;
  for (int r = 0; r < pp; ++r) {
    os << "rank " << r << ":";
    for (const Action& a : ranks[r])
      if (communication || a.is_compute()) os << " " << a.to_string();
    os << "\n";
  }
  return os.str();
}

Schedule make_schedule(ScheduleKind kind, int pp, int microbatches, int chunks) {
  const std::string name = to_string(kind);
  TORCH_CHECK(pp >= 1, "pipeline schedule ", name, ": the pipeline size must be >= 1, got ", pp);
  TORCH_CHECK(microbatches >= 1, "pipeline schedule ", name, ": the number of micro-batches must be >= 1, got ",
              microbatches);
  if (kind == ScheduleKind::kInterleaved1F1B) {
    TORCH_CHECK(chunks >= 2, "pipeline schedule interleaved needs chunks (stages per rank) >= 2, got ", chunks,
                "; with one chunk per rank use 1f1b");
  } else if (runs_in_a_v(kind)) {
    TORCH_CHECK(chunks == 2, "pipeline schedule ", name,
                " runs two chunks (stages) per rank in a V, got chunks = ", chunks, "; set chunks 2");
  } else {
    TORCH_CHECK(chunks == 1, "pipeline schedule ", name, " runs one chunk per rank, got chunks = ", chunks,
                "; use the interleaved schedule for virtual stages");
  }
  TORCH_CHECK(kind != ScheduleKind::kDualPipeV || microbatches >= 2 * pp, "pipeline schedule dualpipev needs at least ",
              2 * pp, " micro-batches (2 per pipeline rank) for pp ", pp, ", got ", microbatches,
              "; use more micro-batches or zb-v, which runs any number");
  if ((kind == ScheduleKind::kZeroBubbleV && microbatches >= 2 * pp - 1) || kind == ScheduleKind::kDualPipeV) {
    Schedule s;
    s.name = name;
    s.pp = pp;
    s.chunks = 2;
    s.microbatches = microbatches;
    s.v_shape = true;
    s.ranks = kind == ScheduleKind::kDualPipeV ? detail::dualpipev_order(pp, microbatches)
                                               : detail::zero_bubble_v_order(pp, microbatches);
    return insert_communication(std::move(s));
  }
  return insert_communication(Generator(kind, pp, microbatches, chunks).run());
}

Schedule make_forward_schedule(int pp, int microbatches, int chunks, bool v_shape) {
  TORCH_CHECK(pp >= 1, "forward-only pipeline schedule: the pipeline size must be >= 1, got ", pp);
  TORCH_CHECK(microbatches >= 1, "forward-only pipeline schedule: the number of micro-batches must be >= 1, got ",
              microbatches);
  TORCH_CHECK(chunks >= 1, "forward-only pipeline schedule: chunks (stages per rank) must be >= 1, got ", chunks);
  TORCH_CHECK(!v_shape || chunks == 2, "forward-only pipeline schedule: the V layout has two chunks per rank, got ",
              chunks);
  // A training schedule's forward order with the backwards left out: fewer
  // waits, so still deadlock-free.
  Schedule s;
  s.name = "forward-only";
  s.pp = pp;
  s.chunks = chunks;
  s.microbatches = microbatches;
  s.forward_only = true;
  s.v_shape = v_shape;
  s.ranks.resize(pp);
  for (int r = 0; r < pp; ++r)
    for (const auto& [mb, c] : forward_order(pp, microbatches, chunks))
      s.ranks[r].push_back({ActionKind::kForward, mb, s.stage_of(r, c)});
  return insert_communication(std::move(s));
}

Schedule insert_communication(Schedule s) {
  const int last = s.stages() - 1;
  auto is_backward = [](const Action& a) {
    return a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput;
  };
  auto receive = [&](const Action& a, std::vector<Action>& out) {
    if (a.kind == ActionKind::kForward && a.stage > 0)
      out.push_back({ActionKind::kRecvActivation, a.microbatch, a.stage});
    if (is_backward(a) && a.stage < last) out.push_back({ActionKind::kRecvGrad, a.microbatch, a.stage});
  };
  auto send = [&](const Action& a, std::vector<Action>& out) {
    if (a.kind == ActionKind::kForward && a.stage < last)
      out.push_back({ActionKind::kSendActivation, a.microbatch, a.stage});
    if (is_backward(a) && a.stage > 0) out.push_back({ActionKind::kSendGrad, a.microbatch, a.stage});
  };
  for (auto& actions : s.ranks) {
    std::vector<Action> compute;
    for (const Action& a : actions)
      if (a.is_compute()) compute.push_back(a);  // messages are regenerated below
    std::vector<Action> out;
    out.reserve(compute.size() * 3);
    for (size_t i = 0; i < compute.size(); ++i) {
      const Action& a = compute[i];
      if (a.paired) {
        // An F&B block: both receives, both computes, both sends.
        TORCH_CHECK(a.kind == ActionKind::kForward && i + 1 < compute.size() && is_backward(compute[i + 1]),
                    "pipeline schedule ", s.name, ": ", a.to_string(),
                    " is paired, and only a forward followed by a backward (B or I) forms an F&B block");
        const Action& b = compute[++i];
        receive(a, out), receive(b, out);
        out.push_back(a), out.push_back(b);
        send(a, out), send(b, out);
        continue;
      }
      receive(a, out);
      out.push_back(a);
      send(a, out);
    }
    actions = std::move(out);
  }
  return align_receives(std::move(s));
}

Schedule align_receives(Schedule s) {
  // A remote message as (activation, micro-batch, receiving stage), in each sender's order per receiver.
  using Id = std::tuple<bool, int, int>;
  std::map<std::pair<int, int>, std::vector<Id>> order;  // (from, to) -> messages in send order
  for (int q = 0; q < s.pp; ++q) {
    for (const Action& a : s.ranks[q]) {
      const bool act = a.kind == ActionKind::kSendActivation;
      if (!act && a.kind != ActionKind::kSendGrad) continue;
      const int to = act ? a.stage + 1 : a.stage - 1;
      if (s.rank_of(to) != q) order[{q, s.rank_of(to)}].emplace_back(act, a.microbatch, to);
    }
  }
  for (int r = 0; r < s.pp; ++r) {
    std::vector<Action> out;
    std::map<int, size_t> next;  // sender -> messages from it already received
    std::set<Id> early;          // received ahead of their own action
    for (const Action& a : s.ranks[r]) {
      const bool act = a.kind == ActionKind::kRecvActivation;
      const int from = act ? a.stage - 1 : a.stage + 1;
      if ((!act && a.kind != ActionKind::kRecvGrad) || s.rank_of(from) == r) {
        out.push_back(a);
        continue;
      }
      const Id id{act, a.microbatch, a.stage};
      if (early.erase(id)) continue;
      const int q = s.rank_of(from);
      const auto& sent = order[{q, r}];
      // Every message the sender sent before this one is received here too.
      for (size_t& k = next[q]; k < sent.size();) {
        const Id m = sent[k++];
        out.push_back({std::get<0>(m) ? ActionKind::kRecvActivation : ActionKind::kRecvGrad, std::get<1>(m),
                       std::get<2>(m)});
        if (m == id) break;
        early.insert(m);
      }
    }
    s.ranks[r] = std::move(out);
  }
  return s;
}

}  // namespace parallel
}  // namespace tessera
