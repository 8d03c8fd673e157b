#pragma once
// Runs a pipeline schedule on paper (Note [Pipeline stages and messages]):
// checks that every rank reaches its end and that each action comes after
// what it needs, and reports the bubble and the activations each rank holds.
#include "tessera/parallel/message_batches.h"
#include "tessera/parallel/pipeline_schedule.h"

#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace parallel {

// Time of one action of one stage; the same for every stage.
struct ActionCosts {
  double forward = 1.0;
  double backward = 2.0;         // B
  double backward_input = 1.0;   // I
  double backward_weight = 1.0;  // W
  double message = 0.0;          // from a send to the matching receive's earliest completion
  // What a send keeps its rank from the next action (<= message): where
  // nothing moves a message while its sender computes (Note [Messages
  // nothing moves] in estimate.cpp), the sender pushes it before going on.
  double send = 0.0;
  // An F&B block (Action::paired) as a whole; below 0: its forward plus its
  // backward, which is what the executor runs (Note [DualPipeV order]).
  double forward_backward = -1.0;
};

struct Simulation {
  double makespan = 0;
  std::vector<double> busy;  // per rank, compute time
  // 1 - sum(busy) / (pp · makespan): the fraction of rank time spent idle.
  double bubble = 0;
  // Per rank, idle time between the start of its first compute action and
  // the end of its last: the bubble a rank cannot hide by starting late or
  // by letting the next step begin early.
  std::vector<double> idle_within;
  // Per rank, the most micro-batch stages whose forward has run and whose
  // backward (B, or W after I) has not: activations held at once.
  std::vector<int> peak_inflight;
  // The same per stage: the model's ends (a head's logits) are held by
  // their own stage's micro-batches, not by the whole rank's.
  std::vector<int> peak_inflight_stage;
  // Per rank, the compute actions with their start times.
  std::vector<std::vector<std::pair<double, Action>>> timeline;
};

// Throws c10::Error naming the schedule, the rank, the position and the
// action when an action is on the wrong rank, repeats, comes before what it
// needs, a send is never received, a compute action is missing, or the ranks
// deadlock (every unfinished rank waits for a message nobody will send).
Simulation simulate(const Schedule& schedule, const ActionCosts& costs = {});

// The simulated timeline as text, one row per rank, `chars_per_unit`
// characters per unit of cost: each action is its letter and micro-batch
// ("F3", "B3", "I3", "W3"; chunk c > 0 in lower case), padded with '-' to
// its length, idle time '.'.
std::string draw(const Schedule& schedule, const ActionCosts& costs = {}, int chars_per_unit = 2);

}  // namespace parallel
}  // namespace tessera
