#!/usr/bin/env bash
# Runs every fuzz target (fuzz/, docs/fuzzing.md) under libFuzzer: the clang
# build with TESSERA_FUZZ=ON and AddressSanitizer that `make test-sanitize`
# uses too, in BUILD_DIR (configured here when missing); RUNS executions per
# target from the committed seed corpus, new inputs kept in OUT_DIR/NAME (not in the committed corpus: minimise and copy
# what is worth keeping). Prints one line per target: executions, seconds,
# coverage (libFuzzer's cov and ft), corpus size, and findings (crash-*,
# timeout-*, oom-* files in OUT_DIR).
#
#   [FUZZ_TARGETS=...] scripts/fuzz.sh [BUILD_DIR] [RUNS] [OUT_DIR]     (default build-sanitize, 1000000, fuzz-out)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-sanitize}
runs=${2:-1000000}
out=${3:-fuzz-out}
# FUZZ_TARGETS: a subset, e.g. to run targets side by side on several cores.
read -r -a targets <<< "${FUZZ_TARGETS:-fuzz_safetensors fuzz_checkpoint_index fuzz_config_text fuzz_cli}"
ASAN_BUILD=$build scripts/test-sanitize.sh configure
cmake --build "$build" -j "${JOBS:-2}" --target "${targets[@]}"
mkdir -p "$out"
status=0
for t in "${targets[@]}"; do
  mkdir -p "$out/$t"
  log="$out/$t.log"
  # -rss_limit_mb: an input that makes a parser allocate more than this is a
  # finding (oom-*); -timeout: one that takes longer than this (timeout-*).
  if ! "$build/fuzz/$t" -runs="$runs" -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 -max_len=4096 \
      -print_final_stats=1 -artifact_prefix="$out/" "$out/$t" "fuzz/corpus/$t" > "$log" 2>&1; then
    status=1
  fi
  python3 - "$t" "$log" "$out" <<'PY'
import glob, os, re, sys
name, log, out = sys.argv[1:4]
text = open(log, errors="replace").read()
done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)", text)
runs = re.findall(r"stat::number_of_executed_units: (\d+)", text)
secs = re.findall(r"Done (\d+) runs in (\d+) second", text)
findings = [os.path.basename(f) for f in glob.glob(os.path.join(out, "*-*")) if re.match(r"(crash|timeout|oom|leak)-", os.path.basename(f))]
if done:
    n, cov, ft, corp = done[-1]
    print(f"{name}: {runs[-1] if runs else n} executions in {secs[-1][1] if secs else '?'} s, cov {cov}, ft {ft}, "
          f"corpus {corp}, findings {len(findings)}")
else:
    tail = "\n".join(text.splitlines()[-30:])
    print(f"{name}: stopped early (a finding):\n{tail}")
PY
done
exit $status
