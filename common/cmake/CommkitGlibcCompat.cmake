# Extensions that load on an older glibc than the build machine's: the release wheels' manylinux tag.
#
#   COMMKIT_MANYLINUX = 2_28 (cache variable; the environment variable of that name overrides it, and
#   tools/release.sh sets that from COMMKIT_PLAT)  |  empty / OFF (default: development and CI builds,
#   nothing changes)
#   commkit_glibc_compat(<target>)   called by commkit_add_extension for every extension
#
# Why: a wheel tagged manylinux_2_28 must load on any glibc >= 2.28 system (AlmaLinux 8, Ubuntu 20.04),
# and auditwheel's policy for it allows symbol versions up to GLIBC_2.28, GLIBCXX_3.4.25, CXXABI_1.3.11
# and GCC_7.0.0. Built plainly on this Debian 12 (glibc 2.36, gcc 12) an extension needs GLIBC_2.34
# (pthread_*, sem_*, dl*, shm_open: glibc 2.34 moved them into libc.so.6 under a new version, and most
# references come from the statically linked libcudart_static.a, out of reach of source-level .symver),
# GLIBC_2.32/2.33 (__libc_single_threaded from libstdc++'s headers; stat/fstat) and GLIBCXX_3.4.29/30.
# There is no manylinux_2_28 image or old sysroot here, so the build is made 2.28-compatible in place:
#
# 1. libstdc++ is linked statically (-static-libstdc++) and its symbols, like every static archive's,
#    are kept out of the extension's dynamic symbol table (--exclude-libs,ALL): no GLIBCXX / CXXABI
#    version is needed, and the extension's std:: calls bind to its own copy even when torch has put the
#    system's (possibly older) libstdc++.so.6 in the global scope. libgcc stays the shared libgcc_s.so.1
#    (its old GCC_3.x versions are within the policy): one unwinder in the process, and gcc 12's
#    libgcc_eh.a would need _dl_find_object (GLIBC_2.35).
# 2. glibc is linked through stub libraries made at configure time from this machine's own by
#    commkit_glibc_compat.py (its docstring says how): each symbol only with its newest version <= the
#    target, in the library that held it on the target glibc (pthread_create in libpthread.so.0, dlopen
#    in libdl.so.2, shm_open in librt.so.1, ...), so every unversioned reference - ours, libstdc++.a's,
#    libcudart_static.a's - binds to what a glibc 2.28 system exports, and still resolves on >= 2.34,
#    where those libraries are shells and libc.so.6 keeps the old versions as compat symbols.
#    libpthread, libdl and librt are always DT_NEEDED (--no-as-needed), as on the target system.
# 3. The few symbols with no version <= the target that the build still references get hidden
#    fallbacks compiled into the extension (commkit_glibc_compat.cpp: stat family, __libc_single_threaded,
#    arc4random, the pthread clock waits), and a check after the link (commkit_glibc_compat.py check)
#    fails the build on anything else: a shared object links with undefined symbols, so a function newer
#    than the target would otherwise show only when the wheel is loaded on the old system.
#
# tools/wheelcheck.py checks the result against the policy and tools/release.sh loads every wheel. A
# development build keeps the plain link (faster, no stubs): the option is for releases only. x86-64 Linux
# with gcc (or clang) and binutils only; the stubs depend only on the build machine's glibc, so the same
# machine always makes the same stubs.
include_guard(GLOBAL)

set(_COMMKIT_GLIBC_COMPAT_DIR "${CMAKE_CURRENT_LIST_DIR}")

