# Compiler launcher and warnings.

# ccache with precompiled headers needs these sloppiness settings, or every
# PCH user misses the cache.
if(TESSERA_USE_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(TESSERA_CCACHE ccache)
  if(TESSERA_CCACHE)
    set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env
        "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
        ${TESSERA_CCACHE})
  endif()
endif()

function(tessera_target_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  endif()
endfunction()

# Note [Programs at -O1]
# The test, example and benchmark programs are glue around LibTorch's
# prebuilt kernels and the library, which keeps the build type's flags: in a
# Release build they compile at TESSERA_PROGRAM_OPTIMIZE, -O1, which takes
# 40 % less compile time than -O3 (test_train.cpp: 16.7 s against 27.3 s).
# What a benchmark times runs in the library or in LibTorch; its own code is
# loops and calls.
set(TESSERA_PROGRAM_OPTIMIZE "-O1" CACHE STRING
  "Optimization of the test, example and benchmark programs in a Release build")

# An example or benchmark program: warnings and Note [Programs at -O1].
function(tessera_program target)
  tessera_target_warnings(${target})
  target_compile_options(${target} PRIVATE $<$<CONFIG:Release>:${TESSERA_PROGRAM_OPTIMIZE}>)
endfunction()
