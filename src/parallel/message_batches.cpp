#include "tessera/parallel/message_batches.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>

namespace tessera {
namespace parallel {
namespace {

// A remote message, as both ends name it: (activation, micro-batch, receiving stage).
using Id = std::tuple<bool, int, int>;

std::string name_of(const Id& id) {
  return std::string(std::get<0>(id) ? "activation" : "gradient") + " of micro-batch " +
         std::to_string(std::get<1>(id)) + " for stage " + std::to_string(std::get<2>(id));
}

struct Op {
  size_t action;  // index in the rank's actions
  bool send;
  int peer;
  Id id;
  int run;  // index of the run of consecutive message actions on this rank
};

// Note [Pipeline message batches], step by step: the remote messages of
// every rank (collect), each one's other end (pair), the batches (group),
// the order batches of one run must keep (constrain), the order a rank
// takes them in (post, or in_order when they cannot complete), and the
// batch number of every action (number), checked (verify).
class BatchPlanner {
 public:
  explicit BatchPlanner(const Schedule& s) : s_(s), pp_(s.pp), ops_(pp_), partner_(pp_), batch_of_op_(pp_),
                                             batches_(pp_, 0), before_(pp_) {}

  std::vector<std::vector<int>> plan(bool* completes) {
    collect();
    pair();
    group();
    constrain();
    const bool all_done = post(completes != nullptr);
    if (completes != nullptr) *completes = all_done;
    if (!all_done) in_order();
    auto out = number();
    verify(out);
    return out;
  }

 private:
  void collect() {
    for (int r = 0; r < pp_; ++r) {
      const auto& actions = s_.ranks[r];
      int run = -1;
      for (size_t i = 0; i < actions.size(); ++i) {
        const Action& a = actions[i];
        if (a.is_compute()) continue;
        if (i == 0 || actions[i - 1].is_compute()) ++run;
        const bool act = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvActivation;
        const bool send = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGrad;
        const int other_stage = send ? (act ? a.stage + 1 : a.stage - 1) : (act ? a.stage - 1 : a.stage + 1);
        const int peer = s_.rank_of(other_stage);
        if (peer == r) continue;  // a local hand-over, no message
        const Id id{act, a.microbatch, send ? other_stage : a.stage};
        (send ? sent_[{r, peer}] : received_[{peer, r}]).emplace_back(id, ops_[r].size());
        ops_[r].push_back({i, send, peer, id, run});
      }
    }
  }

  // (1) one order per pair, and each op's other end.
  void pair() {
    for (int r = 0; r < pp_; ++r) partner_[r].assign(ops_[r].size(), 0);
    for (const auto& [ends, messages] : sent_) {
      const auto& theirs = received_[ends];
      for (size_t k = 0; k < std::max(messages.size(), theirs.size()); ++k) {
        TORCH_CHECK(k < messages.size() && k < theirs.size() && messages[k].first == theirs[k].first, "schedule '",
                    s_.name, "': rank ", ends.first, " sends its messages to rank ", ends.second,
                    " in another order than that rank receives them; message ", k, " is the ",
                    k < messages.size() ? name_of(messages[k].first) : std::string("end"), " on the sender and the ",
                    k < theirs.size() ? name_of(theirs[k].first) : std::string("end"), " on the receiver");
        partner_[ends.first][messages[k].second] = theirs[k].second;
        partner_[ends.second][theirs[k].second] = messages[k].second;
      }
    }
    for (const auto& [ends, theirs] : received_)
      TORCH_CHECK(sent_.count(ends), "schedule '", s_.name, "': rank ", ends.second, " receives the ",
                  name_of(theirs.front().first), " from rank ", ends.first, ", which never sends it");
  }

  // The ops of one run whose other ends lie in one run of one peer, in
  // order of first appearance: each batch pairs with one batch.
  void group() {
    for (int r = 0; r < pp_; ++r) {
      std::map<std::tuple<int, int, int>, int> key_to_batch;  // (run, peer, peer's run)
      for (size_t k = 0; k < ops_[r].size(); ++k) {
        const Op& o = ops_[r][k];
        const auto key = std::make_tuple(o.run, o.peer, ops_[o.peer][partner_[r][k]].run);
        auto it = key_to_batch.find(key);
        if (it == key_to_batch.end()) it = key_to_batch.emplace(key, batches_[r]++).first;
        batch_of_op_[r].push_back(it->second);
      }
    }
  }

