#!/usr/bin/env bash
# tests/cluster_faults.sh CLUSTER_SH TRAIN_GPT DATA OUT
#
# Faults on the network of an emulated cluster of 2 hosts x 2 ranks
# (scripts/cluster.sh, 1 Gbit/s links), train_gpt launched by mpirun:
#  - loss and delay: 1 % of the packets dropped in each direction of every
#    host's link (nftables; the counters must show drops) and every packet
#    held 10 ms where it arrives (the round trip between the hosts, timed
#    by a small TCP exchange, must be 20 ms or more): the losses and
#    gradient norms of 3 steps equal those over a clean link bit for bit;
#  - a cut link: host 1's link taken down 3 steps into a run under
#    TESSERA_COMM_TIMEOUT=3: mpirun ends with an error well within the
#    test's limit, the log names the operation that did not complete and a
#    peer on host 1, every rank's flight record is written, and no rank is
#    left running on either host.
# Needs root, nft, iptables, a C compiler and libnetfilter_queue (the
# delay: Note [Delay without netem] in scripts/cluster.sh); a skip (exit
# 77) otherwise.
set -uo pipefail
cluster=$1 train_gpt=$2 data=$3 out=$4
. "$(dirname "$0")/cluster_common.sh"
begin_cluster_test cf "$out"
command -v nft > /dev/null || skip "packet loss needs nft (scripts/install-deps.sh installs nftables)"
command -v iptables > /dev/null && command -v cc > /dev/null &&
  [ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ] ||
  skip "the delay needs iptables, cc and libnetfilter-queue-dev (scripts/install-deps.sh installs them)"
# A kernel without nf_tables' netdev family cannot drop packets on a link.
ip netns add "$name-probe" && ip netns exec "$name-probe" nft add table netdev probe 2> "$out/probe.log" || {
  ip netns del "$name-probe" 2> /dev/null
  skip "this kernel refuses nftables' netdev tables, which drop the packets: $(cat "$out/probe.log")"
}
ip netns del "$name-probe"

trap 'bash "$cluster" down --name "$name" > /dev/null 2>&1' EXIT
bash "$cluster" up --name "$name" --hosts 2 --ranks 2 --rate 1gbit > /dev/null || {
  echo "FAIL: the cluster did not come up"
  exit 1
}
run() { bash "$cluster" run --name "$name" -- mpirun -np 4 "$@"; }
on_cluster() { timeout 300 bash "$cluster" run --name "$name" -- mpirun -np 4 "$@"; }
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
args=(--batch 8 --seq 32 --layers 2 --hidden 64 --heads 2 --data "$data" --sample 0 --eval-every 0)
losses() { grep '"kind":"train"' "$1" | grep -oE '"(loss|grad_norm)":[^,]*'; }

# Loss and delay: the same numbers as over a clean link.
on_cluster "$train_gpt" "${args[@]}" --steps 3 --metrics "$out/clean.jsonl" > "$out/clean.log" 2>&1 ||
  fail "train_gpt over clean links failed: $(tail -5 "$out/clean.log")"
for host in 0 1; do
  bash "$cluster" shape --name "$name" --host "$host" --rate 1gbit --loss 1 --delay 10 > "$out/shape.log" 2>&1 ||
    fail "--loss 1 --delay 10 was refused: $(cat "$out/shape.log")"
done
# The round trip between the hosts: the median of 10 one-byte exchanges
# over TCP, in ms (the server on host 1, the client on host 0).
rtt() {
  local code='
import socket, sys, time
if sys.argv[1] == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 7311)); s.listen(1); s.settimeout(30)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(64)): c.sendall(d)
else:
    for _ in range(200):
        try:
            c = socket.create_connection((sys.argv[2], 7311)); break
        except OSError:
            time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = []
    for _ in range(10):
        t0 = time.perf_counter(); c.sendall(b"x"); c.recv(64); t.append(time.perf_counter() - t0)
    print("%.1f" % (sorted(t)[5] * 1e3))
'
  bash "$cluster" run --name "$name" --host 1 -- python3 -c "$code" serve &
  local server=$!
  bash "$cluster" run --name "$name" --host 0 -- python3 -c "$code" client "$name-h1"
  wait $server
}
delayed_rtt=$(rtt)
awk -v r="$delayed_rtt" 'BEGIN { exit !(r >= 20) }' ||
  fail "the round trip between the hosts took '$delayed_rtt' ms under a 10 ms delay each way (at least 20 expected)"
