#include "tessera/parallel/pipeline_simulator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <sstream>
#include <tuple>

namespace tessera {
namespace parallel {

namespace {

enum State : unsigned char { kNone = 0, kForwardDone = 1, kInputGradDone = 2, kBackwardDone = 4, kWeightDone = 8 };

// A message is named by its kind, micro-batch and the stage that receives it.
using MessageKey = std::tuple<bool /*activation*/, int, int>;

class Simulator {
 public:
  Simulator(const Schedule& s, const ActionCosts& costs) : s_(s), costs_(costs) {
    TORCH_CHECK(static_cast<int>(s.ranks.size()) == s.pp, where(), "has ", s.ranks.size(),
                " rank lists for pp = ", s.pp);
    state_.assign(s.stages(), std::vector<unsigned char>(s.microbatches, kNone));
    received_.assign(s.stages(), std::vector<unsigned char>(s.microbatches, 0));
  }

  Simulation run() {
    std::vector<size_t> pos(s_.pp, 0);
    std::vector<double> time(s_.pp, 0.0);
    Simulation sim;
    sim.busy.assign(s_.pp, 0.0);
    sim.peak_inflight.assign(s_.pp, 0);
    sim.timeline.assign(s_.pp, {});
    std::vector<int> inflight(s_.pp, 0);
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < s_.pp; ++r) {
        const auto& actions = s_.ranks[r];
        while (pos[r] < actions.size()) {
          const Action& a = actions[pos[r]];
          check_action(r, pos[r], a);
          if (a.kind == ActionKind::kRecvActivation || a.kind == ActionKind::kRecvGrad) {
            const bool act = a.kind == ActionKind::kRecvActivation;
            auto it = sent_.find({act, a.microbatch, a.stage});
            if (it == sent_.end()) break;  // blocked: wait for the other ranks
            time[r] = std::max(time[r], it->second);
            sent_.erase(it);
            received_[a.stage][a.microbatch] |= act ? 1 : 2;
          } else if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGrad) {
            const bool act = a.kind == ActionKind::kSendActivation;
            const MessageKey key{act, a.microbatch, act ? a.stage + 1 : a.stage - 1};
            TORCH_CHECK(sent_.count(key) == 0, where(r, pos[r], a), "sends the same message twice");
            sent_[key] = time[r] + costs_.message;
          } else {
            const double cost = cost_of(a.kind);
            sim.timeline[r].emplace_back(time[r], a);
            time[r] += cost;
            sim.busy[r] += cost;
            unsigned char& st = state_[a.stage][a.microbatch];
            switch (a.kind) {
              case ActionKind::kForward:
                st |= kForwardDone;
                // A forward-only schedule keeps no activation for a backward.
                if (!s_.forward_only) sim.peak_inflight[r] = std::max(sim.peak_inflight[r], ++inflight[r]);
                break;
              case ActionKind::kBackward:
                st |= kBackwardDone | kInputGradDone | kWeightDone;
                --inflight[r];
                break;
              case ActionKind::kBackwardInput:
                st |= kInputGradDone;
                break;
              default:
                st |= kWeightDone;
                --inflight[r];
                break;
            }
          }
          ++pos[r];
          progress = true;
        }
      }
    }
    std::ostringstream blocked;
    for (int r = 0; r < s_.pp; ++r) {
      if (pos[r] < s_.ranks[r].size()) {
        blocked << "\n  rank " << r << " waits at action " << pos[r] << " (" << s_.ranks[r][pos[r]].to_string() << ")";
      }
    }
    TORCH_CHECK(blocked.str().empty(), where(),
                "deadlocks: every unfinished rank waits for a message that no rank "
                "will send:",
                blocked.str());
    for (const auto& m : sent_) {
      TORCH_CHECK(false, where(), "sends ", std::get<0>(m.first) ? "an activation" : "a gradient", " of micro-batch ",
                  std::get<1>(m.first), " to stage ", std::get<2>(m.first), " that is never received");
    }
    for (int st = 0; st < s_.stages(); ++st) {
      for (int mb = 0; mb < s_.microbatches; ++mb) {
        const unsigned char v = state_[st][mb];
        if (s_.forward_only) {
          TORCH_CHECK(v == kForwardDone, where(), "never runs the forward of micro-batch ", mb, " on stage ", st);
          continue;
        }
        TORCH_CHECK((v & kForwardDone) && (v & kWeightDone) && (v & kInputGradDone), where(),
                    "never completes the forward and backward of micro-batch ", mb, " on stage ", st);
      }
    }
    sim.makespan = *std::max_element(time.begin(), time.end());
    double busy = 0;
    for (double b : sim.busy) busy += b;
    sim.bubble = sim.makespan > 0 ? 1.0 - busy / (s_.pp * sim.makespan) : 0.0;
    sim.idle_within.assign(s_.pp, 0.0);
    for (int r = 0; r < s_.pp; ++r) {
      if (sim.timeline[r].empty()) continue;
      const auto& [last_start, last] = sim.timeline[r].back();
      sim.idle_within[r] = last_start + cost_of(last.kind) - sim.timeline[r].front().first - sim.busy[r];
    }
    return sim;
  }

