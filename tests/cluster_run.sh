#!/usr/bin/env bash
# tests/cluster_run.sh mpirun|srun CLUSTER_SH TEST_TRAIN TRAIN_GPT DATA OUT
#
# The trainer on an emulated cluster of 2 hosts x 2 ranks (scripts/cluster.sh,
# links shaped to 1 Gbit/s), launched by mpirun's rsh launcher or by Slurm's
# srun --mpi=pmix:
#  - test_train's trainer tests that run at 4 ranks against the serial
#    reference (every layout of Trainer.FiveStepsEqualSerial, sequence
#    parallelism, resume bit for bit) with their ranks on two hosts;
#  - train_gpt's header names both hosts and their ranks, and its losses and
#    gradient norms over 3 steps equal, bit for bit, those of the same run
#    with the 4 ranks on this machine's own host;
#  - (mpirun) the bytes that cross hosts in a step of ddp, zero3 and hpz
#    equal the planner's prediction (test_planner), hpz and mics take k =
#    the ranks of a host and equal the serial run (test_data_parallel), and
#    train_gpt --plan auto plans the two hosts as nodes and trains, and with
#    TESSERA_PROGRESS_US (the stage driver) and small buckets it gives the
#    same losses as without.
# Needs root (network namespaces); without it, or without Slurm for srun, it
# reports a skip (exit 77) with the reason.
set -uo pipefail
launcher=$1 cluster=$2 test_train=$3 train_gpt=$4 data=$5 out=$6
. "$(dirname "$0")/cluster_common.sh"
begin_cluster_test "c${launcher:0:1}" "$out"
if [ "$launcher" = srun ]; then
  for tool in slurmctld slurmd srun munged; do
    command -v $tool > /dev/null || skip "srun needs $tool (scripts/install-deps.sh installs Slurm and munge)"
  done
fi

slurm=()
[ "$launcher" = srun ] && slurm=(--slurm)
trap 'bash "$cluster" down --name "$name" > /dev/null 2>&1' EXIT
bash "$cluster" up --name "$name" --hosts 2 --ranks 2 --rate 1gbit "${slurm[@]}" || {
  echo "FAIL: the cluster did not come up"
  exit 1
}
case $launcher in
  mpirun) launch=(mpirun -np 4) ;;
  srun) launch=(srun --mpi=pmix -N 2 -n 4) ;;
  *) echo "unknown launcher $launcher"; exit 2 ;;
esac
on_cluster() { timeout 300 bash "$cluster" run --name "$name" -- "${launch[@]}" "$@"; }

failures=0
fail() {
  echo "FAIL ($launcher): $*"
  failures=$((failures + 1))
}

# The trainer against the serial reference, across the hosts. Each rank
# prints its host; the ranks must span both.
filter='Trainer.FiveStepsEqualSerial:Trainer.SequenceParallelEqualsSerial:Checkpoint.ResumeReproducesLossesBitForBit'
on_cluster "$test_train" --gtest_color=no --gtest_filter="$filter" > "$out/test_train.log" 2>&1 || {
  tail -40 "$out/test_train.log"
  fail "test_train across the hosts failed (log above)"
}
grep -q "\[  PASSED  \] 3 tests" "$out/test_train.log" || fail "test_train did not pass its 3 tests across the hosts"

# train_gpt across the hosts, then on one host.
args=(--steps 3 --batch 8 --seq 32 --layers 2 --hidden 64 --heads 2 --data "$data" --sample 0 --eval-every 0)
on_cluster "$train_gpt" "${args[@]}" --metrics "$out/cluster.jsonl" > "$out/cluster.log" 2>&1 ||
  fail "train_gpt across the hosts failed: $(tail -5 "$out/cluster.log")"
hosts=$(grep -m1 -o "2 hosts: $name-h0 ranks 0-1, $name-h1 ranks 2-3" "$out/cluster.log") ||
  fail "train_gpt's header does not name both hosts: $(head -1 "$out/cluster.log")"
