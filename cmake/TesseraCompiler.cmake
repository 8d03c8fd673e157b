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