 private:
  std::string where() const { return "pipeline schedule " + s_.name + ": "; }
  std::string where(int r, size_t i, const Action& a) const {
    return where() + "rank " + std::to_string(r) + ", action " + std::to_string(i) + " (" + a.to_string() + "): ";
  }

  double cost_of(ActionKind k) const {
    switch (k) {
      case ActionKind::kForward:
        return costs_.forward;
      case ActionKind::kBackward:
        return costs_.backward;
      case ActionKind::kBackwardInput:
        return costs_.backward_input;
      default:
        return costs_.backward_weight;
    }
  }

  // The action is on its rank, in range, not repeated, and after what it needs.
  void check_action(int r, size_t i, const Action& a) const {
    TORCH_CHECK(a.stage >= 0 && a.stage < s_.stages() && a.microbatch >= 0 && a.microbatch < s_.microbatches,
                where(r, i, a), "stage must be in [0, ", s_.stages(), ") and micro-batch in [0, ", s_.microbatches,
                ")");
    TORCH_CHECK(s_.rank_of(a.stage) == r, where(r, i, a), "stage ", a.stage, " belongs to rank ", s_.rank_of(a.stage));
    const unsigned char st = state_[a.stage][a.microbatch];
    const unsigned char got = received_[a.stage][a.microbatch];
    const int last = s_.stages() - 1;
    TORCH_CHECK(!s_.forward_only || a.kind == ActionKind::kForward || a.kind == ActionKind::kSendActivation ||
                    a.kind == ActionKind::kRecvActivation,
                where(r, i, a), "a forward-only schedule has no backward and no gradient messages");
    switch (a.kind) {
      case ActionKind::kForward:
        TORCH_CHECK(!(st & kForwardDone), where(r, i, a), "repeats a forward");
        TORCH_CHECK(a.stage == 0 || (got & 1), where(r, i, a), "runs before its input is received (RA)");
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        TORCH_CHECK(st & kForwardDone, where(r, i, a), "runs before its forward");
        TORCH_CHECK(!(st & kInputGradDone), where(r, i, a), "repeats a backward");
        TORCH_CHECK(a.stage == last || (got & 2), where(r, i, a), "runs before its output gradient is received (RG)");
        break;
      case ActionKind::kBackwardWeight:
        TORCH_CHECK(st & kInputGradDone, where(r, i, a), "runs before its input-gradient part (I)");
        TORCH_CHECK(!(st & kWeightDone), where(r, i, a), "repeats a weight-gradient part");
        break;
      case ActionKind::kSendActivation:
        TORCH_CHECK(a.stage < last, where(r, i, a), "the last stage has no next stage to send to");
        TORCH_CHECK(st & kForwardDone, where(r, i, a), "sends an output before its forward");
        break;
      case ActionKind::kSendGrad:
        TORCH_CHECK(a.stage > 0, where(r, i, a), "the first stage has no previous stage to send to");
        TORCH_CHECK(st & kInputGradDone, where(r, i, a), "sends an input gradient before its backward");
        break;
      case ActionKind::kRecvActivation:
        TORCH_CHECK(a.stage > 0, where(r, i, a), "the first stage receives no activation");
        break;
      case ActionKind::kRecvGrad:
        TORCH_CHECK(a.stage < last, where(r, i, a), "the last stage receives no gradient");
        break;
    }
  }

  const Schedule& s_;
  ActionCosts costs_;
  std::vector<std::vector<unsigned char>> state_;     // [stage][micro-batch] State bits
  std::vector<std::vector<unsigned char>> received_;  // [stage][micro-batch] 1: activation, 2: gradient
  std::map<MessageKey, double> sent_;                 // in flight: arrival time
};

}  // namespace