# commkit_glibc_compat_setup(): reads COMMKIT_MANYLINUX (cache or environment); when set, (re)makes the
# stubs for that glibc in the build tree (at each configure: well under a second) and sets
# COMMKIT_GLIBC_COMPAT (ON/OFF), COMMKIT_GLIBC_VERSION and COMMKIT_GLIBC_STUBS.
macro(commkit_glibc_compat_setup)
  # The environment variable wins over a cached value: pip reuses a package's build folder
  # (build/<wheel tag>), and a release build must not inherit a development build's plain link.
  set(_ck_doc "release builds: the glibc the extensions must load on, e.g. 2_28 (empty: the build machine's)")
  if(DEFINED ENV{COMMKIT_MANYLINUX})
    set(COMMKIT_MANYLINUX "$ENV{COMMKIT_MANYLINUX}" CACHE STRING "${_ck_doc}" FORCE)
  else()
    set(COMMKIT_MANYLINUX "" CACHE STRING "${_ck_doc}")
  endif()
  set(COMMKIT_GLIBC_COMPAT OFF)
  if(COMMKIT_MANYLINUX AND NOT COMMKIT_MANYLINUX MATCHES "^(OFF|off|0|NO|no|FALSE|false)$")
    if(NOT COMMKIT_MANYLINUX MATCHES "^(manylinux_)?2_([0-9]+)(_x86_64)?$")
      message(FATAL_ERROR "commkit: COMMKIT_MANYLINUX='${COMMKIT_MANYLINUX}': expected a glibc such as 2_28")
    endif()
    set(_ck_minor "${CMAKE_MATCH_2}")
    set(_ck_glibc "2.${_ck_minor}")
    if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR NOT CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64)$")
      message(FATAL_ERROR "commkit: COMMKIT_MANYLINUX is for x86-64 Linux builds")
    endif()
    if(NOT Python_EXECUTABLE)
      find_package(Python 3.9 REQUIRED COMPONENTS Interpreter)
    endif()
    set(COMMKIT_GLIBC_STUBS "${CMAKE_BINARY_DIR}/commkit_glibc_2_${_ck_minor}")
    set(COMMKIT_GLIBC_VERSION "${_ck_glibc}")
    # Made again when the generator changes (CMake reconfigures then).
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
                 "${_COMMKIT_GLIBC_COMPAT_DIR}/commkit_glibc_compat.py")
    execute_process(COMMAND "${Python_EXECUTABLE}" "${_COMMKIT_GLIBC_COMPAT_DIR}/commkit_glibc_compat.py" stubs
                            --glibc "${_ck_glibc}" --cxx "${CMAKE_CXX_COMPILER}" --out "${COMMKIT_GLIBC_STUBS}"
                    RESULT_VARIABLE _ck_rc OUTPUT_VARIABLE _ck_out ERROR_VARIABLE _ck_err
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT _ck_rc EQUAL 0)
      message(FATAL_ERROR "commkit: could not make the glibc ${_ck_glibc} stub libraries:\n${_ck_out}\n${_ck_err}")
    endif()
    message(STATUS "${_ck_out}")
    message(STATUS "commkit: extensions for glibc >= ${_ck_glibc} (manylinux_2_${_ck_minor}): "
                   "stub glibc, static libstdc++")
    set(COMMKIT_GLIBC_COMPAT ON)
  endif()
endmacro()

# commkit_glibc_compat(<target>): the compat link of one shared object (no-op unless COMMKIT_MANYLINUX).
function(commkit_glibc_compat target)
  if(NOT COMMKIT_GLIBC_COMPAT)
    return()
  endif()
  target_sources(${target} PRIVATE "${_COMMKIT_GLIBC_COMPAT_DIR}/commkit_glibc_compat.cpp")
  # -L first: the stubs' linker scripts shadow the system's libc.so, libm.so, ... for -lc, -lm, -lpthread,
  # -ldl, -lrt (the compiler's own -L folders come after the command line's).
  target_link_options(${target} PRIVATE "-L${COMMKIT_GLIBC_STUBS}" -static-libstdc++ "LINKER:--exclude-libs,ALL")
  target_link_libraries(${target} PRIVATE "-Wl,--push-state,--no-as-needed" pthread dl rt "-Wl,--pop-state")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND "${Python_EXECUTABLE}" "${_COMMKIT_GLIBC_COMPAT_DIR}/commkit_glibc_compat.py" check
            --glibc "${COMMKIT_GLIBC_VERSION}" --cxx "${CMAKE_CXX_COMPILER}" "$<TARGET_FILE:${target}>"
    COMMENT "commkit: checking $<TARGET_FILE_NAME:${target}> against glibc ${COMMKIT_GLIBC_VERSION}"
    VERBATIM)
endfunction()
