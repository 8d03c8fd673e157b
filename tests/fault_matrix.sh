#!/usr/bin/env bash
# The fault matrix (docs/reliability.md): train_gpt at 4 ranks with one fault
# injected on purpose (TESSERA_FAULT, Note [Fault injection]) in a plain
# step, a pipeline step or a checkpoint save. For each kind:
#   - the job ends (or, slowed, finishes) within the timeout plus a margin;
#   - a message names the faulty rank: a surviving rank's (the flight records
#     read at its timeout), the faulty rank's own, or the launcher's;
#   - where ranks wrote flight records, tessera_trace puts that rank behind;
#   - the last complete checkpoint equals the fault-free run's at that step,
#     bit for bit, and an unfinished one is refused by name;
#   - resuming from it reaches the fault-free run's final state bit for bit
#     (once per step: an equal checkpoint resumes alike).
# Prints one table row per kind; any failed check fails the test.
#   fault_matrix.sh TRAIN_GPT TESSERA_TRACE CHECKPOINT_COMPARE MPIEXEC DATA OUT_DIR step|pipeline|save
set -u
train_gpt=$1 trace=$2 compare=$3 mpiexec=$4 data=$5 out=$6 case=$7
rm -rf "$out" && mkdir -p "$out"
timeout_s=3  # TESSERA_COMM_TIMEOUT
# A survivor gives up after the timeout, waits up to 5 s for the others'
# records, then up to 10 s for every rank to fail (Note [One rank's error]);
# start-up and teardown of 4 ranks on 2 cores take the rest.
margin=40
common=(--steps 6 --save-every 2 --batch 4 --seq 16 --layers 2 --hidden 32 --heads 2 --warmup 1 --eval-every 0
  --sample 0 --data "$data" --straggler-threshold 0.3)
# slow:20, not less: this tiny model's step computes for a few ms, and the
# test runs beside others (label waits), where a rank descheduled for 10 ms
# was named slowest instead of a rank slowed 4 times (seen in CI).
case $case in
  step) layout=(--dp 2 --tp 2) at=3 kinds=(kill stop hang:all_reduce slow:20 throw) ;;
  pipeline) layout=(--pp 2 --dp 2 --microbatches 2) at=3 kinds=(kill stop hang:batch_isend_irecv slow:20 throw) ;;
  save) layout=(--dp 2 --tp 2) at=4
    kinds=(kill@save stop@save hang:all_gather@save throw@save crash_file crash_index disk_full) ;;
  *) echo "unknown case $case"; exit 2 ;;
esac
failures=0
fail() { echo "FAIL ($case, $kind): $*"; failures=$((failures + 1)); }
run() {  # run NAME [ENV...] -- ARGS...: train_gpt at 4 ranks, output in $out/NAME.log
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" TESSERA_COMM_TIMEOUT=$timeout_s timeout $((timeout_s + margin + 60)) \
    "$mpiexec" -np 4 "$train_gpt" "${layout[@]}" "${common[@]}" "$@" > "$out/$name.log" 2>&1
}

kind=reference
run reference -- --save "$out/reference" || { cat "$out/reference.log"; fail "the fault-free run failed"; exit 1; }

