#include "v_schedules.h"

#include <c10/util/Exception.h>

#include <deque>

namespace tessera {
namespace parallel {
namespace detail {

// Note [ZB-V order]
// With m >= 2pp - 1 each rank runs a fixed order (the paper's handcrafted
// ZB-V, as TorchTitan's schedule runs it), with c0 = stage r, c1 = stage
// 2pp - 1 - r:
//   warm-up   2(pp - r) - 1 forwards of c0; r times (F c1, F c0); pp - r
//             times (F c1, I c1, W c1)
//   steady    until every forward has run: F c0 (while any is left), I c0,
//             W c0, F c1, I c1, W c1
//   cool-down r times (I c0, I c1); pp - r times (I c0, W c0); the W's
//             left, chunk 1's first
// The warm-up fills the V's first wait with chunk 0's forwards, and the W's
// held back in the cool-down fill the wait for the last input gradients.
// Fewer micro-batches do not fill the warm-up: the list scheduler above
// places them instead.
std::vector<std::vector<Action>> zero_bubble_v_order(int pp, int m) {
  std::vector<std::vector<Action>> ranks(pp);
  for (int r = 0; r < pp; ++r) {
    const int stage[2] = {r, 2 * pp - 1 - r};
    int next[3][2] = {};  // per kind (F, I, W) and chunk: the next micro-batch
    auto& out = ranks[r];
    auto run = [&](ActionKind kind, int k, int c) { out.push_back({kind, next[k][c]++, stage[c]}); };
    auto F = [&](int c) { run(ActionKind::kForward, 0, c); };
    auto I = [&](int c) { run(ActionKind::kBackwardInput, 1, c); };
    auto W = [&](int c) { run(ActionKind::kBackwardWeight, 2, c); };
    for (int k = 0; k < 2 * (pp - r) - 1; ++k) F(0);
    for (int k = 0; k < r; ++k) F(1), F(0);
    for (int k = 0; k < pp - r; ++k) F(1), I(1), W(1);
    while (next[0][1] < next[0][0] || next[0][0] < m) {
      if (next[0][0] < m) F(0);
      I(0), W(0), F(1), I(1), W(1);
    }
    for (int k = 0; k < r; ++k) I(0), I(1);
    for (int k = 0; k < pp - r; ++k) I(0), W(0);
    while (next[2][1] < m) W(1);
    while (next[2][0] < m) W(0);
    for (int k = 0; k < 3; ++k)
      TORCH_INTERNAL_ASSERT(next[k][0] == m && next[k][1] == m, "ZB-V order: kind ", k, " ran ", next[k][0], " and ",
                            next[k][1], " of ", m, " micro-batches");
  }
  return ranks;
}

// Note [DualPipeV order]
// DualPipeV (DeepSeek's DualPipe cut in half, as TorchTitan runs it) uses
// ZB-V's V layout and needs m >= 2pp. Rank r, with c0 = stage r and
// c1 = stage 2pp - 1 - r, runs:
//   1  2(pp - r - 1) forwards of c0
//   2  r + 1 times (F c0, F c1)
//   3  pp - r - 1 times (I c1, W, F c1)
//   4  m - 2pp + r + 1 times (F c0 & B c1, F c1 & B c0); the last rank runs
//      its first F c0 and B c1 apart, which starts its B sooner
//   5  pp - r - 1 times (B c1, F c1 & B c0)
//   6  r + 1 times (B c1, B c0), split into I from the middle on
//   7  pp - r - 1 times (W, I c0)
//   8  r + 1 W's
// where "F & B" is an F&B block (Action::paired), B a whole backward, and W
// the oldest weight part still owed (first in, first out). The blocks are
// what DualPipe is for: a model that overlaps one micro-batch's forward with
// another's backward (an expert all-to-all behind the other's compute) makes
// a block cost F&B < F + B. tessera's executor runs a block's two halves one
// after the other, so here F&B = F + B, and the block's gain is that its
// four messages travel at two points. The bubble per rank is
// (pp - 1)(F&B + B - 3W) (DualPipe's table with its PP = 2pp stages).
std::vector<std::vector<Action>> dualpipev_order(int pp, int m) {
  std::vector<std::vector<Action>> ranks(pp);
  for (int r = 0; r < pp; ++r) {
    const int stage[2] = {r, 2 * pp - 1 - r};
    int next_f[2] = {}, next_b[2] = {};
    std::deque<Action> owed_w;
    auto& out = ranks[r];
    auto F = [&](int c, bool paired = false) { out.push_back({ActionKind::kForward, next_f[c]++, stage[c], paired}); };
    auto B = [&](int c, bool split) {
      const int mb = next_b[c]++;
      out.push_back({split ? ActionKind::kBackwardInput : ActionKind::kBackward, mb, stage[c]});
      if (split) owed_w.push_back({ActionKind::kBackwardWeight, mb, stage[c]});
    };
    auto FB = [&](int f, int b) { F(f, true), B(b, false); };
    auto W = [&] {
      TORCH_INTERNAL_ASSERT(!owed_w.empty(), "DualPipeV order: rank ", r, " has no weight part to run");
      out.push_back(owed_w.front());
      owed_w.pop_front();
    };
    const int before = pp - r - 1;
    for (int k = 0; k < 2 * before; ++k) F(0);
    for (int k = 0; k <= r; ++k) F(0), F(1);
    for (int k = 0; k < before; ++k) B(1, true), W(), F(1);
    for (int i = 0; i < m - 2 * pp + r + 1; ++i) {
      if (i == 0 && r == pp - 1)
        F(0), B(1, false);
      else
        FB(0, 1);
      FB(1, 0);
    }
    for (int k = 0; k < before; ++k) B(1, false), FB(1, 0);
    bool split = false;
    for (int i = 0; i <= r; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      B(1, split);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      B(0, split);
    }
    for (int k = 0; k < before; ++k) W(), B(0, split);
    for (int k = 0; k <= r; ++k) W();
    TORCH_INTERNAL_ASSERT(owed_w.empty() && next_f[0] == m && next_f[1] == m && next_b[0] == m && next_b[1] == m,
                          "DualPipeV order: rank ", r, " ran forwards ", next_f[0], "/", next_f[1], " and backwards ",
                          next_b[0], "/", next_b[1], " of ", m, " micro-batches, ", owed_w.size(), " W's owed");
  }
  return ranks;
}

}  // namespace detail
}  // namespace parallel
}  // namespace tessera