timeout 300 mpirun -np 4 "$train_gpt" "${args[@]}" --metrics "$out/one_host.jsonl" > "$out/one_host.log" 2>&1 ||
  fail "train_gpt on one host failed: $(tail -5 "$out/one_host.log")"
losses() { grep '"kind":"train"' "$1" | grep -oE '"(loss|grad_norm)":[^,]*'; }
[ "$(losses "$out/cluster.jsonl" | wc -l)" -eq 6 ] || fail "train_gpt across the hosts logged no 3 steps"
if [ "$(losses "$out/cluster.jsonl")" != "$(losses "$out/one_host.jsonl")" ]; then
  fail "losses across the hosts differ from one host's: $(losses "$out/cluster.jsonl" | tr '\n' ' ') against $(losses "$out/one_host.jsonl" | tr '\n' ' ')"
fi

summary="cluster ($launcher): $hosts; test_train's 3 trainer tests passed across them; train_gpt's losses and gradient norms over 3 steps equal one host's bit for bit: $(losses "$out/cluster.jsonl" | tr '\n' ' ')"

if [ "$launcher" = mpirun ]; then
  bin=$(dirname "$test_train")
  on_cluster "$bin/test_planner" --gtest_color=no --gtest_filter=Planner.BytesAcrossHostsEqualThePrediction \
    > "$out/test_planner.log" 2>&1 || {
    tail -40 "$out/test_planner.log"
    fail "the bytes across hosts differ from the planner's prediction (log above)"
  }
  grep -q "\[  PASSED  \] 1 test" "$out/test_planner.log" || fail "test_planner's test did not pass across the hosts"
  crossing=$(grep -E "^(ddp|zero3|hpz): " "$out/test_planner.log" | tr '\n' ';')
  filter='Specs/DataParallelSpecs.TenAdamWStepsEqualSingleProcess/hpz_mlp:Specs/DataParallelSpecs.*/mics_conv'
  filter+=':ShardingSpec.ShardedModuleShardsInsideEachHost'
  on_cluster "$bin/test_data_parallel" --gtest_color=no --gtest_filter="$filter" > "$out/test_data_parallel.log" 2>&1 || {
    tail -40 "$out/test_data_parallel.log"
    fail "hpz and mics with k = the ranks of a host failed across the hosts (log above)"
  }
  grep -q "\[  PASSED  \] 6 tests" "$out/test_data_parallel.log" ||
    fail "test_data_parallel did not pass its 6 tests across the hosts: $(grep -E 'PASSED|FAILED|SKIPPED' "$out/test_data_parallel.log" | head -5)"
  on_cluster "$train_gpt" "${args[@]}" --steps 2 --plan auto > "$out/plan.log" 2>&1 ||
    fail "train_gpt --plan auto across the hosts failed: $(tail -5 "$out/plan.log")"
  nodes=$(grep -m1 -o "2 hosts of 2 ranks as nodes[^;]*" "$out/plan.log") ||
    fail "train_gpt --plan auto did not plan the hosts as nodes: $(grep -m3 planner "$out/plan.log")"
  # Note [Stages advanced beside the caller]: with the progress thread and
  # its stage driver, and buckets small enough that several reductions by
  # host are in flight at once, the same numbers as without them.
  TESSERA_PROGRESS_US=50 on_cluster "$train_gpt" "${args[@]}" --bucket-mb 0.07 --metrics "$out/driven.jsonl" \
    > "$out/driven.log" 2>&1 || fail "train_gpt with TESSERA_PROGRESS_US=50 failed: $(tail -5 "$out/driven.log")"
  [ "$(losses "$out/driven.jsonl")" = "$(losses "$out/cluster.jsonl")" ] ||
    fail "losses with the stage driver and 0.07 MiB buckets differ: $(losses "$out/driven.jsonl" | tr '\n' ' ')"
  summary+="; bytes across hosts as predicted: $crossing hpz and mics take k = 2 and equal serial; --plan auto: $nodes"
  summary+="; the stage driver with 0.07 MiB buckets gives the same losses"
fi
echo "$summary"
[ $failures -eq 0 ] || exit 1
