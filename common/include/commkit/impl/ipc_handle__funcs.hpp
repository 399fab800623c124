// commkit/impl/ipc_handle__funcs.hpp -- the functions of commkit/ipc_handle.hpp (see there for the
// contract). Included inside namespace commkit.
#include <cstring>

inline void check_ipc_handle_list(const std::vector<std::string>& handles, int rank, const std::string& own,
                                  const char* what, size_t handle_bytes) {
  CK_CHECK_ARG(rank >= 0 && static_cast<size_t>(rank) < handles.size(), what, ": expected one handle per rank, got ",
               handles.size(), " for rank ", rank);
  for (size_t p = 0; p < handles.size(); ++p)
    CK_CHECK_ARG(handles[p].size() == handle_bytes, what, ": handle of rank ", p, " has ", handles[p].size(),
                 " bytes, expected ", handle_bytes);
  CK_CHECK_ARG(handles[static_cast<size_t>(rank)] == own, what, ": entry ", rank,
               " is not this rank's own handle; the handles must be ordered by rank");
}

inline std::string describe_ipc_handle(const IpcHandleFormat& fmt, const IpcWindowInfo& info, const std::string& raw) {
  CK_CHECK_ARG(raw.size() == kIpcHandleBytes, "a CUDA IPC handle has ", kIpcHandleBytes, " bytes, got ", raw.size());
  std::string out(kDescribedIpcHandleBytes, '\0');
  char* p = &out[0];
  std::memcpy(p, fmt.tag, 8);
  std::memcpy(p + 8, &info.world, 4);
  std::memcpy(p + 12, &info.rank, 4);
  std::memcpy(p + 16, &info.layout_bytes, 8);
  std::memcpy(p + 24, &info.alloc_bytes, 8);
  std::memcpy(p + kDescribedIpcHeaderBytes, raw.data(), kIpcHandleBytes);
  return out;
}

inline std::vector<std::string> check_described_ipc_handles(const IpcHandleFormat& fmt,
                                                            const std::vector<std::string>& handles,
                                                            const IpcWindowInfo& self, const std::string& own,
                                                            const char* what) {
  CK_CHECK_ARG(handles.size() == static_cast<size_t>(self.world), what, ": expected ", self.world,
               " handles (one per rank, in rank order), got ", handles.size());
  // self.rank indexes `handles` below; an out-of-range rank would read past the vector.
  CK_CHECK_ARG(self.rank >= 0 && self.rank < self.world, what, ": rank ", self.rank, " is outside [0, world_size=",
               self.world, ")");
  std::vector<std::string> raw(handles.size());
  for (size_t p = 0; p < handles.size(); ++p) {
    const std::string& h = handles[p];
    CK_CHECK_ARG(h.size() == kDescribedIpcHandleBytes && std::memcmp(h.data(), fmt.tag, 8) == 0, what, ": entry ", p,
                 " (", h.size(), " bytes) is not a handle from get_local_ipc_handle() of this ", fmt.owner,
                 " version (", kDescribedIpcHandleBytes,
                 " bytes); every rank must run the same version and pass the bytes unchanged");
    IpcWindowInfo info;
    std::memcpy(&info.world, h.data() + 8, 4);
    std::memcpy(&info.rank, h.data() + 12, 4);
    std::memcpy(&info.layout_bytes, h.data() + 16, 8);
    std::memcpy(&info.alloc_bytes, h.data() + 24, 8);
    CK_CHECK_ARG(info.rank == static_cast<int32_t>(p), what, ": entry ", p, " holds the handle of rank ", info.rank,
                 "; pass every rank's handle, ordered by rank");
    CK_CHECK_ARG(info.world == self.world, what, ": rank ", p, " was built with world_size ", info.world,
                 ", this rank (", self.rank, ") with ", self.world);
    CK_CHECK_ARG(info.layout_bytes == self.layout_bytes, what, ": rank ", p, " was built with ", fmt.layout_name, " ",
                 info.layout_bytes, " bytes, this rank (", self.rank, ") with ", self.layout_bytes, fmt.layout_hint);
    CK_CHECK_ARG(info.alloc_bytes == self.alloc_bytes, what, ": rank ", p, " has a buffer of ", info.alloc_bytes,
                 " bytes, this rank (", self.rank, ") ", self.alloc_bytes, " for the same layout; every rank must run "
                 "the same ", fmt.owner, " build");
    raw[p] = h.substr(kDescribedIpcHeaderBytes);
  }
  CK_CHECK_ARG(handles[static_cast<size_t>(self.rank)] == own, what, ": entry ", self.rank,
               " is not this rank's own handle; the handles must be ordered by rank");
  return raw;
}
