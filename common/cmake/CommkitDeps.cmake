# Shared build logic of the three packages (include()d by each package's CMakeLists.txt and by the
# top-level superbuild). Provides:
#   commkit_setup()                        Python, pybind11, CUDA auto-detection
#   commkit_find_nccl([OPTIONAL])          imported target commkit::nccl (+ COMMKIT_NCCL_VERSION_CODE);
#                                          OPTIONAL: COMMKIT_NCCL_FOUND OFF instead of an error when absent
#   commkit_add_extension(<target> MODULE <name> SOURCES .. [CUDA_SOURCES ..] [NCCL] [DESTINATION d])
#
# torch is not needed to build: no extension includes a torch header or links libtorch (they take raw
# pointers and stream handles), so pybind11 and NCCL are found without importing torch and a wheel
# built here works with any torch the user has.
#
# CUDA tiers (COMMKIT_BUILD_CUDA = AUTO | ON | OFF; env var of the same name overrides):
#   OFF   host code only (the extension reports built_with_cuda() == False)
#   AUTO  compile the CUDA sources when nvcc is found, for CMAKE_CUDA_ARCHITECTURES (-D or the CUDAARCHS
#         environment variable; default 90a)
#   ON    as AUTO, but fail when nvcc is missing
# COMMKIT_RELOCATABLE=ON (release wheels): the extension's run path holds only $ORIGIN-relative folders
# (NVIDIA's wheels beside it in site-packages), never a folder of the build machine.
# COMMKIT_MANYLINUX=2_28 (release wheels; env var of the same name): extensions that load on glibc >= 2.28
# although built on a newer one (stub glibc libraries, static libstdc++): see CommkitGlibcCompat.cmake.
include_guard(GLOBAL)
include("${CMAKE_CURRENT_LIST_DIR}/CommkitGlibcCompat.cmake")

macro(commkit_setup)
  if(NOT DEFINED COMMKIT_BUILD_CUDA)
    if(DEFINED ENV{COMMKIT_BUILD_CUDA})
      set(COMMKIT_BUILD_CUDA "$ENV{COMMKIT_BUILD_CUDA}")
    else()
      set(COMMKIT_BUILD_CUDA AUTO)
    endif()
  endif()
  set(COMMKIT_BUILD_CUDA "${COMMKIT_BUILD_CUDA}" CACHE STRING "AUTO, ON or OFF")
  if(NOT DEFINED COMMKIT_RELOCATABLE AND DEFINED ENV{COMMKIT_RELOCATABLE})
    set(COMMKIT_RELOCATABLE "$ENV{COMMKIT_RELOCATABLE}")
  endif()
  option(COMMKIT_RELOCATABLE "run paths relative to site-packages only (release wheels)" OFF)

  find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
  commkit_glibc_compat_setup()

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

  set(COMMKIT_WITH_CUDA OFF)
  if(NOT COMMKIT_BUILD_CUDA STREQUAL "OFF")
    include(CheckLanguage)
    if(NOT CMAKE_CUDA_COMPILER AND EXISTS "/usr/local/cuda/bin/nvcc")
      set(CMAKE_CUDA_COMPILER "/usr/local/cuda/bin/nvcc")
    endif()
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      # enable_language() would take CUDAARCHS itself, but only when nothing set the variable first.
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
        if(DEFINED ENV{CUDAARCHS} AND NOT "$ENV{CUDAARCHS}" STREQUAL "")
          set(CMAKE_CUDA_ARCHITECTURES "$ENV{CUDAARCHS}")
        else()
          set(CMAKE_CUDA_ARCHITECTURES 90a)
        endif()
      endif()
      enable_language(CUDA)
      find_package(CUDAToolkit REQUIRED)
      set(COMMKIT_WITH_CUDA ON)
      list(JOIN CMAKE_CUDA_ARCHITECTURES ", sm_" _ck_archs)
      message(STATUS "commkit: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, kernels for sm_${_ck_archs}")
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
    message(FATAL_ERROR "commkit: NCCL not found. Install nvidia-nccl-cu13 (or -cu12; the CUDA build of torch "
                        "brings one), or set NCCL_HOME to a folder with include/nccl.h")
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
    # libnccl.so.2 comes from NVIDIA's wheel (nvidia-nccl-cu12 and -cu13 both install it into
    # site-packages/nvidia/nccl/lib) and is never bundled; torch, when imported first, has loaded the
    # same soname already. A development build also keeps the NCCL it was built against, for an
    # extension loaded through a symbolic link (where $ORIGIN is the link's folder).
    set(_rpath "$ORIGIN/../nvidia/nccl/lib")
    if(NOT COMMKIT_RELOCATABLE)
      list(APPEND _rpath "${COMMKIT_NCCL_ROOT}/lib")
    endif()
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "${_rpath}" BUILD_RPATH "${COMMKIT_NCCL_ROOT}/lib")
    set(COMMKIT_NCCL_VERSION_CODE ${COMMKIT_NCCL_VERSION_CODE} PARENT_SCOPE)
    set(COMMKIT_NCCL_HAS_DEVICE_API ${COMMKIT_NCCL_HAS_DEVICE_API} PARENT_SCOPE)
  endif()
  commkit_glibc_compat(${target})
  if(A_DESTINATION)
    install(TARGETS ${target} LIBRARY DESTINATION "${A_DESTINATION}")
  endif()
endfunction()
