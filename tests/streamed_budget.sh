#!/usr/bin/env bash
# streamed_budget.sh TESSERA_GENERATE PYTHON WORK_DIR MPIEXEC
#
# tessera_generate keeps its --max-memory budget as the kernel counts it:
# on 290 MiB of weights (constant values), more than the budget leaves
# beside what the process holds before it reads any (LibTorch's code: 200
# MiB with 1.13, 400 with 2.x), the budget it names as the smallest that
# works, then that budget; the peak resident size (VmHWM) it reports must be
# within it, the weights streamed.
set -euo pipefail
generate=$1 python=$2 dir=$3 mpiexec=$4
mkdir -p "$dir"
"$python" "$(dirname "$0")/make_gpt_file.py" "$dir/gpt.safetensors" 6 1024 16 256 64
args=(--weights "$dir/gpt.safetensors" --prompt 1,2,3 --tokens 4 --temperature 0)
# The smallest budget is named for the budget asked (its allocator margin
# is a twentieth of it), so the next try asks 8% more.
budget=1M ran=0
for attempt in 1 2 3 4 5 6; do
  if "$mpiexec" -np 1 "$generate" "${args[@]}" --max-memory "$budget" > "$dir/out.json" 2> "$dir/err.txt"; then
    ran=1
    break
  fi
  smallest=$(grep -o 'The smallest budget that works is [0-9.]* MiB' "$dir/err.txt" | grep -o '[0-9.]*' | tail -1) || {
    cat "$dir/err.txt"; exit 1; }
  budget=$(awk -v m="$smallest" 'BEGIN { printf "%dM", int(m * 1.08) + 1 }')
  echo "attempt $attempt: refused, the smallest budget named is $smallest MiB; trying $budget"
done
[[ $ran == 1 ]] || { echo "no budget it named was accepted"; cat "$dir/err.txt"; exit 1; }
cat "$dir/out.json"
"$python" - "$dir/out.json" "$budget" <<'PY'
import json, sys
line = [l for l in open(sys.argv[1]) if l.startswith("{")][-1]
r = json.loads(line)
budget = int(sys.argv[2].rstrip("M")) * 2**20
peak = r["peak_rss_bytes"]
print(f"budget {budget / 2**20:.1f} MiB, peak resident {peak / 2**20:.1f} MiB, resident weights: {r['resident']}")
assert not r["resident"], "the weights must be streamed under this budget"
assert 0 < peak <= budget, f"peak resident {peak} bytes exceeds the budget {budget}"
PY
