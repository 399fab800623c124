// commkit/atomics.hpp -- acquire/release loads and stores and system-scope atomics,
// one spelling for host and device code.
//
// Contract (T is a 32- or 64-bit integer type):
//   ld_acquire(p)        load with acquire order, system scope (visible across GPUs and the CPU).
//   ld_relaxed(p)        relaxed (volatile) load; no ordering.
//   st_release(p, v)     store with release order, system scope.
//   st_relaxed(p, v)     relaxed store.
//   fetch_add(p, v)      atomic add, acq_rel, system scope; returns the old value.
//   red_add_release(p, v) atomic add without a result, release order, system scope: publishes this
//                        thread's earlier stores with the count (a warp's or block's too, after a
//                        __syncwarp / __syncthreads, by the same causality as block_fence_system).
//   cas(p, expected, v)  atomic compare-and-swap, acq_rel, system scope; returns the old value
//                        (succeeded iff the result == expected).
//   exchange(p, v)       atomic exchange, acq_rel, system scope; returns the old value.
//   fence_system()       full fence at system scope.
// The *_gpu variants (device only) use GPU scope, for data that never leaves one GPU.
//   block_fence_system() device only, called by every thread of a block: the block's earlier stores
//                        (to local, peer or host memory) are ordered before every later store or
//                        atomic of thread 0, system-wide. One fence per block, not one per thread
//                        (a per-thread system fence cost ~1 us per block at 132 SMs).
//   grid_arrive_last<kSystemScope>(counter) device only, called once, at its end, by every thread
//                        of every block of a grid: true (in every thread) in the block that arrived
//                        last, which then sees every other block's earlier stores and finds
//                        *counter reset to 0 for the next launch. kSystemScope orders the blocks'
//                        stores to peer or host memory too; false orders GPU memory only (cheaper).
//                        `counter` starts at 0 and counts this grid's blocks only.
// On the host these map to the GCC __atomic builtins, which are lock-free on x86-64 for 4 and
// 8 bytes and so work on process-shared and cudaHostRegister'ed memory. On the device they are
// PTX ld.acquire.sys / st.release.sys / atom.*.acq_rel.sys.
#pragma once

#include <cstdint>
#include <type_traits>

#include "commkit/platform.hpp"

namespace commkit {

#include "commkit/impl/atomics__funcs.hpp"

}  // namespace commkit
