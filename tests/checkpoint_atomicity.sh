#!/usr/bin/env bash
# A rank killed in the middle of a checkpoint save: the earlier checkpoint
# still loads and the unfinished one is refused with a clear message.
#   checkpoint_atomicity.sh CHECKPOINT_CRASH MPIEXEC WORK_DIR
set -u
prog=$1 mpiexec=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
"$mpiexec" -np 2 "$prog" save "$work/step-1" || { echo "FAIL: the first save failed"; exit 1; }
"$mpiexec" -np 2 "$prog" crash "$work/step-2" && { echo "FAIL: the crashing save did not crash"; exit 1; }
ls -R "$work"
[ -f "$work/step-1/index.json" ] || { echo "FAIL: step-1 lost its index"; exit 1; }
[ ! -e "$work/step-2" ] || { echo "FAIL: step-2 exists although its save died"; exit 1; }
"$mpiexec" -np 2 "$prog" check "$work/step-1" "$work/step-2" || { echo "FAIL: check"; exit 1; }
echo "PASS: step-1 loads, step-2 (killed mid-save) is refused"
