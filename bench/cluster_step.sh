#!/usr/bin/env bash
# bench/cluster_step.sh BUILD_DIR [DATA]: train_gpt's step across hosts of
# the emulated cluster (scripts/cluster.sh) against the same ranks on one
# host, per sharding spec and link rate. Prints one JSON object per row:
#   {"hosts": 2, "ranks_per_host": 2, "rate": "1gbit", "spec": "ddp",
#    "reductions": "hierarchical", "step_ms": ..., "one_host_step_ms": ...,
#    "ratio": ..., "comm_mb_per_rank": ...}
# step_ms is the median of the steps after the first two. Environment:
# RATES (default "1gbit 200mbit 20mbit"), SPECS (default "ddp zero3 hpz:2"),
# REDUCTIONS (TESSERA_HOST_REDUCTIONS values; default "hierarchical flat"),
# HOSTS and RANKS (default 2 x 2), STEPS (default 8), MODEL (train_gpt's
# model and batch flags; default the 0.84 M-parameter demo GPT, 8 sequences
# of 128 tokens per rank).
set -euo pipefail
build=${1:?usage: cluster_step.sh BUILD_DIR [DATA]}
data=${2:-$(cd "$(dirname "$0")/.." && pwd)/README.md}
here=$(cd "$(dirname "$0")/.." && pwd)
cluster="$here/scripts/cluster.sh"
rates=${RATES:-1gbit 200mbit 20mbit}
specs=${SPECS:-ddp zero3 hpz:2}
reductions=${REDUCTIONS:-hierarchical flat}
hosts=${HOSTS:-2}
ranks=${RANKS:-2}
steps=${STEPS:-8}
n=$((hosts * ranks))
read -r -a model <<<"${MODEL:---layers 4 --hidden 128 --heads 4 --seq 128 --batch $((8 * n))}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
out=$(mktemp -d)
name=cb$$
name=${name:0:8}
trap 'bash "$cluster" down --name "$name" >/dev/null 2>&1; rm -rf "$out"' EXIT

# The median step time (ms) and communication (MB per rank and step) of a
# metrics file, skipping the first two steps.
summary() {
  python3 - "$1" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
rows = rows[2:] if len(rows) > 2 else rows
print(f"{statistics.median(r['seconds'] for r in rows) * 1e3:.1f} {rows[-1]['comm_bytes'] / 1e6:.3f}")
EOF
}
run_train() {  # LAUNCH_PREFIX... -- SPEC METRICS
  local spec=$1 metrics=$2
  shift 2
  "$@" "$build/examples/train_gpt" "${model[@]}" --spec "$spec" --steps "$steps" --data "$data" --sample 0 \
    --eval-every 0 --log-every 100 --metrics "$metrics" >"$metrics.log" 2>&1 || {
    echo "cluster_step: train_gpt failed: $(tail -3 "$metrics.log")" >&2
    exit 1
  }
}

declare -A one_host
for spec in $specs; do
  run_train "$spec" "$out/one_$spec.jsonl" mpirun -np "$n"
  one_host[$spec]=$(summary "$out/one_$spec.jsonl")
done
for rate in $rates; do
  bash "$cluster" up --name "$name" --hosts "$hosts" --ranks "$ranks" --rate "$rate" >/dev/null
  for spec in $specs; do
    for red in $reductions; do
      TESSERA_HOST_REDUCTIONS=$red run_train "$spec" "$out/c_$spec.jsonl" \
        bash "$cluster" run --name "$name" -- mpirun -np "$n"
      read -r ms mb <<<"$(summary "$out/c_$spec.jsonl")"
      read -r one _ <<<"${one_host[$spec]}"
      printf '{"hosts": %d, "ranks_per_host": %d, "rate": "%s", "spec": "%s", "reductions": "%s", "step_ms": %s, "one_host_step_ms": %s, "ratio": %s, "comm_mb_per_rank": %s}\n' \
        "$hosts" "$ranks" "$rate" "$spec" "$red" "$ms" "$one" "$(python3 -c "print(round($ms / $one, 3))")" "$mb"
    done
  done
  bash "$cluster" down --name "$name" >/dev/null
done
