# cuDNN's fused attention (src/attention/cudnn), compiled into transformer_engine when the
# headers it needs are found; without them the build goes on and the attention entry points use
# their other backends. Included by cpp/CMakeLists.txt after the transformer_engine target is
# made, in CUDA builds only.
#
# Headers (compile time only):
#   cudnn_frontend.h  TE_CUDNN_FRONTEND_INCLUDE_DIR; default: the include/ directory that the
#                     nvidia-cudnn-frontend wheel puts beside the `cudnn` package (site-packages,
#                     or the directory of a `pip install --target`), then system directories.
#   cudnn.h           TE_CUDNN_INCLUDE_DIR; default: the Python environment's nvidia/cudnn/include
#                     (the nvidia-cudnn-cu* wheels), then system directories.
#   nvrtc.h           the CUDA toolkit's, else the Python environment's nvidia/cu13/include or
#                     nvidia/cuda_nvrtc/include (cudnn-frontend includes it; NVRTC itself is
#                     opened at run time, and only by engines that compile kernels).
#
# No link-time dependency on cuDNN: cudnn-frontend's dynamic-loading mode opens libcudnn.so.9
# when the first attention call asks for it (src/attention/cudnn/cudnn_library.h says which copy
# wins). For the Python environment's copy to come before the system's, the library's RUNPATH
# gets that environment's nvidia/cudnn/lib, relative to the installed wheel layout
# (site-packages/transformer_engine/common/lib) and as found here.
#
# TE_WITH_CUDNN: AUTO (default: when the headers are found), ON (fail the configure without
# them) or OFF.
set(TE_WITH_CUDNN "AUTO" CACHE STRING "Compile the cuDNN fused-attention backend: AUTO, ON or OFF")
set_property(CACHE TE_WITH_CUDNN PROPERTY STRINGS AUTO ON OFF)

include(${CMAKE_CURRENT_LIST_DIR}/python_dirs.cmake)

function(te_add_cudnn_backend)
  if(TE_WITH_CUDNN STREQUAL "OFF")
    message(STATUS "cuDNN fused attention: off (TE_WITH_CUDNN=OFF)")
    return()
  endif()
  te_python_dirs(py_dirs)

  find_path(TE_CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h
            HINTS ${py_dirs} PATH_SUFFIXES include
            DOC "Directory holding cudnn_frontend.h (nvidia-cudnn-frontend's include/)")
  find_path(TE_CUDNN_INCLUDE_DIR cudnn.h
            HINTS ${py_dirs} PATH_SUFFIXES nvidia/cudnn/include include
            DOC "Directory holding cudnn.h")
  find_path(TE_NVRTC_INCLUDE_DIR nvrtc.h
            HINTS ${CUDAToolkit_INCLUDE_DIRS} ${py_dirs}
            PATH_SUFFIXES nvidia/cu13/include nvidia/cuda_nvrtc/include include
            DOC "Directory holding nvrtc.h")

  set(missing)
  foreach(var TE_CUDNN_FRONTEND_INCLUDE_DIR TE_CUDNN_INCLUDE_DIR TE_NVRTC_INCLUDE_DIR)
    if(NOT ${var})
      list(APPEND missing ${var})
    endif()
  endforeach()
  if(missing)
    string(REPLACE ";" ", " missing "${missing}")
    set(why "not found: ${missing} (set them to the directories of cudnn_frontend.h, cudnn.h, nvrtc.h)")
    if(TE_WITH_CUDNN STREQUAL "ON")
      message(FATAL_ERROR "TE_WITH_CUDNN=ON, but the cuDNN fused-attention headers were ${why}")
    endif()
    message(STATUS "cuDNN fused attention: not built, ${why}")
    return()
  endif()

  # nvrtc.h alone, copied: a wheel's include directory (nvidia/cu13/include) holds other CUDA
  # headers too, which must not shadow the toolkit's.
  set(nvrtc_dir "${CMAKE_CURRENT_BINARY_DIR}/cudnn_nvrtc_include")
  file(COPY "${TE_NVRTC_INCLUDE_DIR}/nvrtc.h" DESTINATION "${nvrtc_dir}")

  set(dir ${CMAKE_CURRENT_SOURCE_DIR}/src/attention/cudnn)
  set(host_sources ${dir}/attention_cudnn.cpp ${dir}/attention_cudnn_problem.cpp ${dir}/cudnn_library.cpp)
  target_sources(transformer_engine PRIVATE ${host_sources} ${dir}/attention_cudnn_aux.cu)
  # SYSTEM: the frontend's headers are not warning-clean under -Wall -Wextra.
  target_include_directories(transformer_engine SYSTEM PRIVATE
    "${TE_CUDNN_FRONTEND_INCLUDE_DIR}" "${TE_CUDNN_INCLUDE_DIR}" "${nvrtc_dir}")
  target_compile_definitions(transformer_engine PRIVATE TE_WITH_CUDNN)
  # Hidden symbols: the frontend is header-only, and another copy of it in the process
  # (PyTorch's, of another version) must not interpose on ours, nor ours on it.
  set_source_files_properties(${host_sources} PROPERTIES
    COMPILE_OPTIONS "-fvisibility=hidden;-fvisibility-inlines-hidden")
  target_link_libraries(transformer_engine PRIVATE ${CMAKE_DL_LIBS})

  # Where libcudnn.so.9 is opened from: the wheel layout first, then the directory found here,
  # both ahead of the entries already there (the CUDA toolkit's lib directory, which the
  # frontend's own libcudart comes from, may hold a system cuDNN of another version).
  set(rpath "$ORIGIN/../../../nvidia/cudnn/lib")
  get_filename_component(cudnn_root "${TE_CUDNN_INCLUDE_DIR}" DIRECTORY)
  if(EXISTS "${cudnn_root}/lib")
    list(APPEND rpath "${cudnn_root}/lib")
    set_property(TARGET transformer_engine APPEND PROPERTY BUILD_RPATH "${cudnn_root}/lib")
  endif()
  get_target_property(install_rpath transformer_engine INSTALL_RPATH)
  if(install_rpath)
    list(PREPEND install_rpath ${rpath})
  else()
    set(install_rpath ${rpath})
  endif()
  set_property(TARGET transformer_engine PROPERTY INSTALL_RPATH "${install_rpath}")

  # The GPU check of the backend (tests/cudnn/attention_cudnn_check.cu): built on request only
  # (cmake --build <dir> --target attention_cudnn_check), never by ctest, since it needs a GPU.
  add_executable(attention_cudnn_check EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/tests/cudnn/attention_cudnn_check.cu)
  target_include_directories(attention_cudnn_check PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(attention_cudnn_check PRIVATE transformer_engine CUDA::cudart)

  set(version "")
  if(EXISTS "${TE_CUDNN_INCLUDE_DIR}/cudnn_version.h")
    file(STRINGS "${TE_CUDNN_INCLUDE_DIR}/cudnn_version.h" lines REGEX "#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ")
    string(REGEX REPLACE ".*CUDNN_MAJOR ([0-9]+).*CUDNN_MINOR ([0-9]+).*CUDNN_PATCHLEVEL ([0-9]+).*"
           " (headers \\1.\\2.\\3)" version "${lines}")
  endif()
  message(STATUS "cuDNN fused attention: built${version}, frontend ${TE_CUDNN_FRONTEND_INCLUDE_DIR}, "
                 "cuDNN ${TE_CUDNN_INCLUDE_DIR}; libcudnn.so.9 is opened at run time")
endfunction()

te_add_cudnn_backend()
