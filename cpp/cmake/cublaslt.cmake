# te_find_cublaslt(<target> <rpath>): sets <target> to the target that gives the CUDA build
# cuBLASLt (the GEMMs), or "" when there is none, and <rpath> to the RUNPATH entries the core
# library needs to find it. Used by cpp/CMakeLists.txt after find_package(CUDAToolkit).
#
#   1. The toolkit's CUDA::cublasLt.
#   2. Else the nvidia-cublas pip wheel in the build's Python environment: lib/libcublasLt.so.<N>
#      and include/cublasLt.h under nvidia/cu<N> (CUDA 13 wheels) or nvidia/cublas (CUDA 12),
#      N being the toolkit's major version (the wheels ship no unversioned libcublasLt.so, so
#      find_library is given the versioned name). TE_CUBLASLT_LIBRARY may name that file.
#
# With the wheel's copy, <rpath> is the wheel's lib directory relative to the
# installed layout (site-packages/transformer_engine/common/lib) and as found here.
include_guard(GLOBAL)
include(${CMAKE_CURRENT_LIST_DIR}/python_dirs.cmake)

function(te_find_cublaslt out rpath_out)
  set(${rpath_out} "" PARENT_SCOPE)
  if(TARGET CUDA::cublasLt)
    set(${out} CUDA::cublasLt PARENT_SCOPE)
    return()
  endif()
  set(${out} "" PARENT_SCOPE)
  set(major ${CUDAToolkit_VERSION_MAJOR})
  te_python_dirs(py_dirs)
  find_library(TE_CUBLASLT_LIBRARY NAMES libcublasLt.so.${major}
               PATHS ${py_dirs} PATH_SUFFIXES nvidia/cu${major}/lib nvidia/cublas/lib
               NO_DEFAULT_PATH
               DOC "libcublasLt.so.<CUDA major> of the nvidia-cublas wheel, when the toolkit has none")
  if(NOT TE_CUBLASLT_LIBRARY)
    return()
  endif()
  get_filename_component(lib_dir "${TE_CUBLASLT_LIBRARY}" DIRECTORY)
  get_filename_component(root "${lib_dir}" DIRECTORY)
  if(NOT EXISTS "${root}/include/cublasLt.h")
    message(STATUS "cuBLASLt: ${TE_CUBLASLT_LIBRARY} has no ${root}/include/cublasLt.h beside it")
    return()
  endif()
  # The cuBLAS headers alone, copied: nvidia/cu13/include also gets the headers of the other
  # CUDA 13 wheels (runtime, NVRTC), which must not shadow the toolkit's.
  set(include_dir "${CMAKE_CURRENT_BINARY_DIR}/cublaslt_include")
  file(GLOB headers "${root}/include/cublas*.h")
  file(COPY ${headers} DESTINATION "${include_dir}")

  add_library(te_cublaslt SHARED IMPORTED)
  set_target_properties(te_cublaslt PROPERTIES
    IMPORTED_LOCATION "${TE_CUBLASLT_LIBRARY}" INTERFACE_INCLUDE_DIRECTORIES "${include_dir}")
  get_filename_component(wheel_dir "${root}" NAME)
  set(${rpath_out} "$ORIGIN/../../../nvidia/${wheel_dir}/lib" "${lib_dir}" PARENT_SCOPE)
  set(${out} te_cublaslt PARENT_SCOPE)
endfunction()
