# Finds NCCL and the CUDA runtime for the NCCL backend.
#
# The backend is written against the CUDA runtime API and nccl.h, not against
# LibTorch's CUDA build, so it compiles wherever the CUDA toolkit is present
# even with a CPU-only LibTorch (Debian's 1.13).
#
# Note [One NCCL per process]
# A process holds one libnccl.so.2, whichever the loader finds first, for
# tessera and libtorch_cuda alike. When LibTorch comes from PyPI's wheel, its
# NCCL is the nvidia-nccl wheel beside it (site-packages/nvidia/nccl), usually
# newer than the toolkit's; libtorch_cuda needs its symbols. So that NCCL is
# searched first, name by name per directory, and the link is told where to
# resolve libtorch_cuda's own NCCL (-rpath-link). NCCL_ROOT overrides both.
set(TESSERA_HAVE_NCCL OFF)
if(NOT TESSERA_WITH_NCCL STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  set(_tessera_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
  if(TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl")
    get_filename_component(_tessera_wheel_nccl "${TORCH_INSTALL_PREFIX}/../nvidia/nccl" ABSOLUTE)
    list(APPEND _tessera_nccl_hints ${_tessera_wheel_nccl})
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h
    HINTS ${_tessera_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
    PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
    HINTS ${_tessera_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
    PATH_SUFFIXES lib lib64)
  if(CUDAToolkit_FOUND AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(TESSERA_HAVE_NCCL ON)
    add_library(tessera_nccl_deps INTERFACE)
    target_include_directories(tessera_nccl_deps INTERFACE ${NCCL_INCLUDE_DIR})
    target_link_libraries(tessera_nccl_deps INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
    get_filename_component(TESSERA_NCCL_LIBRARY_DIR "${NCCL_LIBRARY}" DIRECTORY)
    message(STATUS "tessera: NCCL ${NCCL_LIBRARY}")
  elseif(TESSERA_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "TESSERA_WITH_NCCL=ON but nccl.h/libnccl or the CUDA toolkit were not found "
                        "(found include '${NCCL_INCLUDE_DIR}', library '${NCCL_LIBRARY}'); set NCCL_ROOT")
  endif()
endif()
