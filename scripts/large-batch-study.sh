#!/usr/bin/env bash
# The large-batch study of docs/large-batch.md: Fashion-MNIST, an MLP trained
# for the same number of epochs at batch 128 (AdamW) and at 16x and 64x that
# batch with AdamW, LAMB and LARS, each over a grid of 5 peak learning rates
# (factor 2 apart, around the scaling rule: square root for AdamW and LAMB,
# linear for LARS), with linear warm-up and decay. Two data-parallel ranks
# (ZeRO-2). Writes docs/results/large_batch.jsonl (one line per epoch and
# run), docs/large-batch.png and the table on stdout.
#
#   scripts/large-batch-study.sh [BUILD_DIR]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
scripts/prepare-fashion-mnist.sh "$build" python3-matplotlib
data=$build/fashion-mnist

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
epochs=${EPOCHS:-20}
out=docs/results/large_batch.jsonl
: > "$out"
run() { mpirun -np 2 "$build/examples/train_fashion_mnist" --data "$data" --epochs "$epochs" "$@" >> "$out"; }

start=$SECONDS
for lr in 0.00025 0.0005 0.001 0.002 0.004; do run --optimizer adamw --batch 128 --lr $lr --weight-decay 0.01; done
for batch in 2048 8192; do
  k=$((batch / 128))
  # Grids centred on the scaling rules from the batch-128 AdamW rate 1e-3:
  # sqrt(k) for AdamW, sqrt(k) x 2.5 for LAMB's larger trust-scaled steps,
  # linear for LARS (trust coefficient 0.001; 2.0 at 16x, found by a first
  # grid centred on 0.5 whose best rate was its largest).
  for m in 0.25 0.5 1 2 4; do
    run --optimizer adamw --batch $batch --lr "$(python3 -c "print(1e-3 * $k ** 0.5 * $m)")" --warmup-epochs 2 --weight-decay 0.01
    run --optimizer lamb --batch $batch --lr "$(python3 -c "print(2.5e-3 * $k ** 0.5 * $m)")" --warmup-epochs 2 --weight-decay 0.01
    run --optimizer lars --batch $batch --lr "$(python3 -c "print(2.0 * $k / 16 * $m)")" --warmup-epochs 2 --weight-decay 0.0005
  done
done
echo "large-batch study: $((SECONDS - start)) s for the runs" >&2
# matplotlib comes from Debian; a python3 earlier on PATH (pyenv, venv) may lack it.
py=${PYTHON:-/usr/bin/python3}
"$py" scripts/plot_large_batch.py "$out" docs/large-batch.png
