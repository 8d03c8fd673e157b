#!/usr/bin/env bash
# The GPU checks (docs/gpu-checks.md): build tessera against PyTorch's CUDA
# wheel on a GPU machine that has no MPI and no network, and run the NCCL
# tests, the data-parallel tests on CUDA, bench/dp_step and bench/gpt_step on CUDA.
#
#   scripts/gpu-check.sh fetch [DIR]   here (Debian 12, network): download the
#                                      Open MPI, fmt, nlohmann-json and
#                                      GoogleTest packages into DIR (.gpu-debs)
#   scripts/gpu-check.sh run [DIR]     there: unpack DIR into a prefix, build,
#                                      run; logs and JSON into $OUT (./gpu-out)
#   scripts/gpu-check.sh build [DIR]   there: only unpack and build (a first
#                                      build takes about 10 minutes on 16 cores)
#   scripts/gpu-check.sh test [DIR]    there: only run, on a machine where
#                                      `build` ran (the build directory kept)
#
# The packages are unpacked into /opt/tessera-deps, not into /: Open MPI is
# relocated with OPAL_PREFIX, so nothing of the machine's own is replaced.
set -uo pipefail

mode=${1:-}
debs=${2:-.gpu-debs}
packages=(openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libhwloc15 libevent-core-2.1-7
  libevent-pthreads-2.1-7 libevent-2.1-7 libfabric1 libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200
  libmunge2 libnuma1 libpsm-infinipath1 libpsm2-2 libucx0 libfmt9 libfmt-dev nlohmann-json3-dev libgtest-dev libcli11-dev)

if [ "$mode" = fetch ]; then
  mkdir -p "$debs" && cd "$debs" && apt-get download "${packages[@]}"
  exit $?
fi
case "$mode" in run|build|test) ;; *) echo "usage: $0 fetch|run|build|test [DIR]" >&2; exit 2;; esac

out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
prefix=/opt/tessera-deps
lib=$prefix/usr/lib/x86_64-linux-gnu
for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix"; done
export OPAL_PREFIX=$prefix/usr PATH=$prefix/usr/bin:$PATH:/usr/local/cuda/bin
export LD_LIBRARY_PATH=$lib/openmpi/lib:$lib:$lib/pmix2/lib:${LD_LIBRARY_PATH:-}
export PMIX_INSTALL_PREFIX=$lib/pmix2 PMIX_MCA_mca_base_component_path=$lib/pmix2/lib/pmix
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
mpirun=(mpirun.openmpi --bind-to none)

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  gcc --version | head -1
  nvcc --version | tail -1
} > "$out/machine.txt" 2>&1

torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
build=build-gpu
jobs=$(nproc)
if [ "$mode" != test ]; then
{
  cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_cmake;$prefix/usr;$lib/cmake" \
    -DMPI_C_COMPILER=$prefix/usr/bin/mpicc.openmpi -DMPI_CXX_COMPILER=$prefix/usr/bin/mpicxx.openmpi \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DTORCH_CUDA_ARCH_LIST=9.0 -DTESSERA_WITH_NCCL=ON \
    -DTESSERA_BUILD_EXAMPLES=OFF &&
    time cmake --build $build -j "$jobs" --target test_nccl test_data_parallel dp_step gpt_step
} > "$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
tail -3 "$out/build.log"
fi
[ "$mode" = build ] && exit 0

# The NCCL backend: one GPU, so one rank (NCCL refuses two ranks on one device).
timeout 120 "${mpirun[@]}" -np 1 $build/tests/test_nccl > "$out/test_nccl.txt" 2>&1
echo "test_nccl rc=$?"

# ShardedModule on CUDA tensors: ranks share the GPU, the MPI backend stages
# through host memory.
for n in 1 2 4; do
  TESSERA_TEST_DEVICE=cuda timeout 240 "${mpirun[@]}" -np $n $build/tests/test_data_parallel \
    --gtest_filter='Specs/*:DataParallelOptions.*:ShardedModuleErrors.*' >> "$out/test_data_parallel_cuda.txt" 2>&1
  echo "test_data_parallel cuda np=$n rc=$?"
done

# Model-state memory on the device, per spec and offload mode, at 2 ranks.
bench=(--hidden 2048 --layers 4 --batch 64 --steps 2 --warmup 1 --rounds 1 --device cuda)
for off in "none" "host" "host --offload-params"; do
  timeout 120 "${mpirun[@]}" -np 2 $build/bench/dp_step "${bench[@]}" --backend mpi --offload $off \
    --specs ddp,zero1,zero2,zero3 >> "$out/dp_step_cuda.jsonl" 2>> "$out/dp_step_cuda.err"
  echo "dp_step offload=$off rc=$?"
done
timeout 60 "${mpirun[@]}" -np 1 $build/bench/dp_step "${bench[@]}" --backend nccl --specs ddp \
  >> "$out/dp_step_cuda.jsonl" 2>> "$out/dp_step_cuda.err"
echo "dp_step nccl rc=$?"

# GPT-medium shape in bf16 on one GPU: tessera's GPT against the plain
# LibTorch GPT (scaled_dot_product_attention), MFU against the bf16 matmul
# peak measured in the same run.
timeout 300 "${mpirun[@]}" -np 1 $build/bench/gpt_step --layers 24 --hidden 1024 --heads 16 --seq 1024 --batch 8 \
  --vocab 50304 --device cuda --dtype bf16 --steps 5 --warmup 2 --rounds 3 \
  >> "$out/gpt_step_cuda.jsonl" 2>> "$out/gpt_step_cuda.err"
echo "gpt_step cuda bf16 rc=$?"
