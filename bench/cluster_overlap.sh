#!/usr/bin/env bash
# bench/cluster_overlap.sh BUILD_DIR [DATA]: how much of DDP's gradient
# reduction across hosts hides behind backward on the emulated cluster
# (scripts/cluster.sh), with and without a progress thread (Note [A progress
# thread]). Per link rate, train_gpt's median step (after two) for
#   after:   one bucket (--bucket-mb 100): the whole reduction after backward
#   buckets: --bucket-mb $BUCKET_MB, reductions posted during backward,
#            advanced only by the gradient hooks (TESSERA_PROGRESS_US=0)
#   driver:  the same with the stage driver (the default: Note [Stages
#            advanced beside the caller])
#   thread:  the same with TESSERA_PROGRESS_US=$PROGRESS_US (the progress
#            thread and the driver at that interval)
# and the same ranks on one host with one bucket (the compute floor, with
# its own small reduction). Overlap efficiency = hidden / total
# communication, two ways: from the steps, (after - X) / (after - one_host),
# which counts as exposed the compute that the communication's own CPU time
# (TCP, the threads) takes from ranks sharing cores; and from rank 0's time
# waiting in communication (train_gpt's wait_s), (wait_after - wait_X) /
# (wait_after - wait_one_host), which counts only what the step waited
# for. One JSON object per row.
# Environment: RATES (default "200mbit 20mbit"), HOSTS, RANKS (2 x 2),
# ROUNDS (3), STEPS (8), BUCKET_MB (0.25), PROGRESS_US (200), MODEL (train_gpt's model
# and batch flags; default the 0.84 M-parameter demo GPT, 8 sequences of 128
# tokens per rank).
set -euo pipefail
build=${1:?usage: cluster_overlap.sh BUILD_DIR [DATA]}
data=${2:-$(cd "$(dirname "$0")/.." && pwd)/README.md}
here=$(cd "$(dirname "$0")/.." && pwd)
cluster="$here/scripts/cluster.sh"
rates=${RATES:-200mbit 20mbit}
hosts=${HOSTS:-2}
ranks=${RANKS:-2}
steps=${STEPS:-8}
rounds=${ROUNDS:-3}
bucket=${BUCKET_MB:-0.25}
progress=${PROGRESS_US:-200}
n=$((hosts * ranks))
read -r -a model <<<"${MODEL:---layers 4 --hidden 128 --heads 4 --seq 128 --batch $((8 * n))}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
unset TESSERA_PROGRESS_US
out=$(mktemp -d)
name=co$$
name=${name:0:8}
trap 'bash "$cluster" down --name "$name" >/dev/null 2>&1; rm -rf "$out"' EXIT

median_ms() {
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
rows = rows[2:] if len(rows) > 2 else rows
print(f"{statistics.median(r['seconds'] for r in rows) * 1e3:.1f},{statistics.median(r['wait_s'] for r in rows) * 1e3:.1f}")
PY
}
run_train() {  # METRICS BUCKET_MB LAUNCH...
  local metrics=$1 mb=$2
  shift 2
  "$@" "$build/examples/train_gpt" "${model[@]}" --bucket-mb "$mb" --steps "$steps" --data "$data" --sample 0 \
    --eval-every 0 --log-every 100 --metrics "$metrics" >"$metrics.log" 2>&1 || {
    echo "cluster_overlap: train_gpt failed: $(tail -3 "$metrics.log")" >&2
    exit 1
  }
  median_ms "$metrics"
}

for rate in $rates; do
  bash "$cluster" up --name "$name" --hosts "$hosts" --ranks "$ranks" --rate "$rate" >/dev/null
  on=(bash "$cluster" run --name "$name" -- mpirun -np "$n")
  # Rounds interleave the four runs, so that a slow minute of this
  # machine's shared cores falls on all of them; each figure is the median
  # over the rounds.
  one=() after=() buckets=() driver=() thread=()
  for ((round = 0; round < rounds; round++)); do
    one+=("$(run_train "$out/one.jsonl" 100 mpirun -np "$n")")
    after+=("$(run_train "$out/after.jsonl" 100 "${on[@]}")")
    buckets+=("$(TESSERA_PROGRESS_US=0 run_train "$out/buckets.jsonl" "$bucket" "${on[@]}")")
    driver+=("$(run_train "$out/driver.jsonl" "$bucket" "${on[@]}")")
    thread+=("$(TESSERA_PROGRESS_US=$progress run_train "$out/thread.jsonl" "$bucket" "${on[@]}")")
  done
  python3 - "$hosts" "$ranks" "$rate" "$bucket" "$progress" "${one[*]}" "${after[*]}" "${buckets[*]}" \
    "${driver[*]}" "${thread[*]}" <<'PY'
import json, statistics, sys
hosts, ranks, rate, bucket, progress = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
def medians(arg):  # "step,wait step,wait ..." -> (median step, median wait)
    pairs = [tuple(map(float, x.split(","))) for x in arg.split()]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
runs = dict(zip(("one_host", "after_backward", "buckets", "driver", "thread"), (medians(a) for a in sys.argv[6:11])))
row = {"hosts": hosts, "ranks_per_host": ranks, "rate": rate, "bucket_mb": bucket, "progress_us": progress,
       "rounds": len(sys.argv[6].split())}
for k, (step, wait) in runs.items():
    row[f"{k}_ms"], row[f"{k}_wait_ms"] = step, wait
(one, one_w), (after, after_w) = runs["one_host"], runs["after_backward"]
for k in ("buckets", "driver", "thread"):
    step, wait = runs[k]
    row[f"overlap_{k}"] = round((after - step) / (after - one), 3) if after > one else None
    row[f"overlap_{k}_wait"] = round((after_w - wait) / (after_w - one_w), 3) if after_w > one_w else None
print(json.dumps(row))
PY
  bash "$cluster" down --name "$name" >/dev/null
done
