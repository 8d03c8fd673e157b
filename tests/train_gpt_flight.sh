#!/usr/bin/env bash
# train_gpt's flight records and rank times (docs/reliability.md): a clean
# run writes every rank's times into its metrics and no record; a run that
# fails after the world is made writes every rank's record beside its
# metrics, and tessera_trace reads them.
#   train_gpt_flight.sh TRAIN_GPT TESSERA_TRACE MPIEXEC DATA OUT_DIR
set -u
train_gpt=$1 trace=$2 mpiexec=$3 data=$4 out=$5
rm -rf "$out" && mkdir -p "$out"
common=(--steps 3 --batch 4 --seq 16 --layers 2 --hidden 32 --heads 2 --warmup 1 --eval-every 0 --sample 0 --data "$data")
fail() { echo "FAIL: $*"; exit 1; }

timeout 120 "$mpiexec" -np 2 "$train_gpt" "${common[@]}" --tp 2 --rank-times --metrics "$out/ok.jsonl" || fail "the clean run failed"
[ "$(grep -c '"kind":"ranks"' "$out/ok.jsonl")" -eq 3 ] || fail "expected 3 ranks lines in $out/ok.jsonl"
grep '"kind":"ranks"' "$out/ok.jsonl" | grep -qE '"compute_s":\[[0-9.e-]+,[0-9.e-]+\],"wait_s":\[[0-9.e-]+,[0-9.e-]+\]' ||
  fail "a ranks line without two compute and two wait times: $(grep -m1 '"kind":"ranks"' "$out/ok.jsonl")"
grep '"kind":"train"' "$out/ok.jsonl" | grep -q '"slowest_rank":[01]' || fail "train lines without slowest_rank"
[ -z "$(ls "$out/ok.jsonl.flight" 2>/dev/null)" ] || fail "a clean run wrote flight records: $(ls "$out/ok.jsonl.flight")"

timeout 120 "$mpiexec" -np 2 "$train_gpt" "${common[@]}" --metrics "$out/err.jsonl" --resume /nonexistent/ckpt > "$out/err.log" 2>&1
status=$?
cat "$out/err.log"
[ $status -ne 0 ] && [ $status -ne 124 ] || fail "the run with a missing checkpoint should fail, not end with $status"
for r in 0 1; do
  grep -q '"reason": "error: .*does not exist' "$out/err.jsonl.flight/flight-rank-$r.json" || fail "rank $r's record is missing or gives no reason"
done
"$trace" "$out/err.jsonl.flight" > "$out/trace.txt" || fail "tessera_trace failed"
cat "$out/trace.txt"
grep -q "flight records of 2 of 2 ranks read" "$out/trace.txt" || fail "tessera_trace did not read both records"
grep -q "no operation was left waiting" "$out/trace.txt" || fail "tessera_trace found a wait in a run that failed alike on every rank"
echo "PASS: rank times in the metrics; on an error every rank's record beside them, read by tessera_trace"
