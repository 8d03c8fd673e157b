# Sourced by the tests on the emulated cluster (tests/cluster_*.sh): a skip
# that CTest shows (exit 77, SKIP_RETURN_CODE), and the checks that this
# machine can host a cluster, run before one is brought up.

skip() {
  echo "[tessera-skip] np4: $*"
  exit 77
}

# A test's start: NAME set to PREFIX and this shell's pid (8 characters at
# most: the cluster's device names derive from it), DIR emptied, and the
# namespaces required.
begin_cluster_test() {
  local prefix=$1 dir=$2
  name=$prefix$$
  name=${name:0:8}
  rm -rf "$dir" && mkdir -p "$dir"
  require_namespaces "$name" "$dir"
}

# Root, and a kernel or container that allows network namespaces (probed
# with one named NAME-probe; its error goes to DIR/probe.log).
require_namespaces() {
  local name=$1 dir=$2
  [ "$(id -u)" -eq 0 ] || skip "the emulated cluster needs root for network namespaces"
  if ! ip netns add "$name-probe" 2> "$dir/probe.log"; then
    skip "this machine refuses network namespaces: $(cat "$dir/probe.log")"
  fi
  ip netns del "$name-probe"
}
