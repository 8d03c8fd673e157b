#!/usr/bin/env bash
# Note [One rank's error]: an error on rank 1 alone ends the job with rank
# 1's message; an error on every rank ends it with one message; neither hangs.
#   one_rank_error.sh PROGRAM MPIEXEC
set -u
prog=$1 mpiexec=$2
out=$(timeout 60 "$mpiexec" -np 3 "$prog" one 2>&1); status=$?
echo "$out"
[ $status -ne 124 ] || { echo "FAIL: rank 1's error left the job hanging"; exit 1; }
[ $status -ne 0 ] || { echo "FAIL: the job succeeded although rank 1 failed"; exit 1; }
echo "$out" | grep -q "error on rank 1 of 3 .*cannot open the data file" || { echo "FAIL: rank 1's message missing"; exit 1; }
out=$(timeout 60 "$mpiexec" -np 3 "$prog" all 2>&1); status=$?
echo "$out"
[ $status -eq 1 ] || { echo "FAIL: the job should end with status 1, got $status"; exit 1; }
[ "$(echo "$out" | grep -c "one_rank_error: error: --layers must be >= 1")" -eq 1 ] || { echo "FAIL: expected the message once"; exit 1; }
echo "PASS: an error on one rank and on all ranks each end the job with a message"
