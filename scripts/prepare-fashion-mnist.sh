#!/usr/bin/env bash
# Fashion-MNIST's idx files, uncompressed into BUILD_DIR/fashion-mnist from
# Debian's dataset-fashion-mnist, and train_fashion_mnist built: what the
# studies of docs/large-batch.md and docs/elastic.md start from.
#   scripts/prepare-fashion-mnist.sh BUILD_DIR [EXTRA_DEBIAN_PACKAGES...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1; shift
scripts/install-deps.sh dataset-fashion-mnist "$@"
data=$build/fashion-mnist
mkdir -p "$data"
for f in /usr/share/datasets/fashion-mnist/*-ubyte.gz; do
  out=$data/$(basename "$f" .gz)
  [ -s "$out" ] || gunzip -c "$f" > "$out"
done
[ -f "$build/CMakeCache.txt" ] || cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "${JOBS:-2}" --target train_fashion_mnist
