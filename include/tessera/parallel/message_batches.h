#pragma once
// How the pipeline executor posts a schedule's messages: the batches of
// sends and receives each rank posts together, and the order it takes them
// in (the run-time side of a schedule, beside the simulator's checks).
#include "tessera/parallel/pipeline_schedule.h"

#include <vector>

namespace tessera {
namespace parallel {

// Note [Pipeline message batches]
// There are no tags: messages between two ranks pair in the order posted.
// Where sends wait for their receivers (Communicator::sends_wait_for_receiver:
// NCCL, or MPI's synchronous sends standing in for it), a send and a receive
// that depend on each other must be posted together, and the executor posts a
// rank's messages in batches, each in two phases: the
// headers (shape and identity, on the control channel), then the payloads
// (on the device channel), each phase waited for whole. A batch is the
// messages of one run of consecutive message actions whose other ends lie
// in one run of one peer, so each batch pairs with exactly one batch of its
// peer: the exchange of 1F1B's steady state (send an activation, receive a
// gradient) is one batch on both sides, while GPipe's last forward send and
// first gradient receive, which pair with two different runs of the next
// rank, are two. A schedule is safe when (1) for every ordered pair of
// ranks, the sender posts its messages in the order the receiver posts its
// receives, and (2) with sends that block until received (NCCL), the
// batches complete: a phase completes once the paired batch has posted the
// same phase.
//
// message_batches returns, per rank and action, the batch number of each
// remote message (numbered in posting order; -1 for compute actions and
// hand-overs between a rank's own stages). It throws c10::Error naming the
// schedule, the ranks and the messages when (1) fails, and when (2) fails
// unless `completes` is given, which then says whether (2) holds.
// Interleaved 1F1B and ZB-H2 do not satisfy (2) for every pp and m (a rank
// sends a micro-batch ahead before receiving a gradient while its peer does
// the reverse): the executor then waits for their sends only at the end of
// the step (fine under MPI, refused under NCCL). check_message_batches throws on either.
//
// Where sends do not wait for their receivers (MPI), pairing costs time: a
// rank that takes a receive before a send of the same run holds the send
// back until the receive arrives, and ZB-H2's measured bubble at pp 2, m 4
// was 0.33 against 0.08 simulated. There the executor posts all sends of a
// run first (headers, then payloads, each one batch), waits for them at the
// end of the step (dropping those completed as it goes), and then takes the
// run's receives as one batch per phase. Order per pair (1) is all that is
// needed: a rank then waits only on receives, whose sends its peers post
// without waiting, so any schedule that simulate() accepts completes.
std::vector<std::vector<int>> message_batches(const Schedule& schedule, bool* completes = nullptr);
void check_message_batches(const Schedule& schedule);

}  // namespace parallel
}  // namespace tessera
