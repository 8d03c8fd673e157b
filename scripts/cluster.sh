#!/usr/bin/env bash
# scripts/cluster.sh: a cluster of H hosts on this machine (docs/cluster.md).
#
#   cluster.sh up [--name N] [--hosts H] [--ranks R] [--rate RATE] [--delay MS] [--loss PCT] [--slurm]
#   cluster.sh run [--name N] [--host I] -- COMMAND...
#   cluster.sh shape [--name N] --host I [--rate RATE] [--delay MS] [--loss PCT]
#   cluster.sh link [--name N] --host I down|up
#   cluster.sh down [--name N]
#   cluster.sh status [--name N]
#
# Note [The default link]
# 20 Mbit/s per host keeps this machine's ratio of compute to the link
# between hosts that of an H100 node with 8 x 400 Gb/s InfiniBand: there,
# 989 TFLOP/s (bf16, dense) per GPU over 50 GB/s is about 20,000 FLOP per
# byte; here a rank of a 2 x 2 cluster on 2 cores computes 12.7 GFLOP/s
# (fp32), so 2 ranks per host over 2 x 12.7e9 / 20,000 = 1.3 MB/s, doubled
# for fp32 gradients where the H100 sends bf16: 2.5 MB/s = 20 Mbit/s
# (docs/cluster.md).
#
# Each host is a network namespace N-hI with its own hostname (a UTS
# namespace entered with it), one interface eth0 at 10.231.0.(I+1)/24, and a
# link to a switch (a bridge in the namespace N-sw) shaped by tc in both
# directions. Nothing is added to the machine's own namespace: every address
# lives inside the cluster's namespaces, and `down` removes them all.
#
# `run` runs COMMAND on host I (0 by default) with Open MPI told how to reach
# the others: mpirun's rsh launcher enters a host's namespace through a
# generated agent (Note [Launching into a namespace] below), the default
# hostfile lists every host with R slots, and TCP is confined to eth0. Ranks
# on one host talk through shared memory, ranks on two through TCP.
#
# With --slurm, `up` also starts Slurm: munged (its own key and socket),
# slurmctld on host 0 and one slurmd inside each host, with R CPUs each; `run`
# then has SLURM_CONF set, so `srun --mpi=pmix -N H -n H*R PROGRAM` launches
# across the hosts (Note [Slurm in namespaces]).
set -Eeuo pipefail

die() {
  echo "cluster.sh: $*" >&2
  exit 2
}

cmd="${1:-}"
[[ -n "$cmd" ]] || die "usage: cluster.sh up|run|shape|down|status [options] (see the head of this script)"
shift

name=tsr
hosts=2
ranks=2
rate=20mbit  # Note [The default link]
delay=""
loss=""
host=0
slurm=0
state_arg=""
while [[ $# -gt 0 ]]; do
  case "$1" in
  --name) name="$2"; shift 2 ;;
  --hosts) hosts="$2"; shift 2 ;;
  --ranks) ranks="$2"; shift 2 ;;
  --rate) rate="$2"; shift 2 ;;
  --delay) delay="$2"; shift 2 ;;
  --loss) loss="$2"; shift 2 ;;
  --host) host="$2"; shift 2 ;;
  --slurm) slurm=1; shift ;;
  down | up) state_arg="$1"; shift ;;
  --) shift; break ;;
  *) die "unknown option '$1' for '$cmd' (see the head of scripts/cluster.sh)" ;;
  esac
done

[[ "$name" =~ ^[a-z][a-z0-9]{0,7}$ ]] ||
  die "--name '$name' must be 1 to 8 lowercase letters and digits, starting with a letter (it prefixes namespace names)"
state="/run/tessera-cluster/$name"
switch="$name-sw"

host_ns() { echo "$name-h$1"; }

# tc's rate syntax (kbit, mbit, gbit) to bytes per second, for the burst.
rate_bytes() {
  local r="$1" n unit
  [[ "$r" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "--rate '$r' must be a number followed by kbit, mbit or gbit (e.g. 1gbit)"
  n="${BASH_REMATCH[1]}"
  unit="${BASH_REMATCH[2]}"
  case "$unit" in
  kbit) echo $((n * 1000 / 8)) ;;
  mbit) echo $((n * 1000000 / 8)) ;;
  gbit) echo $((n * 1000000000 / 8)) ;;
  esac
}

