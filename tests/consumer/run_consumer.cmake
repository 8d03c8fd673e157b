# Installs the build tree into a prefix, builds tests/consumer against it with
# find_package(tessera), and runs it under mpirun.
set(prefix ${WORK_DIR}/prefix)
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
file(REMOVE_RECURSE ${prefix} ${WORK_DIR}/build)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# The exported link interface names its dependencies by target, never by a
# library path of this machine (a package carried to another machine, or a
# LibTorch moved, would otherwise fail to link).
file(GLOB_RECURSE targets_files ${prefix}/tesseraTargets.cmake)
if(NOT targets_files)
  message(FATAL_ERROR "cmake --install wrote no tesseraTargets.cmake under ${prefix}")
endif()
file(STRINGS ${targets_files} link_lines REGEX "INTERFACE_LINK_LIBRARIES")
foreach(line IN LISTS link_lines)
  if(line MATCHES "\"?(/[^;\"]+\\.so[^;\"]*)")
    message(FATAL_ERROR "the installed package links a library by its path on this machine, ${CMAKE_MATCH_1}: "
      "link its imported target instead (${line})")
  endif()
endforeach()
# The commands the docs name are installed (when the examples and benchmarks are built).
if(CHECK_COMMANDS)
  foreach(cmd bin/tessera_consolidate bin/tessera_generate bin/tessera_export_hf bin/tessera_tokenize bin/train_gpt bin/train_cnn bin/tessera_demo
              libexec/tessera/bench/comm_bench)
    if(NOT EXISTS ${prefix}/${cmd})
      message(FATAL_ERROR "cmake --install did not install ${cmd}")
    endif()
  endforeach()
  execute_process(COMMAND ${prefix}/bin/tessera_consolidate RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT out MATCHES "usage|Usage")
    message(FATAL_ERROR "installed tessera_consolidate without arguments printed no usage: ${out}")
  endif()
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${LAUNCHER} ${WORK_DIR}/build/consumer)
