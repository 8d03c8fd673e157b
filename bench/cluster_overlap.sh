#!/usr/bin/env bash
# bench/cluster_overlap.sh BUILD_DIR [DATA]: how much of DDP's gradient
# reduction across hosts hides behind backward on the emulated cluster
# (scripts/cluster.sh), with and without a progress thread (Note [A progress
# thread]). Per link rate, train_gpt's median step (after two) for
#   after:   one bucket (--bucket-mb 100): the whole reduction after backward
#   buckets: --bucket-mb $BUCKET_MB, reductions posted during backward
#   thread:  the same with TESSERA_PROGRESS_US=$PROGRESS_US
# and the same ranks on one host with one bucket (the compute floor, with
# its own small reduction). Overlap efficiency = hidden / total
# communication = (after - X) / (after - one_host). One JSON object per row.
# Environment: RATES (default "200mbit 20mbit"), HOSTS, RANKS (2 x 2),
# STEPS (8), BUCKET_MB (0.25), PROGRESS_US (200), MODEL (train_gpt's model
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
print(f"{statistics.median(r['seconds'] for r in rows) * 1e3:.1f}")
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

one=$(run_train "$out/one.jsonl" 100 mpirun -np "$n")
for rate in $rates; do
  bash "$cluster" up --name "$name" --hosts "$hosts" --ranks "$ranks" --rate "$rate" >/dev/null
  on=(bash "$cluster" run --name "$name" -- mpirun -np "$n")
  after=$(run_train "$out/after.jsonl" 100 "${on[@]}")
  buckets=$(run_train "$out/buckets.jsonl" "$bucket" "${on[@]}")
  thread=$(TESSERA_PROGRESS_US=$progress run_train "$out/thread.jsonl" "$bucket" "${on[@]}")
  python3 - "$hosts" "$ranks" "$rate" "$bucket" "$progress" "$one" "$after" "$buckets" "$thread" <<'PY'
import json, sys
hosts, ranks, rate, bucket, progress = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
one, after, buckets, thread = map(float, sys.argv[6:10])
comm = after - one
eff = lambda x: round((after - x) / comm, 3) if comm > 0 else None
print(json.dumps({"hosts": hosts, "ranks_per_host": ranks, "rate": rate, "bucket_mb": bucket, "progress_us": progress,
                  "one_host_ms": one, "after_backward_ms": after, "buckets_ms": buckets, "buckets_thread_ms": thread,
                  "overlap_buckets": eff(buckets), "overlap_thread": eff(thread)}))
PY
  bash "$cluster" down --name "$name" >/dev/null
done
