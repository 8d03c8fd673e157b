# tessera_add_mpi_test(NAME name TARGET target RANKS n [TEST_DEVICE] [TIMEOUT s] [ARGS ...] [ENV VAR=value ...])
#
# Registers `name.npN` that runs `target` on N ranks with FindMPI's MPIEXEC
# variables. The environment makes root runs and oversubscription work with
# OpenMPI, gives each rank one intra-op and one BLAS thread, and makes idle
# ranks yield the core (8 ranks share 2 cores in CI). TIMEOUT (default
# TESSERA_TEST_TIMEOUT) turns a hang into a failure instead of a stuck CI.
# A program that ran no test exits 77, which CTest shows as a skip.
set(TESSERA_MPI_TEST_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1
  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMPI_MCA_rmaps_base_oversubscribe=1
  OMPI_MCA_mpi_yield_when_idle=1
  OMP_NUM_THREADS=1
  OPENBLAS_NUM_THREADS=1)

function(tessera_mpi_command out ranks)
  set(${out} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${MPIEXEC_PREFLAGS} PARENT_SCOPE)
endfunction()

function(tessera_add_mpi_test)
  cmake_parse_arguments(T "TEST_DEVICE" "NAME;TARGET;RANKS;TIMEOUT" "ARGS;ENV" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT ${TESSERA_TEST_TIMEOUT})
  endif()
  tessera_mpi_command(launcher ${T_RANKS})
  # TEST_DEVICE: a trainer that takes --device runs on TESSERA_TEST_DEVICE.
  set(wrapper)
  if(T_TEST_DEVICE)
    set(wrapper bash ${PROJECT_SOURCE_DIR}/tests/on_test_device.sh)
  endif()
  add_test(NAME ${T_NAME}.np${T_RANKS}
    COMMAND ${launcher} ${wrapper} $<TARGET_FILE:${T_TARGET}> ${MPIEXEC_POSTFLAGS} ${T_ARGS})
  set_tests_properties(${T_NAME}.np${T_RANKS} PROPERTIES
    TIMEOUT ${T_TIMEOUT}
    SKIP_RETURN_CODE 77
    ENVIRONMENT "${TESSERA_MPI_TEST_ENV};${T_ENV}"
    LABELS "mpi;np${T_RANKS}")
endfunction()