  // Batches of one run may interleave in action order; one that holds a
  // later message of a direction (peer, send or receive) than another batch
  // must come after it, or the order per pair would cross.
  void constrain() {
    for (int r = 0; r < pp_; ++r) {
      before_[r].resize(static_cast<size_t>(batches_[r]));
      std::map<std::pair<int, bool>, int> last;  // (peer, send) -> batch of the latest such op in the run
      for (size_t k = 0; k < ops_[r].size(); ++k) {
        if (k > 0 && ops_[r][k].run != ops_[r][k - 1].run) last.clear();
        const int b = batch_of_op_[r][k];
        auto it = last.find({ops_[r][k].peer, ops_[r][k].send});
        if (it != last.end() && it->second != b) before_[r][static_cast<size_t>(b)].push_back(it->second);
        last[{ops_[r][k].peer, ops_[r][k].send}] = b;
      }
    }
  }

  int phase_of_partner(int r, size_t k) const {
    const int peer = ops_[r][k].peer;
    return phase_[peer][static_cast<size_t>(batch_of_op_[peer][partner_[r][k]])];
  }

  // Headers are small sends on the host channel that never wait for their
  // receive (MPI's eager protocol), so the header phase waits for the
  // receives only; payload sends block until received.
  bool partners_reached(int r, int b, int level) const {
    for (size_t k : members_[r][static_cast<size_t>(b)]) {
      if (level == 1 && ops_[r][k].send) continue;
      if (phase_of_partner(r, k) < level) return false;
    }
    return true;
  }

  // The batch rank r takes next from its current run: the only one left,
  // else the first whose paired batches are posted, else (force) the first.
  int choose(int r, bool force) const {
    int run = -1, first = -1, count = 0;
    for (int b = 0; b < batches_[r]; ++b) {
      const auto i = static_cast<size_t>(b);
      if (phase_[r][i] == 3) continue;
      if (run < 0) run = run_of_batch_[r][i];
      if (run_of_batch_[r][i] != run) break;
      bool ready = true;
      for (int a : before_[r][i]) ready = ready && phase_[r][static_cast<size_t>(a)] == 3;
      if (!ready) continue;
      ++count;
      if (first < 0) first = b;
      bool paired_posted = true;
      for (size_t k : members_[r][i]) paired_posted = paired_posted && phase_of_partner(r, k) >= 1;
      if (paired_posted) return b;
    }
    return count == 1 || force ? first : -1;
  }

  void start_posting() {
    phase_.resize(pp_);
    run_of_batch_.resize(pp_);
    members_.resize(pp_);
    taken_.resize(pp_);
    for (int r = 0; r < pp_; ++r) {
      phase_[r].assign(static_cast<size_t>(batches_[r]), 0);
      run_of_batch_[r].assign(static_cast<size_t>(batches_[r]), 0);
      members_[r].resize(static_cast<size_t>(batches_[r]));
      for (size_t k = 0; k < ops_[r].size(); ++k) {
        members_[r][static_cast<size_t>(batch_of_op_[r][k])].push_back(k);
        run_of_batch_[r][static_cast<size_t>(batch_of_op_[r][k])] = ops_[r][k].run;
      }
    }
  }

  // (2) phases per batch: 0 not reached, 1 headers posted, 2 payloads
  // posted, 3 done. A rank takes the batches of its current run one at a
  // time, first one whose paired batch is already posted (else the first
  // left), so a run's batches with two runs of one peer cannot wait on each
  // other; the order taken is the order the executor follows. Returns
  // whether every batch completes.
  bool post(bool may_not_complete) {
    start_posting();
    std::vector<int> current(pp_, -1), done(pp_, 0);
    auto take = [&](int r, int b) {
      current[r] = b;
      phase_[r][static_cast<size_t>(b)] = 1;
      taken_[r].push_back(b);
    };
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < pp_; ++r) {
        if (current[r] < 0) {
          if (done[r] == batches_[r]) continue;
          const int pick = choose(r, false);
          if (pick < 0) continue;  // decide once a peer has posted
          take(r, pick);
          progress = true;
        }
        int& p = phase_[r][static_cast<size_t>(current[r])];
        const int was = p;
        if (p == 1 && partners_reached(r, current[r], 1)) p = 2;
        if (p == 2 && partners_reached(r, current[r], 2)) {
          p = 3;
          current[r] = -1;
          ++done[r];
        }
        progress = progress || p != was;
      }
      // Nobody can move: the first undecided rank takes its first batch.
      for (int r = 0; r < pp_ && !progress; ++r) {
        if (current[r] >= 0 || done[r] == batches_[r]) continue;
        const int pick = choose(r, true);
        TORCH_CHECK(pick >= 0, "schedule '", s_.name, "': rank ", r, "'s message batches of one run ",
                    "cannot be ordered without crossing the order of its messages to one peer");
        take(r, pick);
        progress = true;
      }
    }
    bool all_done = true;
    for (int r = 0; r < pp_; ++r) {
      if (done[r] == batches_[r]) continue;
      all_done = false;
      const size_t stuck = static_cast<size_t>(current[r] < 0 ? 0 : current[r]);
      TORCH_CHECK(may_not_complete, "schedule '", s_.name, "': with sends that block until received, rank ", r,
                  " waits forever in its message batch ", done[r], " (", name_of(ops_[r][members_[r][stuck].front()].id),
                  ", ...)");
    }
    return all_done;
  }

