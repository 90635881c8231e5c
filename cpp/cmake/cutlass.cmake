# Our CUTLASS-based Hopper kernels (src/gemm/hopper: the block-scaled FP8 GEMM and the grouped
# GEMM), compiled into transformer_engine when CUTLASS's headers are found; without them the
# build goes on and the GEMMs run on cuBLASLt only. Included by cpp/CMakeLists.txt after the
# transformer_engine target is made, in CUDA builds only. Defines TE_WITH_CUTLASS for the core
# when it adds them, and the target te_cutlass_hopper: cpp/CMakeLists.txt compiles
# src/gemm/hopper/hopper_unavailable.cpp (the entry points of hopper_gemm.h, failing) when that
# target does not exist.
#
# Headers (compile time only; CUTLASS is header-only):
#   TE_CUTLASS_INCLUDE  the directory holding cutlass/ and cute/; default: the include/ directory
#                       that the nvidia-cutlass wheel ships (cutlass_library/source/include) in
#                       the Python environment of the interpreter CMake finds (Python3_EXECUTABLE
#                       picks one), then system directories. It must have the SM90 blockwise-
#                       scaling mainloop (CUTLASS 3.9 / 4.x).
#
# The kernels are compiled for sm_90a only (WGMMA and TMA), in an object library of their own:
# the rest of the core keeps TE_CUDA_ARCHITECTURES. They are built when that list targets
# Hopper (an entry 90..., or all / all-major / native), and need nvcc 12 or newer.
#
# TE_WITH_CUTLASS: AUTO (default: when the headers are found), ON (fail the configure without
# them) or OFF.
set(TE_WITH_CUTLASS "AUTO" CACHE STRING "Compile the CUTLASS-based Hopper GEMM kernels: AUTO, ON or OFF")
set_property(CACHE TE_WITH_CUTLASS PROPERTY STRINGS AUTO ON OFF)

include(${CMAKE_CURRENT_LIST_DIR}/python_dirs.cmake)

