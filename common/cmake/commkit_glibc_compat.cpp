// Compiled into an extension only by the glibc-compat (manylinux) build: CommkitGlibcCompat.cmake adds it
// when COMMKIT_MANYLINUX is set. Hidden definitions of the few glibc symbols newer than the target glibc
// (2.28) that the build still references: our code through the current headers (stat and fstat are
// library functions since glibc 2.33, before that inline wrappers of __xstat), and the statically linked
// libstdc++.a of gcc 12, which was compiled against a newer glibc (__libc_single_threaded, the
// pthread_*clock* waits, arc4random). Hidden, so they bind inside the extension only and never replace
// libc's for anyone else; with the stub libraries these references would otherwise stay undefined, and
// commkit_glibc_compat.py's check fails the link (a missing symbol would only show on the old system).
//
// Each definition does what the old glibc (or libstdc++ built against it) did, so the behaviour on a
// 2.28 system is that of software built there; where the new function exists at run time (glibc >=
// 2.30 for the clock waits) it is used, found by name and version.
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <cstdlib>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <sys/random.h>
#include <unistd.h>

#define CK_COMPAT extern "C" __attribute__((visibility("hidden"), used))

// ---- stat family: glibc < 2.33 exported only the __xstat versions (_STAT_VER 1 on x86-64); its
// libc_nonshared.a supplied stat & co. as hidden wrappers, as here. struct stat and stat64 are the
// same layout on x86-64 (no <sys/stat.h>: it declares these names with other assembler names).
static_assert(sizeof(void*) == 8, "the stat wrappers below are x86-64's (_STAT_VER 1)");
struct stat;
struct stat64;
extern "C" {
int __xstat(int, const char*, struct stat*);
int __lxstat(int, const char*, struct stat*);
int __fxstat(int, int, struct stat*);
int __fxstatat(int, int, const char*, struct stat*, int);
}
namespace {
constexpr int kStatVer = 1;  // _STAT_VER_LINUX on x86-64
}
CK_COMPAT int stat(const char* p, struct stat* b) { return __xstat(kStatVer, p, b); }
CK_COMPAT int lstat(const char* p, struct stat* b) { return __lxstat(kStatVer, p, b); }
CK_COMPAT int fstat(int fd, struct stat* b) { return __fxstat(kStatVer, fd, b); }
CK_COMPAT int fstatat(int dir, const char* p, struct stat* b, int flags) {
  return __fxstatat(kStatVer, dir, p, b, flags);
}
CK_COMPAT int stat64(const char* p, struct stat64* b) { return __xstat(kStatVer, p, (struct stat*)b); }
CK_COMPAT int lstat64(const char* p, struct stat64* b) { return __lxstat(kStatVer, p, (struct stat*)b); }
CK_COMPAT int fstat64(int fd, struct stat64* b) { return __fxstat(kStatVer, fd, (struct stat*)b); }
CK_COMPAT int fstatat64(int dir, const char* p, struct stat64* b, int flags) {
  return __fxstatat(kStatVer, dir, p, (struct stat*)b, flags);
}

// ---- __libc_single_threaded (glibc 2.32): libstdc++ skips atomic reference counting while it is
// non-zero. 0, "maybe multi-threaded", is always correct (what libstdc++ assumed before 2.32).
extern "C" {
__attribute__((visibility("hidden"), used)) char __libc_single_threaded = 0;
}

// ---- arc4random (glibc 2.36): libstdc++.a's random.o, which the linker takes for a std::string
// member defined there, names it for std::random_device("arc4random"). getrandom is glibc 2.25.
CK_COMPAT uint32_t arc4random(void) {
  uint32_t v;
  unsigned char* p = reinterpret_cast<unsigned char*>(&v);
  size_t got = 0;
  while (got < sizeof v) {
    ssize_t n = getrandom(p + got, sizeof v - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      abort();  // arc4random cannot fail; neither may this
    }
  }
  return v;
}

