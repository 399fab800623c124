// elastic_ep/csrc/host/trace.hpp -- the set-up / teardown trace of the runtime and its windows
// (RuntimeOptions::debug, from EP_BUFFER_DEBUG): one stderr line per step, "[elastic_ep] ...".
#pragma once

#include <cstdarg>
#include <cstdio>

namespace elastic_ep {

__attribute__((format(printf, 2, 3))) inline void trace(bool on, const char* fmt, ...) {
  if (!on) return;
  std::va_list args;
  va_start(args, fmt);
  std::fputs("[elastic_ep] ", stderr);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fflush(stderr);
}

}  // namespace elastic_ep