Simulation simulate(const Schedule& schedule, const ActionCosts& costs) { return Simulator(schedule, costs).run(); }

std::string draw(const Schedule& schedule, const ActionCosts& costs, int chars_per_unit) {
  TORCH_CHECK(chars_per_unit >= 1, "draw: chars_per_unit must be >= 1, got ", chars_per_unit);
  const Simulation sim = simulate(schedule, costs);
  const auto cells = [&](double t) { return static_cast<size_t>(t * chars_per_unit + 0.5); };
  const char* digits = "0123456789abcdefghijklmnopqrstuvwxyz";
  std::ostringstream os;
  for (int r = 0; r < schedule.pp; ++r) {
    std::string row(cells(sim.makespan), '.');
    for (const auto& [start, a] : sim.timeline[r]) {
      const double cost = a.kind == ActionKind::kForward         ? costs.forward
                          : a.kind == ActionKind::kBackward      ? costs.backward
                          : a.kind == ActionKind::kBackwardInput ? costs.backward_input
                                                                 : costs.backward_weight;
      const size_t begin = cells(start), end = std::min(row.size(), cells(start + cost));
      std::string label =
          std::string(1, "FBIW"[static_cast<int>(a.kind)]) + (a.microbatch < 36 ? digits[a.microbatch] : '+');
      if (schedule.chunk_of(a.stage) > 0) label[0] = static_cast<char>(std::tolower(label[0]));
      for (size_t i = begin; i < end; ++i) row[i] = i - begin < label.size() ? label[i - begin] : '-';
    }
    os << "rank " << r << " |" << row << "|\n";
  }
  return os.str();
}