# Shapes one direction of a link: DEV inside namespace NS.
# Note [Shaping a link]
# tbf limits the rate. Its bucket holds 2 ms at the rate (at least 64 KiB, so
# that a veth's 64 KiB segments pass), which lets a message shorter than that
# leave at once, as on a real link whose serialization time is that short.
# Loss is dropped by nftables where a packet arrives (a netdev ingress rule
# on DEV drawing a random number per packet), so it needs no netem: with
# DEV the host's eth0 and the switch's port, each direction of the link
# loses PCT % of its packets, sent one MTU each (gso_max_segs 1) while a
# loss is set. Delay is the host's (delay_host below).
shape_dev() {
  local ns="$1" dev="$2" bytes burst
  bytes=$(rate_bytes "$rate")
  burst=$((bytes / 500))
  ((burst >= 65536)) || burst=65536
  ip -n "$ns" link set "$dev" up
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 200ms
  ip netns exec "$ns" nft delete table netdev "loss_$dev" 2>/dev/null || true
  # A veth passes TCP's 64 KiB segments whole; under loss each frame must be
  # one packet of the MTU, as on a wire, or a drop would take 44 of them.
  ip -n "$ns" link set "$dev" gso_max_segs "$([[ -n "$loss" ]] && echo 1 || echo 65535)"
  if [[ -n "$loss" ]]; then
    local per100k
    per100k=$(awk -v p="$loss" 'BEGIN { if (p !~ /^[0-9]+(\.[0-9]+)?$/ || p + 0 > 100) exit 1; printf "%d", p * 1000 + 0.5 }') ||
      die "--loss '$loss' must be a percentage from 0 to 100 (e.g. 1)"
    command -v nft >/dev/null || die "--loss needs nft (Debian package nftables)"
    ip netns exec "$ns" nft -f - <<EOF || die "nftables refused the loss rule on $dev in $ns (the kernel needs nf_tables with the netdev family)"
table netdev loss_$dev {
  chain ingress {
    type filter hook ingress device "$dev" priority 0; policy accept;
    numgen random mod 100000 < $per100k counter drop
  }
}
EOF
  fi
}

# Note [Delay without netem]
# netem, the usual way to delay a link, is missing from some kernels (this
# machine's among them: 'tc qdisc add ... netem' is "unknown"), and so is fq,
# which could release packets at a time a BPF program stamps. What the
# kernel does have is netfilter's queue to user space: a packet handed to
# NFQUEUE waits in the kernel until a program says what to do with it. So
# each host's packets arriving on eth0 go to queue 0 of its namespace
# (iptables' raw PREROUTING), where scripts/link_delay.c, one per host,
# accepts each DELAY ms after it arrived, in arrival order. Every packet
# between two hosts then waits DELAY once (a round trip 2 DELAY), after the
# rate's token buckets and the loss rule. The wait is at the receiver
# because a sender's own TCP counts a packet held in its stack as still
# queued (TCP small queues) and would throttle itself to a trickle; on the
# far side of the veth the packet no longer belongs to the socket. Only the
# packets' ids cross to the program; with no program bound to the queue
# the kernel drops what reaches it, so a delay that failed cannot pass
# unnoticed as a clean link.
delay_helper() {
  local bin="$state/link_delay" src
  src="$(dirname "${BASH_SOURCE[0]}")/link_delay.c"
  [[ -x "$bin" ]] && return 0
  command -v iptables >/dev/null && command -v cc >/dev/null && [[ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ]] ||
    die "--delay needs iptables, a C compiler and libnetfilter_queue (Debian packages iptables, gcc, libnetfilter-queue-dev; scripts/install-deps.sh installs them)"
  cc -O2 -o "$bin" "$src" -lnetfilter_queue -lnfnetlink 2>"$state/link_delay.build.log" ||
    die "building $src failed: $(tail -3 "$state/link_delay.build.log")"
}

