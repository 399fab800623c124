# Shared build logic of the three packages (include()d by each package's CMakeLists.txt and by the
# top-level superbuild). Provides:
#   commkit_setup()                        Python, pybind11, torch location, CUDA auto-detection
#   commkit_find_nccl([OPTIONAL])          imported target commkit::nccl (+ COMMKIT_NCCL_VERSION_CODE);
#                                          OPTIONAL: COMMKIT_NCCL_FOUND OFF instead of an error when absent
#   commkit_add_extension(<target> MODULE <name> SOURCES .. [CUDA_SOURCES ..] [NCCL] [DESTINATION d])
#   commkit_use_torch(<target>)            link libtorch for a package that needs its C++ API
#
# CUDA tiers (COMMKIT_BUILD_CUDA = AUTO | ON | OFF; env var of the same name overrides):
#   OFF   host code only (the extension reports built_with_cuda() == False)
#   AUTO  compile the CUDA sources when nvcc is found, for sm_90a only (CMAKE_CUDA_ARCHITECTURES)
#   ON    as AUTO, but fail when nvcc is missing
# Kernels take raw pointers and include no torch header, so a CPU-only torch still builds them.
include_guard(GLOBAL)

macro(commkit_setup)
  if(NOT DEFINED COMMKIT_BUILD_CUDA)
    if(DEFINED ENV{COMMKIT_BUILD_CUDA})
      set(COMMKIT_BUILD_CUDA "$ENV{COMMKIT_BUILD_CUDA}")
    else()
      set(COMMKIT_BUILD_CUDA AUTO)
    endif()
  endif()
  set(COMMKIT_BUILD_CUDA "${COMMKIT_BUILD_CUDA}" CACHE STRING "AUTO, ON or OFF")

  find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)

  # pybind11: prefer the one pip installed into this interpreter.
  if(NOT pybind11_FOUND)
    execute_process(COMMAND "${Python_EXECUTABLE}" -m pybind11 --cmakedir
                    OUTPUT_VARIABLE _ck_pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE _ck_rc ERROR_QUIET)
    if(_ck_rc EQUAL 0)
      list(APPEND CMAKE_PREFIX_PATH "${_ck_pybind11_dir}")
    endif()
    find_package(pybind11 CONFIG REQUIRED)
  endif()

  # torch: located through torch.utils.cmake_prefix_path (linked only by commkit_use_torch). In the
  # superbuild the packages inherit the top level's answer (importing torch costs seconds each time).
  if(NOT DEFINED COMMKIT_TORCH_CMAKE_PREFIX)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(torch.version.cuda or '')"
      OUTPUT_VARIABLE _ck_torch_out OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _ck_rc ERROR_QUIET)
    if(NOT _ck_rc EQUAL 0)
      message(FATAL_ERROR "commkit: torch is not importable by ${Python_EXECUTABLE}; install torch first "
                          "and build with --no-build-isolation")
    endif()
    string(REPLACE "\n" ";" _ck_torch_out "${_ck_torch_out}")
    list(GET _ck_torch_out 0 COMMKIT_TORCH_CMAKE_PREFIX)
    list(GET _ck_torch_out 1 COMMKIT_TORCH_VERSION)
    list(LENGTH _ck_torch_out _ck_n)
    set(COMMKIT_TORCH_CUDA "")
    if(_ck_n GREATER 2)
      list(GET _ck_torch_out 2 COMMKIT_TORCH_CUDA)
    endif()
    list(APPEND CMAKE_PREFIX_PATH "${COMMKIT_TORCH_CMAKE_PREFIX}")
    message(STATUS "commkit: torch ${COMMKIT_TORCH_VERSION} (CUDA '${COMMKIT_TORCH_CUDA}') at ${COMMKIT_TORCH_CMAKE_PREFIX}")
  endif()

  set(COMMKIT_WITH_CUDA OFF)
  if(NOT COMMKIT_BUILD_CUDA STREQUAL "OFF")
    include(CheckLanguage)
    if(NOT CMAKE_CUDA_COMPILER AND EXISTS "/usr/local/cuda/bin/nvcc")
      set(CMAKE_CUDA_COMPILER "/usr/local/cuda/bin/nvcc")
    endif()
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
        set(CMAKE_CUDA_ARCHITECTURES 90a)
      endif()
      enable_language(CUDA)
      find_package(CUDAToolkit REQUIRED)
      set(COMMKIT_WITH_CUDA ON)
      message(STATUS "commkit: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, kernels for sm_${CMAKE_CUDA_ARCHITECTURES}")
    elseif(COMMKIT_BUILD_CUDA STREQUAL "ON")
      message(FATAL_ERROR "commkit: COMMKIT_BUILD_CUDA=ON but no CUDA compiler (nvcc) was found")
    else()
      message(STATUS "commkit: no nvcc found; building the host-only extension")
    endif()
  endif()

  if(NOT TARGET commkit_common)
    add_subdirectory("${COMMKIT_COMMON_DIR}" "${CMAKE_BINARY_DIR}/commkit_common")
  endif()
endmacro()

