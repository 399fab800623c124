// commkit/shm.hpp -- POSIX shared-memory segments that are private to the owner and never leak.
//
// Contract:
//   random_shm_name(prefix)          "/<prefix>_<32 hex digits from getrandom()>": unguessable, so
//                                    another user cannot pre-create or guess the segment.
//   shm_free_bytes()                 free bytes of the filesystem behind /dev/shm (0 if unknown).
//   ShmSegment::create(prefix, n)    O_CREAT|O_EXCL, mode 0600, space reserved with posix_fallocate
//                                    (a full /dev/shm fails here with a clear error instead of a
//                                    SIGBUS on first touch), mapped read-write and shared.
//   ShmSegment::attach(name, n)      opens an existing segment (O_RDWR), checks that it is owned by
//                                    this user, closed to group and others, and at least n bytes
//                                    long, and maps it.
//   unlink()                         removes the name (idempotent); the mapping stays valid, and the
//                                    memory is freed once every process unmapped it. Call it as
//                                    soon as every peer has attached, so no exit path can leak it.
//   close()/destructor               unmaps, and unlinks when this object created the segment and
//                                    nobody unlinked it yet.
//   Movable, not copyable. Errors are commkit::Error / commkit::ValueError (never abort).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "commkit/check.hpp"

namespace commkit {

inline std::string random_shm_name(const std::string& prefix) {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    CK_SYS_CHECK(n);
    got += static_cast<size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string name = "/" + prefix + "_";
  for (unsigned char b : bytes) {
    name += hex[b >> 4];
    name += hex[b & 15];
  }
  return name;
}

inline uint64_t shm_free_bytes() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

class ShmSegment {
 public:
  ShmSegment() = default;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }
  ShmSegment& operator=(ShmSegment&& o) noexcept {
    if (this != &o) {
      close();
      name_ = std::move(o.name_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
      owner_ = std::exchange(o.owner_, false);
      linked_ = std::exchange(o.linked_, false);
    }
    return *this;
  }
  ~ShmSegment() { close(); }

  static ShmSegment create(const std::string& prefix, uint64_t bytes) {
    CK_CHECK_ARG(bytes > 0, "shared-memory segment size must be positive");
    CK_CHECK_ARG(prefix.find('/') == std::string::npos, "shm prefix must not contain '/'");
    const uint64_t free_bytes = shm_free_bytes();
    CK_CHECK_ARG(free_bytes == 0 || free_bytes >= bytes, "shared memory too small: need ", bytes,
                 " bytes but /dev/shm has ", free_bytes, " free (raise --shm-size)");
    ShmSegment s;
    int fd = -1;
    for (int attempt = 0; attempt < 4 && fd < 0; ++attempt) {
      s.name_ = random_shm_name(prefix);
      fd = ::shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno != EEXIST) CK_SYS_CHECK(fd);
    }
    CK_CHECK(fd >= 0, "shm_open could not find a free name with prefix ", prefix);
    s.owner_ = true;
    s.linked_ = true;
    int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      ::close(fd);
      s.unlink();
      if (rc == ENOSPC) CK_THROW_ARG("shared memory too small: cannot reserve ", bytes, " bytes in /dev/shm");
      CK_THROW("posix_fallocate(", s.name_, ", ", bytes, ") failed: ", std::strerror(rc));
    }
    s.map(fd, bytes);
    return s;
  }

  static ShmSegment attach(const std::string& name, uint64_t bytes) {
    CK_CHECK_ARG(!name.empty() && name[0] == '/', "shm name must start with '/', got '", name, "'");
    ShmSegment s;
    s.name_ = name;
    s.linked_ = true;  // an explicit unlink() by an attacher is allowed; close() never unlinks it
    int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    CK_CHECK(fd >= 0, "shm_open(", name, ") failed: ", std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int e = errno;
      ::close(fd);
      CK_THROW("fstat(", name, ") failed: ", std::strerror(e));
    }
    if (st.st_uid != ::geteuid()) {
      ::close(fd);
      CK_THROW("shm segment ", name, " is owned by uid ", st.st_uid, ", not by this user");
    }
    // create() makes 0600 segments; group or other access means another user may have written it.
    if ((st.st_mode & 077) != 0) {
      ::close(fd);
      CK_THROW("shm segment ", name, " is accessible to other users (mode 0", (st.st_mode >> 6) & 7,
               (st.st_mode >> 3) & 7, st.st_mode & 7, "); refusing to attach");
    }
    if (bytes == 0) bytes = static_cast<uint64_t>(st.st_size);
    if (static_cast<uint64_t>(st.st_size) < bytes) {
      ::close(fd);
      CK_THROW_ARG("shm segment ", name, " has ", st.st_size, " bytes, expected at least ", bytes);
    }
    s.map(fd, bytes);
    return s;
  }

  void unlink() noexcept {
    if (linked_ && !name_.empty()) ::shm_unlink(name_.c_str());
    linked_ = false;
  }

  void close() noexcept {
    if (ptr_ != nullptr) ::munmap(ptr_, size_);
    ptr_ = nullptr;
    size_ = 0;
    if (owner_) unlink();
    owner_ = false;
  }

  void* data() const { return ptr_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }
  bool linked() const { return linked_; }

 private:
  void map(int fd, uint64_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      if (owner_) unlink();
      CK_THROW("mmap(", name_, ", ", bytes, ") failed: ", std::strerror(e));
    }
    ptr_ = p;
    size_ = bytes;
  }

  std::string name_;
  void* ptr_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;   // created here: unlink on close if still linked
  bool linked_ = false;  // this object still holds a link to the name
};

}  // namespace commkit
