#!/usr/bin/env bash
# Installs the Debian 12 packages tessera needs, skipping those already
# present. apt-get runs as root, through sudo otherwise.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libtorch-dev            # LibTorch 1.13, CPU only
  libopenblas0-pthread    # switches libblas.so.3 away from the reference BLAS
  libopenmpi-dev openmpi-bin
  libfmt-dev nlohmann-json3-dev libgtest-dev libcli11-dev
  iproute2 nftables slurmd slurmctld slurm-client munge  # the emulated cluster (scripts/cluster.sh)
  iptables libnetfilter-queue-dev                        # its link delay (Note [Delay without netem])
  "$@"
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "install-deps: missing packages ${missing[*]} and neither root nor sudo to install them" >&2
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