function(te_add_cutlass_kernels)
  if(TE_WITH_CUTLASS STREQUAL "OFF")
    message(STATUS "CUTLASS Hopper kernels: off (TE_WITH_CUTLASS=OFF)")
    return()
  endif()

  set(why "")
  set(hopper OFF)
  foreach(arch ${CMAKE_CUDA_ARCHITECTURES})
    if(arch MATCHES "^90" OR arch MATCHES "^(all|all-major|native)$")
      set(hopper ON)
    endif()
  endforeach()
  if(NOT hopper)
    set(why "TE_CUDA_ARCHITECTURES (${CMAKE_CUDA_ARCHITECTURES}) does not target Hopper (90a)")
  elseif(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.0)
    set(why "nvcc ${CMAKE_CUDA_COMPILER_VERSION} is older than 12.0 (no sm_90a)")
  else()
    te_python_dirs(py_dirs)
    # The blockwise-scaling mainloop is what the kernels need; its file marks a CUTLASS new
    # enough (3.9 and later).
    find_path(TE_CUTLASS_INCLUDE
              cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp
              HINTS ${py_dirs} PATH_SUFFIXES cutlass_library/source/include include
              DOC "Directory holding CUTLASS's headers, cutlass/ and cute/ (the nvidia-cutlass wheel's cutlass_library/source/include)")
    if(NOT TE_CUTLASS_INCLUDE OR NOT EXISTS "${TE_CUTLASS_INCLUDE}/cutlass/detail/blockwise_scale_layout.hpp")
      string(CONCAT why "CUTLASS's headers with the SM90 blockwise-scaling GEMM were not found "
             "(set TE_CUTLASS_INCLUDE to the directory of cutlass/ and cute/, or install "
             "nvidia-cutlass in the build's Python environment)")
    endif()
  endif()
  if(why)
    if(TE_WITH_CUTLASS STREQUAL "ON")
      message(FATAL_ERROR "TE_WITH_CUTLASS=ON, but ${why}")
    endif()
    message(STATUS "CUTLASS Hopper kernels: not built, ${why}")
    return()
  endif()

  set(dir ${CMAKE_CURRENT_SOURCE_DIR}/src/gemm/hopper)
  add_library(te_cutlass_hopper OBJECT ${dir}/block_scaled_gemm.cu ${dir}/block_scaled_wgmma.cu ${dir}/tma_operand.cu
              ${dir}/grouped_gemm.cu ${dir}/argument_staging.cu)
  set_target_properties(te_cutlass_hopper PROPERTIES
    CUDA_ARCHITECTURES 90a POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_include_directories(te_cutlass_hopper PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR}/include ${CMAKE_CURRENT_SOURCE_DIR}/src)
  # SYSTEM: CUTLASS's headers are not warning-clean.
  target_include_directories(te_cutlass_hopper SYSTEM PRIVATE "${TE_CUTLASS_INCLUDE}")
  # NDEBUG in every build type: CUTLASS's device-side asserts are function calls inside the
  # WGMMA pipeline, and ptxas then serializes the WGMMAs (its warning C7510).
  target_compile_definitions(te_cutlass_hopper PRIVATE TE_WITH_CUDA TE_WITH_CUTLASS NDEBUG)
  target_compile_definitions(transformer_engine PRIVATE TE_WITH_CUTLASS)
  # --expt-relaxed-constexpr: CuTe calls constexpr host functions from device code. FMA
  # contraction is on here, unlike the rest of the core (block_scaled_gemm.cu says why).
  target_compile_options(te_cutlass_hopper PRIVATE --expt-relaxed-constexpr --fmad=true -lineinfo)
  target_sources(transformer_engine PRIVATE $<TARGET_OBJECTS:te_cutlass_hopper> ${dir}/block_scaled_gemm_entry.cpp
                 ${dir}/grouped_gemm_entry.cpp)

  # The GPU tests of the kernels against the CPU path and cuBLASLt: ctest tests that exit with
  # 77 (reported as skipped) when there is no sm_90 device.
  if(TE_BUILD_TESTS)
    enable_testing()
    foreach(name block_scaled_gemm grouped_gemm)
      add_executable(test_hopper_${name} ${CMAKE_CURRENT_SOURCE_DIR}/tests/hopper/test_${name}.cpp)
      target_include_directories(test_hopper_${name} PRIVATE
        ${CMAKE_CURRENT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR}/tests)
      target_link_libraries(test_hopper_${name} PRIVATE transformer_engine CUDA::cudart)
      add_test(NAME test_hopper_${name} COMMAND test_hopper_${name})
      set_tests_properties(test_hopper_${name} PROPERTIES SKIP_RETURN_CODE 77)
    endforeach()

    # The block-scaled GEMM's variant sweep (a benchmark, not a ctest test): one object per
    # configuration of tests/hopper/sweep_variant.cu, so that they compile in parallel.
    set(variants "")
    foreach(index RANGE 0 6)
      add_library(te_sweep_variant_${index} OBJECT ${CMAKE_CURRENT_SOURCE_DIR}/tests/hopper/sweep_variant.cu)
      set_target_properties(te_sweep_variant_${index} PROPERTIES
        CUDA_ARCHITECTURES 90a POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
      target_include_directories(te_sweep_variant_${index} PRIVATE
        ${CMAKE_CURRENT_SOURCE_DIR}/include ${CMAKE_CURRENT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR}/tests)
      target_include_directories(te_sweep_variant_${index} SYSTEM PRIVATE "${TE_CUTLASS_INCLUDE}")
      target_compile_definitions(te_sweep_variant_${index} PRIVATE TE_WITH_CUDA TE_WITH_CUTLASS NDEBUG
                                 TE_SWEEP_VARIANT=${index})
      target_compile_options(te_sweep_variant_${index} PRIVATE --expt-relaxed-constexpr --fmad=true -lineinfo)
      list(APPEND variants $<TARGET_OBJECTS:te_sweep_variant_${index}>)
    endforeach()
    add_executable(sweep_block_scaled_gemm ${CMAKE_CURRENT_SOURCE_DIR}/tests/hopper/sweep_block_scaled_gemm.cpp
                   ${variants})
    target_include_directories(sweep_block_scaled_gemm PRIVATE
      ${CMAKE_CURRENT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR}/tests)
    target_include_directories(sweep_block_scaled_gemm SYSTEM PRIVATE "${TE_CUTLASS_INCLUDE}")
    target_link_libraries(sweep_block_scaled_gemm PRIVATE transformer_engine CUDA::cudart)
  endif()

  set(version "")
  if(EXISTS "${TE_CUTLASS_INCLUDE}/cutlass/version.h")
    file(STRINGS "${TE_CUTLASS_INCLUDE}/cutlass/version.h" lines REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*CUTLASS_MINOR ([0-9]+).*CUTLASS_PATCH ([0-9]+).*"
           " \\1.\\2.\\3" version "${lines}")
  endif()
  message(STATUS "CUTLASS Hopper kernels: built for sm_90a, CUTLASS${version} from ${TE_CUTLASS_INCLUDE}")
endfunction()

te_add_cutlass_kernels()
