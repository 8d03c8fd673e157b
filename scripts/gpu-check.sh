#!/usr/bin/env bash
# The GPU checks (docs/gpu-checks.md): the whole CTest suite with CUDA
# tensors, the NCCL backend, comm_bench on NCCL beside a raw NCCL loop, and
# the GPU benchmarks, on a GPU machine that has PyTorch's CUDA wheel but no
# MPI and no network.
#
#   scripts/gpu-check.sh fetch [DEBS]   here (Debian 12, network): download the
#                                       Open MPI, fmt, nlohmann-json, CLI11 and
#                                       GoogleTest packages into DEBS (.gpu-debs)
#   scripts/gpu-check.sh prebuild       here: build every target against the GPU
#                                       machine's LibTorch (TORCH_SPEC, default
#                                       torch==2.11.0), unpacked at the path it
#                                       has there (TORCH_SITE), and pack the
#                                       build into .gpu-build/ to carry there
#   scripts/gpu-check.sh run [DEBS]     there: unpack DEBS into a prefix, use the
#                                       carried build (or build, about 20 minutes
#                                       on 16 cores), run; logs and JSON into
#                                       $OUT (./gpu-out)
#   scripts/gpu-check.sh build [DEBS]   there: only unpack and build
#   scripts/gpu-check.sh test [DEBS]    there: only run
#
# GPU_CHECK_PARTS picks parts (default "nccl comm dp gpt trainer suite"), CTEST_ARGS
# narrows the suite (e.g. "-R gpt"), GPU_CHECK_BUDGET (560 s) bounds the run.
#
# The packages are unpacked into /opt/tessera-deps, not into /: Open MPI is
# relocated with OPAL_PREFIX, so nothing of the machine's own is replaced.
set -uo pipefail

mode=${1:-}
debs=${2:-.gpu-debs}
packages=(openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libhwloc15 libevent-core-2.1-7
  libevent-pthreads-2.1-7 libevent-2.1-7 libfabric1 libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200
  libmunge2 libnuma1 libpsm-infinipath1 libpsm2-2 libucx0 libfmt9 libfmt-dev nlohmann-json3-dev libgtest-dev libcli11-dev)
build=build-gpu
carried=.gpu-build
torch_site=${TORCH_SITE:-/opt/torch/.venv/lib/python3.12/site-packages}

if [ "$mode" = fetch ]; then
  mkdir -p "$debs" && cd "$debs" && apt-get download "${packages[@]}"
  exit $?
fi

# Note [Prebuilt GPU build]
# A first build on the GPU machine takes about 20 minutes of 16 cores, more
# than a short lease holds. The wheel's LibTorch is the same files on any
# x86-64 Linux, so the build can be made here: the wheel unpacked at the path
# it has there (so every absolute path CMake writes holds there too), linked
# without the CUDA libraries the wheel leaves to other wheels
# (--allow-shlib-undefined: they are there at run time), and the outputs
# without objects packed, a few tens of MiB. There, the repository is linked
# at the path it had here when that differs.
if [ "$mode" = prebuild ]; then
  set -e
  spec=${TORCH_SPEC:-torch==2.11.0}
  py=${PYTHON:-python3}
  if [ ! -d "$torch_site/torch" ]; then
    tmp=$(mktemp -d)
    "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 "$spec" -d "$tmp"
    mkdir -p "$torch_site" && (cd "$torch_site" && unzip -q -o "$tmp"/torch-*.whl)
    rm -rf "$tmp"
  fi
  # CMake reads the Python there for the Python tests; here it is this one.
  venv_py=$(dirname "$(dirname "$(dirname "$torch_site")")")/bin/python3
  if [ ! -e "$venv_py" ]; then
    mkdir -p "$(dirname "$venv_py")"
    printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$py")" > "$venv_py" && chmod +x "$venv_py"
  fi
  cuda=${CUDA_HOME:-/usr/local/cuda}
  cmake -S . -B $build -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_site/torch" \
    -DCMAKE_CUDA_COMPILER=$cuda/bin/nvcc -DCUDAToolkit_ROOT=$cuda -DCUDA_TOOLKIT_ROOT_DIR=$cuda \
    -DTORCH_CUDA_ARCH_LIST=9.0 -DTESSERA_WITH_NCCL=ON -DPython3_EXECUTABLE="$venv_py" \
    -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined
  cmake --build $build -j "${JOBS:-2}"
  mkdir -p $carried
  tar -C . --exclude='*.o' --exclude='*.gch' --exclude='*.pch' --exclude="$build/Testing" \
    --exclude='*/CMakeFiles/*.dir' -czf $carried/build.tar.gz $build
  echo "$PWD" > $carried/source_dir
  ls -la $carried
  exit 0
fi
case "$mode" in run|build|test) ;; *) echo "usage: $0 fetch|prebuild|run|build|test [DEBS]" >&2; exit 2;; esac