echo "| kind | step type | exit | time to end (s) | message naming the faulty rank | flight records | last complete checkpoint | resumed |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for kind in "${kinds[@]}"; do
  rank=2
  [ "$kind" = crash_index ] && rank=0  # rank 0 writes the index
  name=${kind//[:@]/_}
  start=$(date +%s%N)
  run "$name" TESSERA_FAULT="$rank:$at:$kind" -- --save "$out/$name" --metrics "$out/$name.jsonl"
  status=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  log=$out/$name.log
  grep -q "world rank $rank: injected fault" "$log" || fail "the faulty rank did not announce the fault"
  [ "$status" -ne 124 ] || fail "the job did not end: killed by the test's timeout"
  [ "$ms" -le $(((timeout_s + margin) * 1000)) ] || fail "ended after $ms ms, past $timeout_s + $margin s"

  # The message naming the faulty rank, and the records.
  message="" records="none written"
  case $kind in
    slow*)
      [ "$status" -eq 0 ] || fail "a slowed run should finish, it ended with $status"
      message=$(grep -m1 -o "slowest rank $rank +[0-9]* ms" "$log") || fail "no progress line names rank $rank as slowest"
      ;;
    kill* | crash_file | crash_index)
      [ "$status" -ne 0 ] || fail "a killed rank's job ended with 0"
      message=$(grep -m1 -oE "process rank $rank with PID [0-9]+ on node [^ ]+ exited on signal 9" "$log") ||
        fail "the launcher's message does not name rank $rank"
      ;;
    disk_full)
      [ "$status" -ne 0 ] || fail "the job ended with 0"
      message=$(grep -m1 -oE "rank\(s\) $rank of the world could not write their file" "$log") ||
        fail "the save's message does not name rank $rank"
      ;;
    *)
      [ "$status" -ne 0 ] || fail "the job ended with 0"
      message=$(grep -m1 -oE "put world rank\(s\) $rank behind: [^;]*" "$log") ||
        fail "no surviving rank's message names world rank $rank"
      ;;
  esac
  if ls "$out/$name.jsonl.flight"/flight-rank-*.json > /dev/null 2>&1; then
    if "$trace" "$out/$name.jsonl.flight" > "$out/$name.trace" 2>&1; then
      records="$(head -1 "$out/$name.trace" | sed 's/flight records of \([0-9]*\) of \([0-9]*\).*/\1 of \2/'); $(grep -m1 '^behind:' "$out/$name.trace" || echo 'no rank behind')"
      case $kind in
        slow*) ;;
        disk_full) grep -q "no operation was left waiting" "$out/$name.trace" ||
          fail "every rank failed the save alike, yet tessera_trace found a wait: $(cat "$out/$name.trace")" ;;
        *) grep -qE "^behind: world rank\(s\) (.*, )?$rank(,|$)" "$out/$name.trace" ||
          fail "tessera_trace does not put rank $rank behind: $(cat "$out/$name.trace")" ;;
      esac
    else
      fail "tessera_trace failed: $(cat "$out/$name.trace")"
    fi
  fi

  # The last complete checkpoint, bit for bit; an unfinished one refused.
  last=$(ls -d "$out/$name"/step-?????? 2>/dev/null | tail -1)
  checkpoint="none"
  if [ -z "$last" ]; then
    fail "no complete checkpoint left"
  else
    step=$(basename "$last")
    if "$compare" "$last" "$out/reference/$step" > "$out/$name.compare" 2>&1; then
      checkpoint="$step equal"
    else
      fail "$step differs from the fault-free run's: $(cat "$out/$name.compare")"
      checkpoint="$step differs"
    fi
    partial=$(ls -d "$out/$name"/*.partial 2>/dev/null | head -1)
    if [ -n "$partial" ]; then
      "$compare" "$partial" "$out/reference/$step" > "$out/$name.partial" 2>&1
      [ $? -eq 2 ] && grep -q "partial" "$out/$name.partial" ||
        fail "$partial was not refused by name: $(cat "$out/$name.partial")"
      checkpoint+="; $(basename "$partial") refused"
    fi
  fi

  # Resume from it; the final state must be the fault-free run's. A
  # checkpoint equal bit for bit to one an earlier kind resumed from (both
  # equal the fault-free run's at that step) resumes to the same state, so
  # it is resumed once per step: the runs cost a third of the test.
  resumed="-"
  if [ "$status" -ne 0 ] && [ -n "$last" ] && [ -n "$(grep -o "^$step=.*" "$out/resumed_steps" 2>/dev/null)" ] &&
    [[ $checkpoint == "$step equal"* ]]; then
    resumed="from $step: as $(grep -m1 -o "^$step=.*" "$out/resumed_steps" | cut -d= -f2)'s (checkpoint equal)"
  elif [ "$status" -ne 0 ] && [ -n "$last" ]; then
    run "$name.resume" -- --resume "$last" --save "$out/$name.resumed" || fail "the resumed run failed: $(tail -5 "$out/$name.resume.log")"
    if "$compare" "$out/$name.resumed/final" "$out/reference/final" > "$out/$name.resume.compare" 2>&1; then
      resumed="from $step: final equal"
      echo "$step=$kind" >> "$out/resumed_steps"
    else
      fail "the resumed run's final state differs: $(cat "$out/$name.resume.compare")"
    fi
  elif [ "$status" -eq 0 ]; then
    "$compare" "$out/$name/final" "$out/reference/final" > "$out/$name.final.compare" 2>&1 &&
      resumed="not needed: final equal" || fail "the slowed run's final state differs: $(cat "$out/$name.final.compare")"
  fi
  echo "| $kind | $case | $status | $((ms / 1000)).$((ms % 1000 / 100)) | ${message:-?} | $records | $checkpoint | $resumed |"
done
[ "$failures" -eq 0 ] || { echo "FAIL: $failures check(s) failed; logs in $out"; exit 1; }
echo "PASS: every fault of the $case case ended the job in time, named rank, kept the last checkpoint and resumed bit for bit"
