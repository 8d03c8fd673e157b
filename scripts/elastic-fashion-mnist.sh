#!/usr/bin/env bash
# The elastic Fashion-MNIST study of docs/elastic.md: LAMB with the batch
# ramping 512 -> 8192 over the first 8 epochs, the data size following it
# (at least 1024 rows per replica: dp 1, 1, 2, 4, 4) against the same ramp
# on a fixed dp 4 and against a fixed batch of 8192 on dp 4. Four ranks
# (ZeRO-2), 20 epochs, each run REPEATS times (default 2). Writes
# docs/results/elastic_fashion_mnist.jsonl and the table on stdout: final
# and best test accuracy, and the seconds to reach 0.88 and 0.89.
#
#   scripts/elastic-fashion-mnist.sh [BUILD_DIR]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
scripts/prepare-fashion-mnist.sh "$build"
data=$build/fashion-mnist

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
out=docs/results/elastic_fashion_mnist.jsonl
: > "$out"
ramp=0:512,2:1024,4:2048,6:4096,8:8192
run() {
  local name=$1; shift
  mpirun -np 4 "$build/examples/train_fashion_mnist" --data "$data" --optimizer lamb --epochs 20 --warmup-epochs 2 "$@" |
    python3 -c "import json, sys
for line in sys.stdin:
    r = json.loads(line); r['run'] = '$name'; print(json.dumps(r))" >> "$out"
}
for i in $(seq "${REPEATS:-2}"); do
  for lr in 0.02 0.04; do
    run "ramp, elastic (lr $lr)" --lr $lr --batch-schedule $ramp --min-rows-per-replica 1024
    run "ramp, fixed dp 4 (lr $lr)" --lr $lr --batch-schedule $ramp --min-rows-per-replica 1
    run "batch 8192, fixed dp 4 (lr $lr)" --lr $lr --batch 8192
  done
done
python3 - "$out" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)   # name -> list of runs (lists of epochs)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "epoch" not in r:
        continue
    if r["epoch"] == 1:
        runs[r["run"]].append([])
    runs[r["run"]][-1].append(r)
def first(epochs, target):
    hit = [e["seconds"] for e in epochs if e["test_accuracy"] >= target]
    return hit[0] if hit else float("nan")
mean = lambda xs: sum(xs) / len(xs)
print("| run | final accuracy | best accuracy | seconds to 0.88 | seconds to 0.89 | total seconds |")
print("|---|---:|---:|---:|---:|---:|")
for name, rs in runs.items():
    print(f"| {name} | {mean([r[-1]['test_accuracy'] for r in rs]):.4f} | "
          f"{mean([max(e['test_accuracy'] for e in r) for r in rs]):.4f} | "
          f"{mean([first(r, 0.88) for r in rs]):.1f} | {mean([first(r, 0.89) for r in rs]):.1f} | "
          f"{mean([r[-1]['seconds'] for r in rs]):.1f} |")
PY
