#!/usr/bin/env bash
# tests/cluster_slow_link.sh CLUSTER_SH TRAIN_GPT DATA OUT
#
# A slow link on an emulated cluster of 3 hosts x 1 rank (scripts/cluster.sh,
# 1 Gbit/s links), train_gpt launched by mpirun with its link probe every
# step (Note [Slow links]):
#  - clean links: no host is named, and every probe records each host;
#  - host 2's link shaped to a tenth (100 Mbit/s, both directions): the
#    progress lines name host 2 as the slow link and the metrics say so,
#    with a slowdown of at least 3 (the rule names from 2).
# Needs root; a skip (exit 77) otherwise.
set -uo pipefail
cluster=$1 train_gpt=$2 data=$3 out=$4
. "$(dirname "$0")/cluster_common.sh"
begin_cluster_test cs "$out"

trap 'bash "$cluster" down --name "$name" > /dev/null 2>&1' EXIT
bash "$cluster" up --name "$name" --hosts 3 --ranks 1 --rate 1gbit > /dev/null || {
  echo "FAIL: the cluster did not come up"
  exit 1
}
on_cluster() { timeout 300 bash "$cluster" run --name "$name" -- mpirun -np 3 "$@"; }
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
args=(--batch 6 --seq 32 --layers 2 --hidden 64 --heads 2 --data "$data" --sample 0 --eval-every 0 --steps 3
  --log-every 1 --link-probe-every 1)
slow_hosts() { grep '"kind":"links"' "$1" | grep -oE '"slow_host":-?[0-9]+' | cut -d: -f2 | tr '\n' ' '; }

on_cluster "$train_gpt" "${args[@]}" --metrics "$out/clean.jsonl" > "$out/clean.log" 2>&1 ||
  fail "train_gpt over clean links failed: $(tail -5 "$out/clean.log")"
[ "$(grep -c '"kind":"links"' "$out/clean.jsonl")" -eq 3 ] || fail "3 link probes expected in $out/clean.jsonl"
grep -q "slow link" "$out/clean.log" && fail "a host was named over clean links: $(grep -m1 'slow link' "$out/clean.log")"
[ "$(slow_hosts "$out/clean.jsonl")" = "-1 -1 -1 " ] || fail "clean links recorded slow hosts: $(slow_hosts "$out/clean.jsonl")"

bash "$cluster" shape --name "$name" --host 2 --rate 100mbit > /dev/null || fail "shaping host 2 was refused"
on_cluster "$train_gpt" "${args[@]}" --metrics "$out/slow.jsonl" > "$out/slow.log" 2>&1 ||
  fail "train_gpt with a slow link failed: $(tail -5 "$out/slow.log")"
line=$(grep -m1 "slow link: host $name-h2 " "$out/slow.log")
[ -n "$line" ] || fail "no progress line named $name-h2: $(grep -m1 'step' "$out/slow.log")"
[ "$(slow_hosts "$out/slow.jsonl")" = "2 2 2 " ] || fail "the metrics' slow hosts were $(slow_hosts "$out/slow.jsonl"), not 2 2 2"
slowdown=$(grep '"kind":"links"' "$out/slow.jsonl" | grep -oE '"slowdown":[0-9.]+' | cut -d: -f2 | sort -g | head -1)
awk -v s="$slowdown" 'BEGIN { exit !(s >= 3) }' || fail "the smallest slowdown was $slowdown, under 3"
echo "clean links: no host named in 3 probes; host 2 at 100 Mbit/s: named in 3 of 3 probes (smallest slowdown $slowdown): '${line##*| slow link}'"
[ $failures -eq 0 ] || exit 1
