#pragma once
// The handcrafted orders of the two schedules with two chunks per rank in
// a V (Note [Pipeline stages and messages]): compute actions only, one
// list per rank; make_schedule adds the messages.
#include "tessera/parallel/pipeline_schedule.h"

#include <vector>

namespace tessera {
namespace parallel {
namespace detail {

// ZB-V for m >= 2pp - 1 micro-batches (Note [ZB-V order]).
std::vector<std::vector<Action>> zero_bubble_v_order(int pp, int m);

// DualPipeV for m >= 2pp micro-batches (Note [DualPipeV order]).
std::vector<std::vector<Action>> dualpipev_order(int pp, int m);

}  // namespace detail
}  // namespace parallel
}  // namespace tessera