on_cluster "$train_gpt" "${args[@]}" --steps 3 --metrics "$out/lossy.jsonl" > "$out/lossy.log" 2>&1 ||
  fail "train_gpt over links losing 1 % and delayed 10 ms failed: $(tail -5 "$out/lossy.log")"
dropped=0
for ns in "$name-h0:eth0" "$name-h1:eth0" "$name-sw:h0" "$name-sw:h1"; do
  n=$(ip netns exec "${ns%%:*}" nft list table netdev "loss_${ns##*:}" 2> /dev/null | grep -oE 'packets [0-9]+' |
    awk '{s += $2} END {print s + 0}')
  dropped=$((dropped + n))
done
[ "$dropped" -gt 0 ] || fail "no packet was dropped: the loss rules did not act"
[ "$(losses "$out/clean.jsonl" | wc -l)" -eq 6 ] || fail "train_gpt over clean links logged no 3 steps"
[ "$(losses "$out/lossy.jsonl")" = "$(losses "$out/clean.jsonl")" ] ||
  fail "losses over lossy, delayed links differ: $(losses "$out/lossy.jsonl" | tr '\n' ' ') against $(losses "$out/clean.jsonl" | tr '\n' ' ')"
for host in 0 1; do bash "$cluster" shape --name "$name" --host "$host" --rate 1gbit > /dev/null; done
# Each host's delay program said, as it stopped, what it held.
held=$(cat /run/tessera-cluster/"$name"/delay-*.log 2> /dev/null | grep -oE 'held [0-9]+ packets, [0-9.]+ ms on average \([0-9]+ socket overflows\)' | paste -sd '|' | sed 's/|/; /g')
clean_rtt=$(rtt)
summary="1 % loss each way on both links ($dropped packets dropped) and 10 ms delay (round trip $delayed_rtt ms, $clean_rtt ms without; $held): losses equal a clean link's bit for bit"

# A cut link: every rank ends, the survivors' messages name the operation and host 1.
TESSERA_COMM_TIMEOUT=3 run "$train_gpt" "${args[@]}" --steps 100000 --log-every 1 --metrics "$out/cut.jsonl" \
  > "$out/cut.log" 2>&1 &
job=$!
for _ in $(seq 1200); do
  [ "$(cat "$out/cut.jsonl" 2> /dev/null | grep -c '"kind":"train"')" -ge 3 ] && break
  kill -0 $job 2> /dev/null || break
  sleep 0.1
done
bash "$cluster" link --name "$name" --host 1 down > /dev/null
cut=$(date +%s)
ended=0
for _ in $(seq 1200); do
  kill -0 $job 2> /dev/null || { ended=1; break; }
  sleep 0.1
done
if [ $ended -eq 0 ]; then
  fail "mpirun did not end within 120 s of the cut"
  kill -9 $job 2> /dev/null
fi
wait $job
status=$?
took=$(($(date +%s) - cut))
[ $status -ne 0 ] || fail "mpirun exited 0 after the cut"
grep -q "did not complete within 3 s" "$out/cut.log" ||
  fail "no rank said which operation did not complete: $(tail -5 "$out/cut.log")"
grep -qE "world [0-9]+ on $name-h1" "$out/cut.log" || fail "no message named a peer on $name-h1: $(tail -5 "$out/cut.log")"
records=$(ls "$out/cut.jsonl.flight"/flight-rank-*.json 2> /dev/null | wc -l)
[ "$records" -eq 4 ] || fail "$records of 4 flight records written"
sleep 2
for host in 0 1; do
  left=$(ip netns pids "$name-h$host" 2> /dev/null | xargs -r ps -o comm= -p | grep -c train_gpt)
  [ "$left" -eq 0 ] || fail "$left rank(s) of train_gpt still running on host $host after mpirun ended"
done
message=$(grep -m1 -oE "[a-z_]+ #[0-9]+ on communicator '[^']+' \([^)]*\) did not complete within 3 s" "$out/cut.log")
summary+="; host 1's link cut: mpirun ended (exit $status) $took s later, '$message', naming peers on $name-h1; 4 of 4 flight records; no rank left"
echo "$summary"
[ $failures -eq 0 ] || exit 1