# Sets host NS's delay to $delay ms (none when empty or 0).
delay_host() {
  local ns="$1" ready="$state/delay-$1.pid" pid
  # Rule out first, then the program, which lets what it holds go.
  ip netns exec "$ns" iptables -t raw -D PREROUTING -i eth0 -j NFQUEUE --queue-num 0 2>/dev/null || true
  if [[ -s "$ready" ]]; then
    pid=$(cat "$ready")
    kill "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
    rm -f "$ready"
  fi
  [[ -n "$delay" && "$delay" != 0 && "$delay" != 0.0 ]] || return 0
  delay_helper
  local us
  us=$(awk -v d="$delay" 'BEGIN { printf "%d", d * 1000 + 0.5 }')
  ip netns exec "$ns" setsid "$state/link_delay" 0 "$us" "$ready" >>"$state/delay-$ns.log" 2>&1 </dev/null &
  local tries
  for ((tries = 0; tries < 100; tries++)); do
    [[ -s "$ready" ]] && break
    sleep 0.05
  done
  [[ -s "$ready" ]] || die "the delay program did not start on $ns: $(tail -3 "$state/delay-$ns.log")"
  ip netns exec "$ns" iptables -t raw -A PREROUTING -i eth0 -j NFQUEUE --queue-num 0 ||
    die "iptables refused the delay's queue rule on $ns (the kernel needs NFQUEUE and nfnetlink_queue)"
}

# Note [Slurm in namespaces]
# Every daemon is this cluster's own: munged with a key made for it and a
# socket in the state directory (Slurm reaches it through AuthInfo), and
# slurmctld and the slurmds with a configuration in the state directory,
# their spool, state, logs and pid files there too. slurmctld runs on host 0
# and each slurmd inside its host's namespaces under that host's name, so
# that what srun starts (through slurmstepd) is on that host. Processes are
# tracked without cgroups (proctrack/linuxproc, task/none): the namespaces
# are the only isolation. Yet slurmd 22.05 will not start without a cgroup
# plugin, and `ip netns exec` mounts a fresh /sys without the cgroup
# hierarchies: each slurmd mounts the v1 ones it needs in its own mount
# namespace (cgroup/v1, nothing created in them by these plugins). Each
# slurmd also has a /tmp of its own, as a real host has: PMIx makes
# directories there named by job and step alone.
# SlurmdParameters=config_overrides lets a host declare R CPUs on a machine
# with fewer.
slurm_up() {
  local tool
  for tool in munged mungekey slurmctld slurmd srun sinfo; do
    command -v "$tool" >/dev/null || die "--slurm needs $tool (Debian packages munge, slurmctld, slurmd, slurm-client)"
  done
  local conf="$state/slurm.conf" i ns
  mkdir -p "$state/slurm/ctld" "$state/slurm/spool"
  mungekey --create --keyfile="$state/munge.key" --force
  chmod 0400 "$state/munge.key"
  ip netns exec "$switch" munged --force --key-file="$state/munge.key" --socket="$state/munge.socket" \
    --pid-file="$state/munged.pid" --log-file="$state/munged.log" --seed-file="$state/munge.seed"
  {
    echo "ClusterName=$name"
    echo "SlurmctldHost=$(host_ns 0)(10.231.0.1)"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$state/munge.socket"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "SlurmctldPort=6817"
    echo "SlurmdPort=6818"
    echo "StateSaveLocation=$state/slurm/ctld"
    echo "SlurmdSpoolDir=$state/slurm/spool/%n"
    echo "SlurmctldPidFile=$state/slurm/slurmctld.pid"
    echo "SlurmdPidFile=$state/slurm/slurmd-%n.pid"
    echo "SlurmctldLogFile=$state/slurm/slurmctld.log"
    echo "SlurmdLogFile=$state/slurm/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "MpiDefault=pmix"
    echo "SwitchType=switch/none"
    echo "SchedulerType=sched/builtin"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "MailProg=/bin/true"
    echo "PropagateResourceLimits=NONE"
    for ((i = 0; i < hosts; i++)); do
      echo "NodeName=$(host_ns "$i") NodeAddr=10.231.0.$((i + 1)) CPUs=$ranks State=UNKNOWN"
    done
    echo "PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
  } >"$conf"
  echo "CgroupPlugin=cgroup/v1" >"$state/cgroup.conf"
  in_host 0 slurmctld -c -f "$conf" || die "slurmctld did not start: $(tail -3 "$state/slurm/slurmctld.log" 2>/dev/null)"
  for ((i = 0; i < hosts; i++)); do
    ns=$(host_ns "$i")
    mkdir -p "$state/slurm/spool/$ns" "$state/tmp/$ns"
    ip netns exec "$ns" unshare --uts /bin/sh -c 'mount --bind "$2" /tmp && mount -t tmpfs cgroup /sys/fs/cgroup &&
      for c in freezer cpuset memory devices; do
        mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || exit 1
      done && hostname "$0" && exec slurmd -f "$1" -N "$0"' "$ns" "$conf" "$state/tmp/$ns" ||
      die "slurmd on $ns did not start: $(tail -3 "$state/slurm/slurmd-$ns.log" 2>/dev/null)"
  done
  # Ready when every host is idle.
  local idle=0 tries
  for ((tries = 0; tries < 60; tries++)); do
    idle=$(in_host 0 env SLURM_CONF="$conf" sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l || true)
    ((idle >= hosts)) && break
    sleep 0.5
  done
  ((idle >= hosts)) || die "Slurm: $idle of $hosts hosts idle after 30 s (logs in $state/slurm)"
}

