#!/usr/bin/env bash
# Installs the newest LibTorch from PyPI's torch wheel into a venv, for the
# `make test-latest` build (see docs/latest-libtorch.md).
#
# Usage: scripts/setup-latest-torch.sh [VENV_DIR]      (default: build-latest/venv)
#
# Installs `torch` WITHOUT its dependency set (several GB of CUDA wheels and
# triton), then only the wheels that provide the libraries libtorch_cuda.so
# needs and the CUDA toolkit in $CUDA_HOME does not (or has too old):
#   nvidia-nccl-cu13       libnccl.so.2         (the toolkit's NCCL is older: missing symbols)
#   nvidia-cusparselt-cu13 libcusparseLt.so.0
#   nvidia-nvshmem-cu13    libnvshmem_host.so.3
#   cuda-toolkit[cufile]   -> nvidia-cufile: libcufile.so.0
# Their versions are the ones pinned in the installed torch's metadata.
# Everything else (cudart, cuBLAS, cuDNN, cuFFT, cuSPARSE, cuSOLVER, nvrtc,
# CUPTI) comes from $CUDA_HOME/lib64.
#
# Idempotent: an existing venv, torch and companion wheels are kept. To move
# to a newer torch, delete the venv or set TORCH_SPEC (e.g. 'torch==2.16.0').
#
# Environment: PYTHON (python3), TORCH_SPEC (torch), CUDA_HOME (/usr/local/cuda).
# pip's own configuration (index, proxy, find-links) applies.
#
# stdout: exactly two lines, also written to VENV_DIR/tessera-torch.env
# (usable both by `include` in a Makefile and by `.` in a shell):
#   TORCH_PREFIX=<site-packages>/torch     -> cmake -DCMAKE_PREFIX_PATH=...
#   TORCH_LD_LIBRARY_PATH=<dirs>           -> LD_LIBRARY_PATH for running tests
# Progress goes to stderr.
set -euo pipefail

VENV=${1:-build-latest/venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[setup-latest-torch] $*" >&2; }
die() { log "error: $*"; exit 1; }

case "$VENV" in *[[:space:]]*) die "venv path must not contain whitespace: '$VENV'";; esac
VENV=$(mkdir -p "$(dirname "$VENV")" && cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else die "need root (or sudo) to run: $*"
  fi
}

# --- 1. venv ----------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found"
  if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    # Debian's python3 ships venv/ensurepip in a separate package.
    command -v apt-get >/dev/null 2>&1 || die "$PYTHON cannot create venvs (no ensurepip) and apt-get is missing"
    pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    log "installing python3-venv python${pyver}-venv with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv "python${pyver}-venv" >&2
  fi
  log "creating venv $VENV"
  "$PYTHON" -m venv "$VENV" >&2
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --progress-bar off "$@" >&2; }

# --- 2. torch, without dependencies -------------------------------------------
# TORCH_SPEC unpinned: keep whatever torch is installed; pinned: reinstall on mismatch.
torch_ok=$("$PY" - "$TORCH_SPEC" <<'EOF'
import importlib.metadata as md, re, sys
spec = sys.argv[1]
try:
    have = md.version("torch")
except md.PackageNotFoundError:
    print("no"); sys.exit()
m = re.search(r"==\s*([^\s;,]+)", spec)
print("yes" if m is None or have == m.group(1) else "no")
EOF
)
if [ "$torch_ok" != yes ]; then
  log "pip install --no-deps $TORCH_SPEC"
  pip_install --no-deps "$TORCH_SPEC"
fi