# Every log and JSON file goes into $out/logs, packed at the end into
# $out/gpu-check.tar.gz (the device tool returns a few files only).
out=${OUT:-$PWD/gpu-out}
logs=$out/logs
mkdir -p "$logs"
parts=" ${GPU_CHECK_PARTS:-nccl comm dp gpt trainer suite} "
pack() { tar -czf "$out/gpu-check.tar.gz" -C "$out" logs && rm -rf "$logs"; }
# A command there may start with an affinity of one CPU (seen: 1 of 16 online,
# nproc 1): widen it to every online CPU where that is allowed.
online=$(getconf _NPROCESSORS_ONLN)
command -v taskset > /dev/null && taskset -pc "0-$((online - 1))" $$ > /dev/null 2>&1
prefix=/opt/tessera-deps
lib=$prefix/usr/lib/x86_64-linux-gnu
for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix"; done
nvidia_libs=$(python3 -c 'import glob, os, torch; site = os.path.dirname(os.path.dirname(torch.__file__)); print(":".join(sorted(glob.glob(site + "/nvidia/*/lib")) + [os.path.dirname(torch.__file__) + "/lib"]))')
export OPAL_PREFIX=$prefix/usr PATH=$prefix/usr/bin:$PATH:/usr/local/cuda/bin
export LD_LIBRARY_PATH=$nvidia_libs:$lib/openmpi/lib:$lib:$lib/pmix2/lib:${LD_LIBRARY_PATH:-}
export PMIX_INSTALL_PREFIX=$lib/pmix2 PMIX_MCA_mca_base_component_path=$lib/pmix2/lib/pmix
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
mpirun=(mpirun.openmpi --bind-to none)

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  gcc --version | head -1
  nvcc --version | tail -1
  echo "cores: nproc $(nproc), online $(getconf _NPROCESSORS_ONLN), cpuset $(cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null)"
} > "$logs/machine.txt" 2>&1
cat "$logs/machine.txt"

