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
# Killed between moving step-1 away and moving its replacement in: the
# reader refuses step-1 naming step-1.old, and the next save into step-1
# puts step-1.old back first, so that save dying too still leaves step-1.
"$mpiexec" -np 2 "$prog" crash-replace "$work/step-1" && { echo "FAIL: the replacing save did not crash"; exit 1; }
ls -R "$work"
[ ! -e "$work/step-1" ] && [ -f "$work/step-1.old/index.json" ] && [ -f "$work/step-1.partial/index.json" ] ||
  { echo "FAIL: expected step-1.old and a complete step-1.partial without step-1"; exit 1; }
"$mpiexec" -np 2 "$prog" check-replaced "$work/step-1" || { echo "FAIL: check-replaced"; exit 1; }
"$mpiexec" -np 2 "$prog" crash "$work/step-1" && { echo "FAIL: the crashing save did not crash"; exit 1; }
ls -R "$work"
[ -f "$work/step-1/index.json" ] && [ ! -e "$work/step-1.old" ] ||
  { echo "FAIL: the save after the interrupted one did not put step-1.old back"; exit 1; }
"$mpiexec" -np 2 "$prog" check "$work/step-1" "$work/step-1.partial" || { echo "FAIL: check after recovery"; exit 1; }
"$mpiexec" -np 2 "$prog" save "$work/step-1" || { echo "FAIL: the save after recovery failed"; exit 1; }
[ -f "$work/step-1/index.json" ] && [ ! -e "$work/step-1.old" ] && [ ! -e "$work/step-1.partial" ] ||
  { echo "FAIL: a finished save left step-1.old or step-1.partial"; exit 1; }
echo "PASS: step-1 loads, step-2 (killed mid-save) is refused, a save killed between its renames is refused"
echo "      clearly and recovered by the next save"
