#!/usr/bin/env bash
# A rank lost during elastic training ends the job, in bounded time, with a
# message naming it (docs/elastic.md, "Losing a rank"): Open MPI 4.1 has no
# ULFM, so the survivors cannot go on without it.
#   elastic_rank_loss.sh PROGRAM MPIEXEC
set -u
prog=$1 mpiexec=$2
# run NAME EXPECTED_REGEX ARGS...: the job must fail within 60 s and print the regex.
run() {
  local name=$1 expect=$2; shift 2
  local start=$SECONDS out status
  out=$(timeout 60 "$mpiexec" -np 4 "$prog" "$@" 2>&1); status=$?
  echo "$out"
  echo "-- $name: exit status $status after $((SECONDS - start)) s"
  [ $status -ne 124 ] || { echo "FAIL: $name: the job hung"; exit 1; }
  [ $status -ne 0 ] || { echo "FAIL: $name: the job succeeded without a rank"; exit 1; }
  echo "$out" | grep -Eq "$expect" || { echo "FAIL: $name: no message matching '$expect'"; exit 1; }
}
# An active rank dies (dp 4, every rank training): mpirun names it.
run "active rank killed" "process rank 2 .*signal 9" kill 2 7
# An idle rank dies (dp 1, rank 3 waiting for work): mpirun names it.
run "idle rank killed" "process rank 3 .*signal 9" kill 3 1
# An active rank hangs while two ranks are idle (dp 2): its partner's
# all-reduce times out naming the operation and the peers; the job ends.
TESSERA_COMM_TIMEOUT=5 run "active rank stopped" \
  "error on rank 0 of 4 .*did not complete within 5 s\. Peers \(rank in the communicator, world rank\): .*1" stop 1 4
echo "PASS: a killed active rank, a killed idle rank and a hung active rank each end the job with a message naming them"
