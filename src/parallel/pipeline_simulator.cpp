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
    TORCH_CHECK(costs.send >= 0 && costs.send <= costs.message, where(), "a send's own time (", costs.send,
                ") must be in [0, message = ", costs.message, "]: it is the part of the message its sender waits for");
    state_.assign(s.stages(), std::vector<unsigned char>(s.microbatches, kNone));
    received_.assign(s.stages(), std::vector<unsigned char>(s.microbatches, 0));
  }

  Simulation run() {
    std::vector<size_t> pos(s_.pp, 0);
    std::vector<double> time(s_.pp, 0.0);
    Simulation sim;
    sim.busy.assign(s_.pp, 0.0);
    sim.peak_inflight.assign(s_.pp, 0);
    sim.peak_inflight_stage.assign(s_.stages(), 0);
    sim.timeline.assign(s_.pp, {});
    std::vector<int> inflight(s_.pp, 0), stage_inflight(s_.stages(), 0);
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
            time[r] += costs_.send;
          } else {
            const double cost = a.paired ? paired_forward_cost(r, pos[r]) : cost_of(a.kind);
            sim.timeline[r].emplace_back(time[r], a);
            time[r] += cost;
            sim.busy[r] += cost;
            unsigned char& st = state_[a.stage][a.microbatch];
            switch (a.kind) {
              case ActionKind::kForward:
                st |= kForwardDone;
                // A forward-only schedule keeps no activation for a backward.
                if (!s_.forward_only) {
                  sim.peak_inflight[r] = std::max(sim.peak_inflight[r], ++inflight[r]);
                  int& n = sim.peak_inflight_stage[a.stage];
                  n = std::max(n, ++stage_inflight[a.stage]);
                }
                break;
              case ActionKind::kBackward:
                st |= kBackwardDone | kInputGradDone | kWeightDone;
                --inflight[r];
                --stage_inflight[a.stage];
                break;
              case ActionKind::kBackwardInput:
                st |= kInputGradDone;
                break;
              default:
                st |= kWeightDone;
                --inflight[r];
                --stage_inflight[a.stage];
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

  // A paired forward's share of its F&B block: the block's cost less its
  // backward's, so that the block costs costs_.forward_backward.
  double paired_forward_cost(int r, size_t i) const {
    const auto& actions = s_.ranks[r];
    const Action& a = actions[i];
    TORCH_CHECK(a.kind == ActionKind::kForward && i + 1 < actions.size() &&
                    (actions[i + 1].kind == ActionKind::kBackward || actions[i + 1].kind == ActionKind::kBackwardInput),
                where(r, i, a), "a paired forward must be followed right away by its block's backward (B or I)");
    if (costs_.forward_backward < 0) return costs_.forward;
    const double backward = cost_of(actions[i + 1].kind);
    TORCH_CHECK(costs_.forward_backward >= backward, where(r, i, a), "the F&B block's cost ", costs_.forward_backward,
                " is below its backward's ", backward);
    return costs_.forward_backward - backward;
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
    const auto& line = sim.timeline[r];
    for (size_t k = 0; k < line.size(); ++k) {
      const auto& [start, a] = line[k];
      // A paired forward ends where its block's backward starts.
      const double cost = a.paired                               ? line[k + 1].first - start
                          : a.kind == ActionKind::kForward       ? costs.forward
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

}  // namespace parallel
}  // namespace tessera