std::vector<std::vector<int>> message_batches(const Schedule& schedule, bool* completes) {
  // A remote message, as both ends name it: (activation, micro-batch, receiving stage).
  using Id = std::tuple<bool, int, int>;
  struct Op {
    size_t action;  // index in the rank's actions
    bool send;
    int peer;
    Id id;
    int run;  // index of the run of consecutive message actions on this rank
  };
  const int pp = schedule.pp;
  std::vector<std::vector<Op>> ops(pp);
  std::map<std::pair<int, int>, std::vector<std::pair<Id, size_t>>> sent, received;  // (from, to) -> (id, op)
  for (int r = 0; r < pp; ++r) {
    const auto& actions = schedule.ranks[r];
    int run = -1;
    for (size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (a.is_compute()) continue;
      if (i == 0 || actions[i - 1].is_compute()) ++run;
      const bool act = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvActivation;
      const bool send = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGrad;
      const int other_stage = send ? (act ? a.stage + 1 : a.stage - 1) : (act ? a.stage - 1 : a.stage + 1);
      const int peer = schedule.rank_of(other_stage);
      if (peer == r) continue;  // a local hand-over, no message
      const Id id{act, a.microbatch, send ? other_stage : a.stage};
      (send ? sent[{r, peer}] : received[{peer, r}]).emplace_back(id, ops[r].size());
      ops[r].push_back({i, send, peer, id, run});
    }
  }
  auto name = [](const Id& id) {
    return std::string(std::get<0>(id) ? "activation" : "gradient") + " of micro-batch " +
           std::to_string(std::get<1>(id)) + " for stage " + std::to_string(std::get<2>(id));
  };
  // (1) one order per pair, and each op's other end.
  std::vector<std::vector<size_t>> partner(pp);
  for (int r = 0; r < pp; ++r) partner[r].assign(ops[r].size(), 0);
  for (const auto& [pair, messages] : sent) {
    const auto& theirs = received[pair];
    for (size_t k = 0; k < std::max(messages.size(), theirs.size()); ++k) {
      TORCH_CHECK(k < messages.size() && k < theirs.size() && messages[k].first == theirs[k].first, "schedule '",
                  schedule.name, "': rank ", pair.first, " sends its messages to rank ", pair.second,
                  " in another order than that rank receives them; message ", k, " is the ",
                  k < messages.size() ? name(messages[k].first) : std::string("end"), " on the sender and the ",
                  k < theirs.size() ? name(theirs[k].first) : std::string("end"), " on the receiver");
      partner[pair.first][messages[k].second] = theirs[k].second;
      partner[pair.second][theirs[k].second] = messages[k].second;
    }
  }
  for (const auto& [pair, theirs] : received)
    TORCH_CHECK(sent.count(pair), "schedule '", schedule.name, "': rank ", pair.second, " receives the ",
                name(theirs.front().first), " from rank ", pair.first, ", which never sends it");
  // Batches: the ops of one run whose other ends lie in one run of one peer,
  // in order of first appearance; so each batch pairs with one batch.
  std::vector<std::vector<int>> batch_of_op(pp);
  std::vector<int> batches(pp, 0);
  for (int r = 0; r < pp; ++r) {
    std::map<std::tuple<int, int, int>, int> key_to_batch;  // (run, peer, peer's run)
    for (size_t k = 0; k < ops[r].size(); ++k) {
      const Op& o = ops[r][k];
      const auto key = std::make_tuple(o.run, o.peer, ops[o.peer][partner[r][k]].run);
      auto it = key_to_batch.find(key);
      if (it == key_to_batch.end()) it = key_to_batch.emplace(key, batches[r]++).first;
      batch_of_op[r].push_back(it->second);
    }
  }
  // Batches of one run may interleave in action order; one that holds a
  // later message of a direction (peer, send or receive) than another
  // batch must come after it, or the order per pair would cross.
  std::vector<std::vector<std::vector<int>>> before(pp);  // [rank][batch] -> batches that must come first
  for (int r = 0; r < pp; ++r) {
    before[r].resize(static_cast<size_t>(batches[r]));
    std::map<std::pair<int, bool>, int> last;  // (peer, send) -> batch of the latest such op in the run
    for (size_t k = 0; k < ops[r].size(); ++k) {
      if (k > 0 && ops[r][k].run != ops[r][k - 1].run) last.clear();
      const int b = batch_of_op[r][k];
      auto it = last.find({ops[r][k].peer, ops[r][k].send});
      if (it != last.end() && it->second != b) before[r][static_cast<size_t>(b)].push_back(it->second);
      last[{ops[r][k].peer, ops[r][k].send}] = b;
    }
  }
  // (2) phases per batch: 0 not reached, 1 headers posted, 2 payloads posted, 3 done.
  // A rank takes the batches of its current run one at a time, first one
  // whose paired batch is already posted (else the first left), so a run's
  // batches with two runs of one peer cannot wait on each other; the order
  // taken is the order the executor follows.
  std::vector<std::vector<int>> phase(pp), run_of_batch(pp);
  std::vector<std::vector<std::vector<size_t>>> members(pp);  // [rank][batch] -> ops
  for (int r = 0; r < pp; ++r) {
    phase[r].assign(static_cast<size_t>(batches[r]), 0);
    run_of_batch[r].assign(static_cast<size_t>(batches[r]), 0);
    members[r].resize(static_cast<size_t>(batches[r]));
    for (size_t k = 0; k < ops[r].size(); ++k) {
      members[r][static_cast<size_t>(batch_of_op[r][k])].push_back(k);
      run_of_batch[r][static_cast<size_t>(batch_of_op[r][k])] = ops[r][k].run;
    }
  }
  // Headers are small sends on the host channel that never wait for their
  // receive (MPI's eager protocol), so the header phase waits for the
  // receives only; payload sends block until received.
  auto partners_reached = [&](int r, int b, int level) {
    for (size_t k : members[r][static_cast<size_t>(b)]) {
      if (level == 1 && ops[r][k].send) continue;
      const int peer = ops[r][k].peer;
      if (phase[peer][static_cast<size_t>(batch_of_op[peer][partner[r][k]])] < level) return false;
    }
    return true;
  };
  std::vector<int> current(pp, -1), done(pp, 0);
  std::vector<std::vector<int>> taken(pp);  // batches in the order taken
  // The batch rank r takes next from its current run: the only one left,
  // else the first whose paired batches are posted, else (force) the first.
  auto choose = [&](int r, bool force) {
    int run = -1, first = -1, count = 0;
    for (int b = 0; b < batches[r]; ++b) {
      if (phase[r][static_cast<size_t>(b)] == 3) continue;
      if (run < 0) run = run_of_batch[r][static_cast<size_t>(b)];
      if (run_of_batch[r][static_cast<size_t>(b)] != run) break;
      bool ready = true;
      for (int a : before[r][static_cast<size_t>(b)]) ready = ready && phase[r][static_cast<size_t>(a)] == 3;
      if (!ready) continue;
      ++count;
      if (first < 0) first = b;
      bool paired_posted = true;
      for (size_t k : members[r][static_cast<size_t>(b)]) {
        const int peer = ops[r][k].peer;
        if (phase[peer][static_cast<size_t>(batch_of_op[peer][partner[r][k]])] < 1) paired_posted = false;
      }
      if (paired_posted) return b;
    }
    return count == 1 || force ? first : -1;
  };
  auto take = [&](int r, int b) {
    current[r] = b;
    phase[r][static_cast<size_t>(b)] = 1;
    taken[r].push_back(b);
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      if (current[r] < 0) {
        if (done[r] == batches[r]) continue;
        const int pick = choose(r, false);
        if (pick < 0) continue;  // decide once a peer has posted
        take(r, pick);
        progress = true;
      }
      int& p = phase[r][static_cast<size_t>(current[r])];
      const int before = p;
      if (p == 1 && partners_reached(r, current[r], 1)) p = 2;
      if (p == 2 && partners_reached(r, current[r], 2)) {
        p = 3;
        current[r] = -1;
        ++done[r];
      }
      progress = progress || p != before;
    }
    // Nobody can move: the first undecided rank takes its first batch.
    for (int r = 0; r < pp && !progress; ++r) {
      if (current[r] >= 0 || done[r] == batches[r]) continue;
      const int pick = choose(r, true);
      TORCH_CHECK(pick >= 0, "schedule '", schedule.name, "': rank ", r, "'s message batches of one run ",
                  "cannot be ordered without crossing the order of its messages to one peer");
      take(r, pick);
      progress = true;
    }
  }
  bool all_done = true;
  for (int r = 0; r < pp; ++r) {
    if (done[r] == batches[r]) continue;
    all_done = false;
    TORCH_CHECK(completes != nullptr, "schedule '", schedule.name,
                "': with sends that block until received, rank ", r, " waits forever in its message batch ", done[r],
                " (", name(ops[r][members[r][static_cast<size_t>(current[r] < 0 ? 0 : current[r])].front()].id),
                ", ...)");
  }
  if (completes != nullptr) *completes = all_done;
  // Not completing: every batch in order of appearance, but after the
  // batches it must follow.
  if (!all_done)
    for (int r = 0; r < pp; ++r) {
      taken[r].clear();
      std::vector<bool> placed(static_cast<size_t>(batches[r]), false);
      for (int n = 0; n < batches[r]; ++n) {
        int pick = -1;
        for (int b = 0; b < batches[r] && pick < 0; ++b) {
          if (placed[static_cast<size_t>(b)]) continue;
          bool ready = true;
          for (int a : before[r][static_cast<size_t>(b)]) ready = ready && placed[static_cast<size_t>(a)];
          if (ready) pick = b;
        }
        TORCH_CHECK(pick >= 0, "schedule '", schedule.name, "': rank ", r, "'s message batches of one run ",
                    "cannot be ordered without crossing the order of its messages to one peer");
        placed[static_cast<size_t>(pick)] = true;
        taken[r].push_back(pick);
      }
    }
  std::vector<std::vector<int>> out(pp);
  for (int r = 0; r < pp; ++r) {
    std::vector<int> position(static_cast<size_t>(batches[r]));
    for (size_t t = 0; t < taken[r].size(); ++t) position[static_cast<size_t>(taken[r][t])] = static_cast<int>(t);
    out[r].assign(schedule.ranks[r].size(), -1);
    for (size_t k = 0; k < ops[r].size(); ++k)
      out[r][ops[r][k].action] = position[static_cast<size_t>(batch_of_op[r][k])];
  }
  // The order the executor posts in (batch, then action) keeps the order per pair.
  std::map<std::pair<int, int>, std::vector<Id>> posted_sent, posted_received;
  for (int r = 0; r < pp; ++r) {
    std::vector<size_t> order(ops[r].size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return out[r][ops[r][a].action] < out[r][ops[r][b].action];
    });
    for (size_t k : order) {
      const Op& o = ops[r][k];
      (o.send ? posted_sent[{r, o.peer}] : posted_received[{o.peer, r}]).push_back(o.id);
    }
  }
  TORCH_INTERNAL_ASSERT(posted_sent == posted_received, "schedule '", schedule.name,
                        "': the message batches cross the order of messages between two ranks");
  return out;
}

void check_message_batches(const Schedule& schedule) { message_batches(schedule, nullptr); }

}  // namespace parallel
}  // namespace tessera
