# Entry points for people: `make demo` and `make test` set everything up on a
# fresh Debian 12 machine (packages, configure, build) and run.
#
#   make test          build against Debian's LibTorch 1.13 and run the suite
#   make demo          train_gpt on 8 local ranks (dp2 x pp2 x tp2, ZeRO-2, 1F1B) on
#                      Debian's fortunes, then plot its metrics (build/demo/)
#   make test-latest   the same suite against the newest LibTorch from PyPI
#   make bench         the collective benchmark at 4 ranks, JSON lines
#   make fuzz          every parser under libFuzzer (clang), FUZZ_RUNS each
#   make test-sanitize a subset of the suite under ASan + UBSan, then TSan (clang)

BUILD        ?= build
BUILD_LATEST ?= build-latest
JOBS         ?= 2
BUILD_TYPE   ?= Release
# CTest's slots do not limit: tests/resources.json does, with this
# machine's cores and one slot for the tests that wait (Note [Test resources]
# in cmake/TesseraTesting.cmake).
CTEST_ARGS   ?= --output-on-failure -j 16
# The PyPI wheel's LibTorch is built with CUDA: its CMake config needs a
# working nvcc even though tessera compiles no .cu files.
CUDA_HOME    ?= /usr/local/cuda
TORCH_CUDA_ARCH_LIST ?= 8.0;9.0
MPIRUN_ENV    = OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
                OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1 \
                OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

.PHONY: all deps configure build test demo bench test-latest fuzz test-sanitize clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The skips of the run are listed after CTest's summary (scripts/test-skips.sh).
test: build
	ctest --test-dir $(BUILD) --resource-spec-file $(abspath $(BUILD))/tests/resources.json $(CTEST_ARGS); status=$$?; scripts/test-skips.sh $(BUILD); exit $$status

DEMO_DIR      = $(BUILD)/demo
DEMO_ARGS    ?= --dp 2 --pp 2 --tp 2 --spec zero2 --schedule 1f1b --steps 1000 --lr 2e-3 --warmup 50 \
                --log-every 50 --eval-every 100

demo: build
	scripts/install-deps.sh fortunes python3-matplotlib
	mkdir -p $(DEMO_DIR)
	$(MPIRUN_ENV) mpirun -np 8 $(BUILD)/examples/train_gpt $(DEMO_ARGS) --metrics $(DEMO_DIR)/metrics.jsonl \
	  --save $(DEMO_DIR)/checkpoints --consolidate $(DEMO_DIR)/model.safetensors
	/usr/bin/python3 scripts/plot_metrics.py $(DEMO_DIR)/metrics.jsonl $(DEMO_DIR)/metrics.png

bench: build
	$(MPIRUN_ENV) mpirun -np 4 $(BUILD)/bench/comm_bench --json

# libFuzzer on every parser (docs/fuzzing.md): the clang build of
# test-sanitize (build-sanitize), FUZZ_RUNS executions per target.
FUZZ_RUNS ?= 1000000
fuzz: deps
	scripts/install-deps.sh clang libclang-rt-14-dev
	scripts/fuzz.sh build-sanitize $(FUZZ_RUNS)

# docs/sanitizers.md: build-sanitize (ASan + UBSan, the fuzz targets too) and
# build-tsan (ThreadSanitizer), each running its label of the suite.
test-sanitize: deps
	scripts/install-deps.sh clang libclang-rt-14-dev
	JOBS=$(JOBS) $(MPIRUN_ENV) scripts/test-sanitize.sh all

# LibTorch from PyPI's torch wheel, in a virtual environment of its own; the
# venv's Python (with transformers) runs the Python tests, hf_export_gpt2 included.
test-latest: deps
	scripts/install-deps.sh python3-venv
	scripts/setup-latest-torch.sh $(BUILD_LATEST)/venv > $(BUILD_LATEST).env
	. ./$(BUILD_LATEST).env && \
	  cmake -S . -B $(BUILD_LATEST) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DCMAKE_PREFIX_PATH="$$TORCH_PREFIX" \
	    -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc -DCUDAToolkit_ROOT=$(CUDA_HOME) \
	    -DCUDA_TOOLKIT_ROOT_DIR=$(CUDA_HOME) -DTORCH_CUDA_ARCH_LIST="$(TORCH_CUDA_ARCH_LIST)" \
	    -DPython3_EXECUTABLE=$(abspath $(BUILD_LATEST))/venv/bin/python && \
	  cmake --build $(BUILD_LATEST) -j $(JOBS) && \
	  { LD_LIBRARY_PATH="$$TORCH_LD_LIBRARY_PATH:$$LD_LIBRARY_PATH" ctest --test-dir $(BUILD_LATEST) \
	    --resource-spec-file $(abspath $(BUILD_LATEST))/tests/resources.json $(CTEST_ARGS); \
	    status=$$?; scripts/test-skips.sh $(BUILD_LATEST); exit $$status; }

clean:
	rm -rf $(BUILD) $(BUILD_LATEST) $(BUILD_LATEST).env build-sanitize build-tsan