if [ -f $carried/build.tar.gz ] && [ ! -d $build ]; then
  # Note [Prebuilt GPU build]: the paths written here are the paths there.
  src=$(cat $carried/source_dir)
  if [ "$src" != "$PWD" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
  tar -xzf $carried/build.tar.gz
  for tool in /usr/bin/cmake:"$(command -v cmake)" /usr/bin/mpiexec:$prefix/usr/bin/mpiexec.openmpi; do
    [ -e "${tool%%:*}" ] || ln -s "${tool#*:}" "${tool%%:*}"
  done
  echo "using the carried build of $src"
elif [ "$mode" != test ]; then
  torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  {
    cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$torch_cmake;$prefix/usr;$lib/cmake" \
      -DMPI_C_COMPILER=$prefix/usr/bin/mpicc.openmpi -DMPI_CXX_COMPILER=$prefix/usr/bin/mpicxx.openmpi \
      -DMPIEXEC_EXECUTABLE=$prefix/usr/bin/mpiexec.openmpi \
      -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DTORCH_CUDA_ARCH_LIST=9.0 -DTESSERA_WITH_NCCL=ON &&
      time cmake --build $build -j "$(nproc)"
  } > "$logs/build.log" 2>&1 || { tail -60 "$logs/build.log"; pack; exit 1; }
  tail -3 "$logs/build.log"
fi
[ "$mode" = build ] && { pack; exit 0; }
start=$SECONDS

# The NCCL backend: one GPU, so one rank (NCCL refuses two ranks on one device).
if [[ $parts == *" nccl "* ]]; then
  timeout 120 "${mpirun[@]}" -np 1 $build/tests/test_nccl > "$logs/test_nccl.txt" 2>&1
  echo "test_nccl rc=$? ($(grep -aE 'PASSED|SKIPPED|FAILED' "$logs/test_nccl.txt" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' '))"
fi

# Collectives on NCCL against raw NCCL on the same buffers (Note [NCCL
# baseline] in bench/comm_bench.cpp), and on MPI against raw MPI for scale.
if [[ $parts == *" comm "* ]]; then
  timeout 120 "${mpirun[@]}" -np 1 $build/bench/comm_bench --backend nccl --json --min-bytes 8 --max-bytes 256M \
    --factor 4 --rounds 11 > "$logs/comm_bench_nccl.jsonl" 2> "$logs/comm_bench_nccl.err"
  echo "comm_bench nccl rc=$?"
  # The flight recorder's cost per NCCL call (Note [Flight recorder]): off
  # against on, interleaved, small sizes where the per-call cost shows.
  for round in 1 2; do
    for entries in 0 2000; do
      TESSERA_TRACE_BUFFER=$entries timeout 60 "${mpirun[@]}" -np 1 $build/bench/comm_bench --backend nccl --json \
        --min-bytes 8 --max-bytes 64K --factor 8 --rounds 21 >> "$logs/comm_bench_nccl_recorder_$entries.jsonl" 2>&1
    done
  done
  echo "comm_bench nccl recorder off/on rc=$?"
  timeout 120 "${mpirun[@]}" -np 4 $build/bench/comm_bench --backend mpi --json --min-bytes 8 --max-bytes 64M \
    --factor 4 --rounds 11 > "$logs/comm_bench_mpi.jsonl" 2> "$logs/comm_bench_mpi.err"
  echo "comm_bench mpi np=4 rc=$?"
fi

# Model-state memory on the device, per spec and offload mode, at 2 ranks.
if [[ $parts == *" dp "* ]]; then
  bench=(--hidden 2048 --layers 4 --batch 64 --steps 2 --warmup 1 --rounds 1 --device cuda)
  for off in "none" "host" "host --offload-params"; do
    timeout 120 "${mpirun[@]}" -np 2 $build/bench/dp_step "${bench[@]}" --backend mpi --offload $off \
      --specs ddp,zero1,zero2,zero3 >> "$logs/dp_step_cuda.jsonl" 2>> "$logs/dp_step_cuda.err"
    echo "dp_step offload=$off rc=$?"
  done
  timeout 60 "${mpirun[@]}" -np 1 $build/bench/dp_step "${bench[@]}" --backend nccl --specs ddp \
    >> "$logs/dp_step_cuda.jsonl" 2>> "$logs/dp_step_cuda.err"
  echo "dp_step nccl rc=$?"
fi

# GPT-medium shape in bf16 on one GPU: tessera's GPT against the plain
# LibTorch GPT (scaled_dot_product_attention), MFU against the bf16 matmul
# peak measured in the same run.
if [[ $parts == *" gpt "* ]]; then
  timeout 180 "${mpirun[@]}" -np 1 $build/bench/gpt_step --layers 24 --hidden 1024 --heads 16 --seq 1024 --batch 8 \
    --vocab 50304 --device cuda --dtype bf16 --steps 5 --warmup 2 --rounds 3 \
    >> "$logs/gpt_step_cuda.jsonl" 2>> "$logs/gpt_step_cuda.err"
  echo "gpt_step cuda bf16 rc=$?"
  grep -h '^{' "$logs/gpt_step_cuda.jsonl" | head -4
fi
# train_gpt on the GPU: a GPT-2-small shape in bf16 on one rank over NCCL,
# then dp2 x tp2 under ZeRO-2 on four ranks sharing the GPU (MPI backend).
if [[ $parts == *" trainer "* ]]; then
  timeout 150 "${mpirun[@]}" -np 1 $build/examples/train_gpt --device cuda --backend nccl --layers 12 --hidden 768 \
    --heads 12 --seq 512 --batch 16 --precision bf16 --steps 20 --warmup 2 --eval-every 10 --sample 0 --log-every 5 \
    --data README.md --metrics "$logs/train_gpt_cuda.jsonl" > "$logs/train_gpt_cuda.txt" 2>&1
  echo "train_gpt cuda nccl np1 rc=$?"; grep -aE "^train_gpt|step +20/|validation" "$logs/train_gpt_cuda.txt" | tail -3
  timeout 150 "${mpirun[@]}" -np 4 $build/examples/train_gpt --device cuda --backend mpi --dp 2 --tp 2 --spec zero2 \
    --steps 6 --batch 8 --seq 64 --warmup 1 --eval-every 3 --sample 16 --data README.md > "$logs/train_gpt_cuda_np4.txt" 2>&1
  echo "train_gpt cuda mpi np4 rc=$?"; grep -aE "^train_gpt|step +6/|final loss" "$logs/train_gpt_cuda_np4.txt" | tail -3
fi
echo "benchmarks: $((SECONDS - start)) s"

# The whole suite with CUDA tensors: the suites that read TESSERA_TEST_DEVICE
# put their tensors on the GPU (ranks share it; the MPI backend stages through
# host memory), the others run as on CPU. It gets what is left of
# GPU_CHECK_BUDGET seconds (560: a 10-minute call with a margin), the
# benchmarks having run first.
[[ $parts == *" suite "* ]] || { pack; exit 0; }
suite_start=$SECONDS
budget=$(( ${GPU_CHECK_BUDGET:-560} - SECONDS - 10 ))
TESSERA_TEST_DEVICE=cuda timeout "$budget" ctest --test-dir $build -j "${CTEST_JOBS:-12}" \
  --output-on-failure ${CTEST_ARGS:-} > "$logs/ctest.log" 2>&1
echo "ctest rc=$? in $((SECONDS - suite_start)) s of $budget"
gzip -c $build/Testing/Temporary/LastTest.log > "$logs/LastTest.log.gz"
grep -E "tests passed|tests failed|Total Test time" "$logs/ctest.log"
grep -E "^\s+[0-9]+ - " "$logs/ctest.log" | head -40
scripts/test-skips.sh $build > "$logs/skips.txt" 2>&1
tail -8 "$logs/skips.txt"
pack