// ---- The clock-selecting waits (glibc 2.30; libstdc++ uses them for steady_clock deadlines). Where the
// running glibc has them (>= 2.30, looked up by name and version) they are called; on 2.28 the absolute
// deadline is moved to CLOCK_REALTIME and the timed variant waits, as libstdc++ did before 2.30
// (objects with the default CLOCK_REALTIME attribute, which is what libstdc++ creates).
namespace {
template <typename F>
F glibc_function(const char* name) {
#ifdef COMMKIT_GLIBC_COMPAT_FALLBACK  // tests/tools/test_glibc_compat.py: the path glibc < 2.30 takes
  (void)name;
  return nullptr;
#else
  return reinterpret_cast<F>(dlvsym(RTLD_DEFAULT, name, "GLIBC_2.30"));
#endif
}

timespec realtime_deadline(clockid_t clock, const timespec* abstime) {
  if (clock == CLOCK_REALTIME) return *abstime;
  timespec now_clock, now_real;
  clock_gettime(clock, &now_clock);
  clock_gettime(CLOCK_REALTIME, &now_real);
  int64_t rel = (int64_t)(abstime->tv_sec - now_clock.tv_sec) * 1000000000LL + (abstime->tv_nsec - now_clock.tv_nsec);
  if (rel < 0) rel = 0;
  int64_t ns = now_real.tv_nsec + rel % 1000000000LL;
  timespec out;
  out.tv_sec = now_real.tv_sec + rel / 1000000000LL + ns / 1000000000LL;
  out.tv_nsec = ns % 1000000000LL;
  return out;
}

bool clock_ok(clockid_t clock) { return clock == CLOCK_REALTIME || clock == CLOCK_MONOTONIC; }
}  // namespace

CK_COMPAT int pthread_cond_clockwait(pthread_cond_t* c, pthread_mutex_t* m, clockid_t clock, const timespec* t) {
  using F = int (*)(pthread_cond_t*, pthread_mutex_t*, clockid_t, const timespec*);
  static const F real = glibc_function<F>("pthread_cond_clockwait");
  if (real) return real(c, m, clock, t);
  if (!clock_ok(clock)) return EINVAL;
  timespec d = realtime_deadline(clock, t);
  return pthread_cond_timedwait(c, m, &d);
}

CK_COMPAT int pthread_mutex_clocklock(pthread_mutex_t* m, clockid_t clock, const timespec* t) {
  using F = int (*)(pthread_mutex_t*, clockid_t, const timespec*);
  static const F real = glibc_function<F>("pthread_mutex_clocklock");
  if (real) return real(m, clock, t);
  if (!clock_ok(clock)) return EINVAL;
  timespec d = realtime_deadline(clock, t);
  return pthread_mutex_timedlock(m, &d);
}

CK_COMPAT int pthread_rwlock_clockrdlock(pthread_rwlock_t* l, clockid_t clock, const timespec* t) {
  using F = int (*)(pthread_rwlock_t*, clockid_t, const timespec*);
  static const F real = glibc_function<F>("pthread_rwlock_clockrdlock");
  if (real) return real(l, clock, t);
  if (!clock_ok(clock)) return EINVAL;
  timespec d = realtime_deadline(clock, t);
  return pthread_rwlock_timedrdlock(l, &d);
}

CK_COMPAT int pthread_rwlock_clockwrlock(pthread_rwlock_t* l, clockid_t clock, const timespec* t) {
  using F = int (*)(pthread_rwlock_t*, clockid_t, const timespec*);
  static const F real = glibc_function<F>("pthread_rwlock_clockwrlock");
  if (real) return real(l, clock, t);
  if (!clock_ok(clock)) return EINVAL;
  timespec d = realtime_deadline(clock, t);
  return pthread_rwlock_timedwrlock(l, &d);
}

CK_COMPAT int sem_clockwait(sem_t* s, clockid_t clock, const timespec* t) {
  using F = int (*)(sem_t*, clockid_t, const timespec*);
  static const F real = glibc_function<F>("sem_clockwait");
  if (real) return real(s, clock, t);
  if (!clock_ok(clock)) {
    errno = EINVAL;
    return -1;
  }
  timespec d = realtime_deadline(clock, t);
  return sem_timedwait(s, &d);
}
