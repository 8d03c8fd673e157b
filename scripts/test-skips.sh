#!/usr/bin/env bash
# scripts/test-skips.sh BUILD_DIR
#
# The skips of the last ctest run in BUILD_DIR, per rank count: each gtest
# case that had nothing to run at that rank count (the "[tessera-skip]" lines
# of tests/support/mpi_test_main.cpp) with its CTest test and reason, and the
# CTest tests that ran nothing at all (shown by CTest as "Skipped").
set -euo pipefail
log="${1:?usage: test-skips.sh BUILD_DIR}/Testing/Temporary/LastTest.log"
[[ -f "$log" ]] || { echo "test-skips.sh: no $log (run ctest first)" >&2; exit 1; }
awk '
  /^[0-9]+\/[0-9]+ Test: / { test = $3 }
  /^\[tessera-skip\] np[0-9]+/ {
    np = substr($2, 3) + 0
    line = $0; sub(/^\[tessera-skip\] np[0-9]+:? */, "", line)
    name = line; reason = ""
    if (index(line, ": ")) { name = substr(line, 1, index(line, ": ") - 1); reason = substr(line, index(line, ": ") + 2) }
    key = np SUBSEP test SUBSEP reason
    if (!(key in n)) { order[np, ++rows[np]] = key; first[key] = name }
    n[key]++
    count[np]++
    total++
  }
  END {
    if (!total) { print "Skips: none"; exit }
    printf "Skips: %d gtest cases with nothing to run at their rank count (count x reason, first case):\n", total
    for (np = 1; np <= 64; np++) {
      if (!count[np]) continue
      printf "np%d: %d skipped\n", np, count[np]
      for (i = 1; i <= rows[np]; i++) {
        key = order[np, i]; split(key, part, SUBSEP)
        printf "  %-22s %3d x %s (%s)\n", part[2], n[key], part[3] == "" ? "no test ran" : part[3], first[key]
      }
    }
  }' "$log"
