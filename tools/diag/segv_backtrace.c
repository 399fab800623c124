/* LD_PRELOAD shim for a GPU machine without gdb: prints a native backtrace on SIGSEGV.
 * gcc -shared -fPIC -o /tmp/segv.so tools/diag/segv_backtrace.c */
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
static void on_segv(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}
__attribute__((constructor)) static void install(void) { signal(SIGSEGV, on_segv); }
