#!/usr/bin/env bash
# Runs the sanitizer subset of the suite (Note [Sanitizer subset] in
# tests/CMakeLists.txt, docs/sanitizers.md): a clang build with
# AddressSanitizer and UBSan in ASAN_BUILD (the fuzz targets' build too), its
# tests of label `sanitize`; then a ThreadSanitizer build in TSAN_BUILD, its
# tests of label `sanitize-thread`. A sanitizer report fails the test that
# made it. Runtime options and suppressions: tests/sanitizers/.
#
#   scripts/test-sanitize.sh [address|thread|all]     (default all)
#   scripts/test-sanitize.sh configure                  (the address build's directory only: scripts/fuzz.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
which=${1:-all}
jobs=${JOBS:-2}
asan_build=${ASAN_BUILD:-build-sanitize}
tsan_build=${TSAN_BUILD:-build-tsan}
supp=$PWD/tests/sanitizers
status=0
case "$which" in all|address|thread|configure) ;;
  *) echo "test-sanitize.sh: '$which' is not one of all, address, thread, configure" >&2; exit 2;;
esac

configure() {  # DIR SANITIZERS [CMAKE ARGS...]
  local dir=$1 sanitizers=$2
  shift 2
  [[ -f $dir/CMakeCache.txt ]] && return 0
  CC=clang CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTESSERA_SANITIZE="$sanitizers" \
    -DTESSERA_BUILD_TESTS=ON -DTESSERA_BUILD_EXAMPLES=OFF -DTESSERA_BUILD_BENCH=OFF "$@"
}

run_label() {  # DIR LABEL
  local dir=$1 label=$2 start=$SECONDS
  ctest --test-dir "$dir" -L "^$label\$" -j "$jobs" --output-on-failure --timeout 900 || status=1
  echo "test-sanitize: label $label in $dir: $((SECONDS - start)) s"
}

if [[ $which == configure ]]; then
  configure "$asan_build" address,undefined -DTESSERA_FUZZ=ON
  exit $?
fi
if [[ $which == all || $which == address ]]; then
  configure "$asan_build" address,undefined -DTESSERA_FUZZ=ON || exit 1
  cmake --build "$asan_build" -j "$jobs" --target tessera_sanitize_programs fuzz_safetensors fuzz_checkpoint_index \
    fuzz_config_text fuzz_cli || exit 1
  LD_PRELOAD=$(realpath "$asan_build")/tests/libtessera_keep_modules_loaded.so \
  ASAN_OPTIONS=detect_leaks=1:leak_check_at_exit=0:halt_on_error=1:detect_stack_use_after_return=0:strict_init_order=1 \
  LSAN_OPTIONS=suppressions=$supp/lsan.supp:print_suppressions=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp \
    run_label "$asan_build" sanitize
fi
if [[ $which == all || $which == thread ]]; then
  configure "$tsan_build" thread || exit 1
  cmake --build "$tsan_build" -j "$jobs" --target tessera_sanitize_thread_programs || exit 1
  # die_after_fork=0: the fork tests of test_timeouts start a flight
  # recorder's thread in the child, which is what they test.
  LD_PRELOAD=$(realpath "$tsan_build")/tests/libtessera_keep_modules_loaded.so \
  TSAN_OPTIONS=suppressions=$supp/tsan.supp:halt_on_error=1:second_deadlock_stack=1:die_after_fork=0 \
    run_label "$tsan_build" sanitize-thread
fi
exit $status