# NCCL from (in order) -DNCCL_HOME, $NCCL_HOME, $NCCL_ROOT, the nvidia-nccl-cu13 / -cu12 wheel.
function(commkit_find_nccl)
  cmake_parse_arguments(A "OPTIONAL" "" "" ${ARGN})
  if(TARGET commkit::nccl)
    set(COMMKIT_NCCL_FOUND ON PARENT_SCOPE)
    return()
  endif()
  set(_root "")
  if(DEFINED NCCL_HOME)
    set(_root "${NCCL_HOME}")
  elseif(DEFINED ENV{NCCL_HOME})
    set(_root "$ENV{NCCL_HOME}")
  elseif(DEFINED ENV{NCCL_ROOT})
    set(_root "$ENV{NCCL_ROOT}")
  else()
    execute_process(COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
                    OUTPUT_VARIABLE _root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  if(NOT _root OR NOT EXISTS "${_root}/include/nccl.h")
    if(A_OPTIONAL)
      set(COMMKIT_NCCL_FOUND OFF PARENT_SCOPE)
      return()
    endif()
    message(FATAL_ERROR "commkit: NCCL not found. Install nvidia-nccl-cu13 (or -cu12), which the CUDA "
                        "build of torch brings, or set NCCL_HOME to a folder with include/nccl.h")
  endif()
  find_library(_ck_nccl_lib NAMES libnccl.so.2 nccl PATHS "${_root}/lib" "${_root}/lib64" NO_DEFAULT_PATH)
  if(NOT _ck_nccl_lib)
    message(FATAL_ERROR "commkit: ${_root} has include/nccl.h but no lib/libnccl.so.2")
  endif()
  file(STRINGS "${_root}/include/nccl.h" _ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*" "\\1" _maj "${_ver}")
  string(REGEX REPLACE ".*NCCL_MINOR ([0-9]+).*" "\\1" _min "${_ver}")
  string(REGEX REPLACE ".*NCCL_PATCH ([0-9]+).*" "\\1" _pat "${_ver}")
  math(EXPR _code "${_maj} * 10000 + ${_min} * 100 + ${_pat}")
  set(COMMKIT_NCCL_VERSION_CODE ${_code} PARENT_SCOPE)
  set(COMMKIT_NCCL_VERSION "${_maj}.${_min}.${_pat}" PARENT_SCOPE)
  set(COMMKIT_NCCL_ROOT "${_root}" PARENT_SCOPE)
  set(COMMKIT_NCCL_FOUND ON PARENT_SCOPE)
  set(COMMKIT_NCCL_HAS_DEVICE_API OFF PARENT_SCOPE)
  if(EXISTS "${_root}/include/nccl_device.h")
    set(COMMKIT_NCCL_HAS_DEVICE_API ON PARENT_SCOPE)
  endif()
  add_library(commkit::nccl SHARED IMPORTED GLOBAL)
  set_target_properties(commkit::nccl PROPERTIES IMPORTED_LOCATION "${_ck_nccl_lib}"
                        IMPORTED_NO_SONAME OFF INTERFACE_INCLUDE_DIRECTORIES "${_root}/include")
  message(STATUS "commkit: NCCL ${_maj}.${_min}.${_pat} at ${_root}")
endfunction()

# commkit_add_extension(<target> MODULE <name> SOURCES ... [CUDA_SOURCES ...] [NCCL] [DESTINATION d])
function(commkit_add_extension target)
  cmake_parse_arguments(A "NCCL" "MODULE;DESTINATION" "SOURCES;CUDA_SOURCES" ${ARGN})
  set(_srcs ${A_SOURCES})
  if(COMMKIT_WITH_CUDA)
    list(APPEND _srcs ${A_CUDA_SOURCES})
  endif()
  pybind11_add_module(${target} MODULE ${_srcs})
  set_target_properties(${target} PROPERTIES OUTPUT_NAME "${A_MODULE}" CXX_STANDARD 17
                        CXX_STANDARD_REQUIRED ON CXX_VISIBILITY_PRESET hidden)
  target_link_libraries(${target} PRIVATE commkit::common)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wno-unused-function>)
  if(COMMKIT_WITH_CUDA)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON
                          CUDA_SEPARABLE_COMPILATION OFF CUDA_RUNTIME_LIBRARY Static)
    target_compile_definitions(${target} PRIVATE COMMKIT_WITH_CUDA=1)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-fvisibility=hidden>)
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
  else()
    target_compile_definitions(${target} PRIVATE COMMKIT_WITH_CUDA=0)
  endif()
  if(A_NCCL)
    commkit_find_nccl()
    target_link_libraries(${target} PRIVATE commkit::nccl)
    target_compile_definitions(${target} PRIVATE COMMKIT_BUILD_NCCL_VERSION_CODE=${COMMKIT_NCCL_VERSION_CODE})
    # The wheel's lib folder relative to site-packages/<pkg>/, then the build-time location.
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/../nvidia/nccl/lib;${COMMKIT_NCCL_ROOT}/lib"
                          BUILD_RPATH "${COMMKIT_NCCL_ROOT}/lib")
    set(COMMKIT_NCCL_VERSION_CODE ${COMMKIT_NCCL_VERSION_CODE} PARENT_SCOPE)
    set(COMMKIT_NCCL_HAS_DEVICE_API ${COMMKIT_NCCL_HAS_DEVICE_API} PARENT_SCOPE)
  endif()
  if(A_DESTINATION)
    install(TARGETS ${target} LIBRARY DESTINATION "${A_DESTINATION}")
  endif()
endfunction()

function(commkit_use_torch target)
  find_package(Torch REQUIRED CONFIG)
  find_library(_ck_torch_python torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)
  target_link_libraries(${target} PRIVATE ${TORCH_LIBRARIES} ${_ck_torch_python})
endfunction()
