// commkit/ptx.cuh -- 16-byte vector loads and stores with explicit cache behaviour (device only).
//
// Contract (p: a 16-byte aligned pointer into global memory, local or a peer's over NVLink):
//   ld_nc_v4(p)          load on the read-only path that does not allocate in L1
//                        (ld.global.nc.L1::no_allocate): input streams read once that nothing writes
//                        while the kernel runs. No "memory" clobber: the compiler may move it.
//   ld_v4<kL2Only>(p)    coherent load (ld.global) for data that peers wrote before this kernel (e.g.
//                        behind a done signal). kL2Only = true skips L1 (ld.global.cg) for data that
//                        may land while the kernel runs: an L1 line filled earlier, e.g. for a
//                        neighbouring record, could be stale. Ordered with other memory accesses.
//   st_na_v4(p, v)       store that does not allocate in L1 (st.global.L1::no_allocate): pushes into a
//                        peer's memory and outputs this kernel does not read back. Ordered with other
//                        memory accesses.
// All are `asm volatile` and force-inlined, so a kernel that switches to them from a copy of the same
// asm compiles to the same instructions.
#pragma once

#include "commkit/impl/ptx__funcs.cuh"