  // Not completing: every batch in order of appearance, but after the
  // batches it must follow.
  void in_order() {
    for (int r = 0; r < pp_; ++r) {
      taken_[r].clear();
      std::vector<bool> placed(static_cast<size_t>(batches_[r]), false);
      for (int n = 0; n < batches_[r]; ++n) {
        int pick = -1;
        for (int b = 0; b < batches_[r] && pick < 0; ++b) {
          if (placed[static_cast<size_t>(b)]) continue;
          bool ready = true;
          for (int a : before_[r][static_cast<size_t>(b)]) ready = ready && placed[static_cast<size_t>(a)];
          if (ready) pick = b;
        }
        TORCH_CHECK(pick >= 0, "schedule '", s_.name, "': rank ", r, "'s message batches of one run ",
                    "cannot be ordered without crossing the order of its messages to one peer");
        placed[static_cast<size_t>(pick)] = true;
        taken_[r].push_back(pick);
      }
    }
  }

  std::vector<std::vector<int>> number() const {
    std::vector<std::vector<int>> out(pp_);
    for (int r = 0; r < pp_; ++r) {
      std::vector<int> position(static_cast<size_t>(batches_[r]));
      for (size_t t = 0; t < taken_[r].size(); ++t) position[static_cast<size_t>(taken_[r][t])] = static_cast<int>(t);
      out[r].assign(s_.ranks[r].size(), -1);
      for (size_t k = 0; k < ops_[r].size(); ++k)
        out[r][ops_[r][k].action] = position[static_cast<size_t>(batch_of_op_[r][k])];
    }
    return out;
  }

  // The order the executor posts in (batch, then action) keeps the order per pair.
  void verify(const std::vector<std::vector<int>>& out) const {
    std::map<std::pair<int, int>, std::vector<Id>> posted_sent, posted_received;
    for (int r = 0; r < pp_; ++r) {
      std::vector<size_t> order(ops_[r].size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = k;
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return out[r][ops_[r][a].action] < out[r][ops_[r][b].action];
      });
      for (size_t k : order) {
        const Op& o = ops_[r][k];
        (o.send ? posted_sent[{r, o.peer}] : posted_received[{o.peer, r}]).push_back(o.id);
      }
    }
    TORCH_INTERNAL_ASSERT(posted_sent == posted_received, "schedule '", s_.name,
                          "': the message batches cross the order of messages between two ranks");
  }

  const Schedule& s_;
  const int pp_;
  std::vector<std::vector<Op>> ops_;
  std::map<std::pair<int, int>, std::vector<std::pair<Id, size_t>>> sent_, received_;  // (from, to) -> (id, op)
  std::vector<std::vector<size_t>> partner_;
  std::vector<std::vector<int>> batch_of_op_;
  std::vector<int> batches_;
  std::vector<std::vector<std::vector<int>>> before_;  // [rank][batch] -> batches that must come first
  std::vector<std::vector<int>> phase_, run_of_batch_, taken_;
  std::vector<std::vector<std::vector<size_t>>> members_;  // [rank][batch] -> ops
};

}  // namespace

std::vector<std::vector<int>> message_batches(const Schedule& schedule, bool* completes) {
  return BatchPlanner(schedule).plan(completes);
}

void check_message_batches(const Schedule& schedule) { message_batches(schedule, nullptr); }

}  // namespace parallel
}  // namespace tessera
