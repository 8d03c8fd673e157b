# cmake -DLAUNCHER=... -DPROGRAM=... -DARGS=... -DEXPECT=regex -P expect_failure.cmake
# LAUNCHER and ARGS are lists joined by "|". Succeeds when PROGRAM exits non-zero within 30 s and prints EXPECT.
string(REPLACE "|" ";" LAUNCHER "${LAUNCHER}")
string(REPLACE "|" ";" ARGS "${ARGS}")
execute_process(
  COMMAND ${LAUNCHER} ${PROGRAM} ${ARGS}
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  TIMEOUT 30)
set(all "${out}${err}")
message("${all}")
if(rc STREQUAL "0")
  message(FATAL_ERROR "expected a non-zero exit status, got 0")
endif()
if(rc MATCHES "timeout")
  message(FATAL_ERROR "the program did not end within 30 s: ${rc}")
endif()
if(NOT all MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output does not contain the expected message /${EXPECT}/")
endif()
message(STATUS "exited with '${rc}' and the expected message")