# --- 3. the few dependency wheels that the CUDA toolkit cannot replace --------
# Prints the missing requirements, one per line, prefixed "nodeps " or "deps ".
missing=$("$PY" <<'EOF'
import importlib.metadata as md, re
def have(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def matches(installed, want):
    if installed is None:
        return False
    return installed.startswith(want[:-1]) if want.endswith("*") else installed == want
for req in md.requires("torch") or []:
    if "extra ==" in req:
        continue
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*==\s*([^\s;,]+)", req)
    if not m:
        continue
    name, extras, ver = m.group(1).lower(), m.group(2) or "", m.group(3)
    if re.fullmatch(r"nvidia-(nccl|cusparselt|nvshmem|cufile)-cu\d+", name):
        # --no-deps: nvidia-nvshmem-cu13 would pull nvidia-cuda-cccl (headers only).
        if not matches(have(name), ver):
            print(f"nodeps {name}=={ver}")
    elif name == "cuda-toolkit" and "cufile" in extras:
        # The metapackage has no base dependencies: [cufile] pulls only nvidia-cufile.
        if not (matches(have("cuda-toolkit"), ver) and have("nvidia-cufile")):
            print(f"deps cuda-toolkit[cufile]=={ver}")
EOF
)
mapfile -t nodeps < <(printf '%s\n' "$missing" | sed -n 's/^nodeps //p')
mapfile -t deps < <(printf '%s\n' "$missing" | sed -n 's/^deps //p')
if [ "${#nodeps[@]}" -gt 0 ]; then
  log "pip install --no-deps ${nodeps[*]}"
  pip_install --no-deps "${nodeps[@]}"
fi
if [ "${#deps[@]}" -gt 0 ]; then
  log "pip install ${deps[*]}"
  # torch was installed without its dependencies: do not list them as conflicts.
  pip_install --no-warn-conflicts "${deps[@]}"
fi
# Lets `python -c 'import torch'` work for debugging (numpy, sympy, ... are
# imported lazily); CMake does not need it.
"$PY" -c 'import typing_extensions' >/dev/null 2>&1 || pip_install --no-deps typing-extensions

# --- 3b. Hugging Face transformers, for the Hugging Face tests ------------------
# transformers imports torch's Python side (torch.fx needs sympy), so torch's
# pure-Python requirements come too; never its CUDA wheels, triton or
# setuptools. A constraint pins the installed torch: pip may not replace it.
# transformers is pinned to the version the tests were written against: a
# newer one may write config.json keys that tessera refuses until it reads
# them (docs/huggingface.md); TRANSFORMERS_SPEC overrides.
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-transformers==5.24.0}
if ! "$PY" -c 'import transformers, safetensors, tokenizers, numpy, sympy, networkx, jinja2' >/dev/null 2>&1; then
  mapfile -t pyreqs < <("$PY" <<'EOF'
import importlib.metadata as md, re
for req in md.requires("torch") or []:
    name = re.match(r"\s*([A-Za-z0-9_.-]+)", req).group(1).lower()
    if "extra ==" not in req and not re.match(r"(nvidia-|cuda-|triton|setuptools)", name):
        print(req.split(";")[0].strip())
EOF
  )
  constraint=$(mktemp)
  "$PY" -c 'import importlib.metadata as md; print("torch==" + md.version("torch"))' > "$constraint"
  log "pip install $TRANSFORMERS_SPEC safetensors tokenizers numpy ${pyreqs[*]} (torch pinned)"
  pip_install --no-warn-conflicts --constraint "$constraint" "$TRANSFORMERS_SPEC" safetensors tokenizers numpy \
    "${pyreqs[@]}"
  rm -f "$constraint"
fi

# --- 4. paths ------------------------------------------------------------------
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
TORCH_PREFIX="$SP/torch"
[ -f "$TORCH_PREFIX/share/cmake/Torch/TorchConfig.cmake" ] || die "no TorchConfig.cmake under $TORCH_PREFIX"
[ -d "$CUDA_HOME/lib64" ] || die "CUDA toolkit not found: $CUDA_HOME/lib64 (set CUDA_HOME)"

# The wheel's NCCL must come before $CUDA_HOME/lib64 (which has an older
# libnccl.so.2): whichever libnccl.so.2 the loader finds first is the only one
# in the process, for tessera and libtorch_cuda alike.
ld_dirs=()
[ -d "$SP/nvidia/nccl/lib" ] && ld_dirs+=("$SP/nvidia/nccl/lib")
for d in "$SP"/nvidia/*/lib; do
  [ -d "$d" ] && [ "$d" != "$SP/nvidia/nccl/lib" ] && ld_dirs+=("$d")
done
ld_dirs+=("$TORCH_PREFIX/lib" "$CUDA_HOME/lib64")
TORCH_LD_LIBRARY_PATH=$(IFS=:; echo "${ld_dirs[*]}")

# --- 5. check: every library and symbol libtorch (CPU + CUDA) needs resolves ----
# (libcaffe2_nvrtc.so, which needs the driver's libcuda.so.1, is dlopen'ed
# lazily and not checked.)
if [ -f "$TORCH_PREFIX/lib/libtorch_cuda.so" ]; then
  problems=$(LD_LIBRARY_PATH="$TORCH_LD_LIBRARY_PATH" ldd -r "$TORCH_PREFIX/lib/libtorch.so" 2>&1 \
               | grep -E 'not found|undefined symbol' || true)
  if [ -n "$problems" ]; then
    log "libtorch does not resolve with LD_LIBRARY_PATH=$TORCH_LD_LIBRARY_PATH:"
    printf '%s\n' "$problems" | head -20 >&2
    die "a library is missing or too old; install the nvidia wheel that provides it (see docs/latest-libtorch.md)"
  fi
fi

torch_version=$("$PY" -c 'import importlib.metadata as md; print(md.version("torch"))')
log "torch $torch_version ready in $VENV"
{
  echo "# written by scripts/setup-latest-torch.sh (torch $torch_version)"
  echo "TORCH_PREFIX=$TORCH_PREFIX"
  echo "TORCH_LD_LIBRARY_PATH=$TORCH_LD_LIBRARY_PATH"
} > "$VENV/tessera-torch.env"
echo "TORCH_PREFIX=$TORCH_PREFIX"
echo "TORCH_LD_LIBRARY_PATH=$TORCH_LD_LIBRARY_PATH"