# Runs COMMAND on host I: inside its network namespace, under its hostname.
in_host() {
  local ns
  ns=$(host_ns "$1")
  shift
  ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$ns" "$@"
}

check_root() {
  [[ $(id -u) -eq 0 ]] || die "creating network namespaces needs root (this is uid $(id -u))"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs ip and tc (Debian package iproute2)"
}

up() {
  check_root
  [[ "$hosts" =~ ^[1-9][0-9]?$ && "$hosts" -le 64 ]] || die "--hosts '$hosts' must be 1 to 64"
  [[ "$ranks" =~ ^[1-9][0-9]*$ ]] || die "--ranks '$ranks' must be a positive count of slots per host"
  rate_bytes "$rate" >/dev/null
  [[ -z "$delay" || "$delay" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--delay '$delay' must be milliseconds (e.g. 10)"
  [[ -z "$loss" || "$loss" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--loss '$loss' must be a percentage (e.g. 1)"
  [[ ! -e "$state" ]] || die "a cluster named '$name' is up ($state): 'cluster.sh down --name $name' first"
  mkdir -p "$state"
  # A failed command or a refusal (die exits) removes what was made.
  trap 'rc=$?; ((rc == 0)) || { echo "cluster.sh: up failed; removing what it made" >&2; down >/dev/null 2>&1 || true; }' EXIT
  ip netns add "$switch"
  ip -n "$switch" link set lo up
  ip -n "$switch" link add br0 type bridge
  ip -n "$switch" link set br0 up
  : >"$state/hostfile"
  local i ns hosts_file
  for ((i = 0; i < hosts; i++)); do
    ns=$(host_ns "$i")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$switch" link add "h$i" type veth peer name eth0 netns "$ns"
    ip -n "$switch" link set "h$i" master br0
    ip -n "$ns" addr add "10.231.0.$((i + 1))/24" dev eth0
    # A peer that acknowledges nothing for about 25 s (a cut link) is given
    # up by TCP, instead of after 15 retries (over 15 minutes): mpirun then
    # learns that a host's daemon is gone and ends the job.
    ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_retries2=6 2>/dev/null ||
      echo "cluster.sh: this kernel keeps net.ipv4.tcp_retries2 global; after a cut link mpirun may wait minutes" >&2
    shape_dev "$ns" eth0
    shape_dev "$switch" "h$i"
    delay_host "$ns"
    echo "$ns slots=$ranks" >>"$state/hostfile"
  done
  # `ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts: each
  # host resolves the others' names without touching the machine's file.
  for ((i = 0; i < hosts; i++)); do
    ns=$(host_ns "$i")
    mkdir -p "/etc/netns/$ns"
    hosts_file="/etc/netns/$ns/hosts"
    {
      echo "127.0.0.1 localhost"
      for ((j = 0; j < hosts; j++)); do echo "10.231.0.$((j + 1)) $(host_ns "$j")"; done
    } >"$hosts_file"
  done
  # Note [Launching into a namespace]
  # Open MPI's rsh launcher runs `AGENT HOST COMMAND...` as it would run ssh.
  # The agent enters HOST's network namespace and a UTS namespace of its own,
  # sets the hostname (so that every rank's gethostname() names its host),
  # and runs the command with a shell, as sshd would.
  {
    echo '#!/usr/bin/env bash'
    echo "cluster=$name"
    cat <<'EOF'
set -euo pipefail
while [[ "${1:-}" == -* ]]; do shift; done
h="$1"
shift
[[ "$h" == "$cluster"-h* && -e "/run/netns/$h" ]] || {
  echo "cluster agent: '$h' is not a host of cluster $cluster" >&2
  exit 255
}
exec ip netns exec "$h" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$h" "$*"
EOF
  } >"$state/agent"
  chmod +x "$state/agent"
  echo "$hosts $ranks $rate ${delay:-0} ${loss:-0}" >"$state/shape"
  ((slurm == 0)) || slurm_up
  trap - EXIT
  echo "cluster $name: $hosts hosts x $ranks ranks ($(host_ns 0) .. $(host_ns $((hosts - 1))), 10.231.0.1-$hosts), each link $rate${delay:+, ${delay} ms}${loss:+, ${loss} % loss}$( ((slurm == 0)) || echo ", Slurm up")"
}

shape() {
  check_root
  [[ -e "$state" ]] || die "no cluster named '$name' is up"
  [[ -e "/run/netns/$(host_ns "$host")" ]] || die "--host $host: cluster '$name' has no such host"
  [[ -z "$delay" || "$delay" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--delay '$delay' must be milliseconds (e.g. 10)"
  shape_dev "$(host_ns "$host")" eth0
  shape_dev "$switch" "h$host"
  delay_host "$(host_ns "$host")"
  echo "cluster $name: host $host's link now $rate${delay:+, ${delay} ms}${loss:+, ${loss} % loss}"
}

# Takes host I's link down (its eth0: nothing in or out) or back up.
link() {
  check_root
  [[ -e "$state" ]] || die "no cluster named '$name' is up"
  [[ "$state_arg" == down || "$state_arg" == up ]] || die "link needs 'down' or 'up'"
  [[ -e "/run/netns/$(host_ns "$host")" ]] || die "--host $host: cluster '$name' has no such host"
  ip -n "$(host_ns "$host")" link set eth0 "$state_arg"
  echo "cluster $name: host $host's link $state_arg"
}

run() {
  [[ -e "$state" ]] || die "no cluster named '$name' is up ('cluster.sh up --name $name' first)"
  [[ $# -gt 0 ]] || die "run needs a command after --"
  [[ -e "/run/netns/$(host_ns "$host")" ]] || die "--host $host: cluster '$name' has no such host"
  [[ ! -e "$state/slurm.conf" ]] || export SLURM_CONF="$state/slurm.conf"
  export OMPI_MCA_plm_rsh_agent="$state/agent" OMPI_MCA_orte_default_hostfile="$state/hostfile" \
    OMPI_MCA_btl_tcp_if_include=eth0 OMPI_MCA_oob_tcp_if_include=eth0
  # Open MPI notices a daemon it cannot reach by TCP keepalive, after 8
  # minutes by default: a cut link would leave mpirun waiting that long for
  # the cut host's daemon. 10 s idle, then 3 probes 2 s apart (unless set).
  export OMPI_MCA_oob_tcp_keepalive_time="${OMPI_MCA_oob_tcp_keepalive_time:-10}" \
    OMPI_MCA_oob_tcp_keepalive_intvl="${OMPI_MCA_oob_tcp_keepalive_intvl:-2}" \
    OMPI_MCA_oob_tcp_keepalive_probes="${OMPI_MCA_oob_tcp_keepalive_probes:-3}"
  in_host "$host" "$@"
}

down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$name-(h[0-9]+|sw)$" || true); do
    # Processes left in a host (a killed job's orted) would keep it alive.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rm -rf "$state"
  echo "cluster $name: down"
}

status() {
  [[ -e "$state" ]] || { echo "cluster $name: not up"; return 1; }
  read -r h r rt d l <"$state/shape"
  echo "cluster $name: $h hosts x $r ranks, links $rt (delay ${d} ms, loss ${l} %)"
  local i
  for ((i = 0; i < h; i++)); do
    echo "  $(host_ns "$i") 10.231.0.$((i + 1)): $(tc -n "$(host_ns "$i")" qdisc show dev eth0 | head -1)$([[ -s "$state/delay-$(host_ns "$i").pid" ]] && echo ", arrivals delayed (link_delay pid $(cat "$state/delay-$(host_ns "$i").pid"))")"
  done
}

case "$cmd" in
up) up ;;
run) run "$@" ;;
shape) shape ;;
link) link ;;
down) down ;;
status) status ;;
*) die "unknown command '$cmd': up, run, shape, link, down or status" ;;
esac