# tessera_add_mpi_failure_test(NAME name TARGET target RANKS n REGEX re [ARGS ...])
#
# Passes when the program exits non-zero on N ranks, within the timeout, and
# its output matches REGEX: for inputs that must be rejected cleanly.
function(tessera_add_mpi_failure_test)
  cmake_parse_arguments(T "" "NAME;TARGET;RANKS;REGEX" "ARGS" ${ARGN})
  tessera_mpi_command(launcher ${T_RANKS})
  # Lists travel to the script joined by "|" (a ";" would split the argument).
  string(REPLACE ";" "|" args "${T_ARGS}")
  string(REPLACE ";" "|" launcher "${launcher}")
  add_test(NAME ${T_NAME}.np${T_RANKS}
    COMMAND ${CMAKE_COMMAND}
      "-DLAUNCHER=${launcher}" "-DPROGRAM=$<TARGET_FILE:${T_TARGET}>" "-DARGS=${args}"
      "-DEXPECT=${T_REGEX}" -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  set_tests_properties(${T_NAME}.np${T_RANKS} PROPERTIES
    TIMEOUT 60
    # Under expect_failure.cmake's own 30 s, so a hang is reported by name.
    # mpirun waits 2 s after a rank exits non-zero (SIGTERM, then SIGKILL a
    # second later, for ranks that write flight records on SIGTERM); a
    # refusal writes none, and the suite has some 70 of them.
    ENVIRONMENT "${TESSERA_MPI_TEST_ENV};TESSERA_COMM_TIMEOUT=20;OMPI_MCA_odls_base_sigkill_timeout=0"
    LABELS "mpi;np${T_RANKS};invalid-input")
endfunction()

# One failure test per case "name|arg,arg,...|regex" of CASES: PREFIX.name,
# run with ARGS and then the case's own arguments.
function(tessera_add_failure_cases)
  cmake_parse_arguments(T "" "PREFIX;TARGET;RANKS" "ARGS;CASES" ${ARGN})
  foreach(entry ${T_CASES})
    string(REPLACE "|" ";" parts "${entry}")
    list(GET parts 0 case_name)
    list(GET parts 1 args)
    list(GET parts 2 regex)
    string(REPLACE "," ";" args "${args}")
    tessera_add_mpi_failure_test(NAME ${T_PREFIX}.${case_name} TARGET ${T_TARGET} RANKS ${T_RANKS} REGEX "${regex}"
      ARGS ${T_ARGS} ${args})
  endforeach()
endfunction()

# tessera_finish_tests()
#
# Called once all of a directory's tests are added. Every test must carry a
# label, so `ctest -L` selects any part of the suite. Every test gets a time
# limit (TESSERA_TEST_TIMEOUT unless it has one) and, unless it sets its own,
# TESSERA_COMM_TIMEOUT a margin below that limit: a deadlock then ends with
# tessera's message naming the operation, its sequence number and its peers
# (Note [Timeouts]) before CTest kills the job with a bare "Timeout".
function(tessera_finish_tests)
  # Note [Test resources]
  # `make test` runs CTest with tests/resources.json: `cores` in halves (two
  # slots for each of this machine's cores) and one `waits` slot. A test
  # with ranks takes min(ranks, cores) cores, a one-process test one, and a
  # test labelled `waits` only the waits slot: it spends its time blocked in
  # the timeout or abort it provoked, so it runs beside the compute-bound
  # tests instead of after them (about 250 s of a 2-core suite). A refusal
  # (`invalid-input`) takes half a core a rank: its ranks exit once LibTorch
  # is loaded, and the launch and teardown around them leave a core about
  # half idle (0.65 CPU-s a second at 1 rank, counted); the install test
  # half a core, mostly waiting on CMake's configure steps (0.46 CPU-s a
  # second). CTest's -j must then be large enough not to limit (make test
  # passes 16): the cores decide. Without the file (a plain `ctest -j N`)
  # the PROCESSORS below decide as before.
  set(cores ${TESSERA_TEST_CORES})
  if(NOT cores)
    cmake_host_system_information(RESULT cores QUERY NUMBER_OF_LOGICAL_CORES)
  endif()
  math(EXPR halves "2 * ${cores}")
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/resources.json
    "{\"version\": {\"major\": 1, \"minor\": 0}, \"local\": [{\"cores\": [{\"id\": \"0\", \"slots\": ${halves}}], "
    "\"waits\": [{\"id\": \"0\", \"slots\": 1}]}]}\n")
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(t ${tests})
    get_test_property(${t} LABELS labels)
    if(NOT labels)
      message(FATAL_ERROR "test '${t}' has no LABELS: label every test (docs/testing.md lists the labels)")
    endif()
    get_test_property(${t} TIMEOUT timeout)
    if(NOT timeout)
      set(timeout ${TESSERA_TEST_TIMEOUT})
      set_tests_properties(${t} PROPERTIES TIMEOUT ${timeout})
    endif()
    get_test_property(${t} ENVIRONMENT env)
    if(NOT env MATCHES "TESSERA_COMM_TIMEOUT=")
      math(EXPR margin "${timeout} / 5")
      if(margin LESS 20)
        set(margin 20)
      endif()
      math(EXPR comm_timeout "${timeout} - ${margin}")
      set_property(TEST ${t} APPEND PROPERTY ENVIRONMENT "TESSERA_COMM_TIMEOUT=${comm_timeout}")
    endif()
    # Note [Tests in parallel]
    # `ctest -j N` (without the resource file of Note [Test resources]) runs tests side by side
    # within N slots: an MPI test takes one slot per rank (CTest lets a test
    # that wants more than N run alone), so one-rank tests pair up and an
    # 8-rank test has the machine. Refusals end before any work, and the
    # install test mostly compiles one file: one slot.
    # Tests that measure time or memory run alone; tests that start ranks of
    # their own take every core (a `waits` test may run beside them). Those
    # labelled `waits` spend most of their time waiting for a timeout or an
    # abort they provoked, so they take one slot beside another test (their
    # checks allow tens of seconds: a busy core does not move them).
    if(labels MATCHES "(^|;)(timing|memory)(;|$)")
      set_tests_properties(${t} PROPERTIES RUN_SERIAL TRUE)
    elseif(labels MATCHES "(^|;)waits(;|$)")
      set_tests_properties(${t} PROPERTIES PROCESSORS 1 RESOURCE_GROUPS "waits:1")
    elseif(labels MATCHES "(^|;)install(;|$)")
      set_tests_properties(${t} PROPERTIES PROCESSORS 1 RESOURCE_GROUPS "cores:1")
    elseif(labels MATCHES "(^|;)invalid-input(;|$)")
      set(need 1)
      if(labels MATCHES "(^|;)np([0-9]+)(;|$)")
        set(need ${CMAKE_MATCH_2})
      endif()
      if(need GREATER halves)
        set(need ${halves})
      endif()
      set_tests_properties(${t} PROPERTIES PROCESSORS 1 RESOURCE_GROUPS "cores:${need}")
    elseif(labels MATCHES "(^|;)np([0-9]+)(;|$)")
      set(ranks ${CMAKE_MATCH_2})
      set(need ${ranks})
      if(need GREATER cores)
        set(need ${cores})
      endif()
      math(EXPR need "2 * ${need}")
      set_tests_properties(${t} PROPERTIES PROCESSORS ${ranks} RESOURCE_GROUPS "cores:${need}")
    elseif(labels MATCHES "(^|;)(fault|elastic|example|checkpoint|huggingface|python|planner)(;|$)")
      set_tests_properties(${t} PROPERTIES PROCESSORS ${cores} RESOURCE_GROUPS "cores:${halves}")
    else()
      set_tests_properties(${t} PROPERTIES RESOURCE_GROUPS "cores:2")
    endif()
  endforeach()
endfunction()
