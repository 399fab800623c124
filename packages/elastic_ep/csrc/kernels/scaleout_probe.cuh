// elastic_ep/csrc/kernels/scaleout_probe.cuh -- one ring step over a scale-out transport (scaleout.cuh):
// every rank puts `bytes` from its window at `src` into the next rail peer's window at `dst` and raises
// that peer's signal[rank] by 1 behind the data, then waits until signal[prev] >= round (the previous
// peer's put of this round has landed). It exercises put_signal / wait_signal of a backend end to end:
// the NVLink-emulated one runs on one node (ranks may share a GPU over the CUDA-IPC window); the GIN one
// runs where the runtime has GIN contexts (RDMA NICs; it compiles everywhere, launched by launch.cu).
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"
#include "scaleout.cuh"

namespace elastic_ep {
namespace {

template <class Scaleout>
__global__ void __launch_bounds__(32, 1) scaleout_probe_kernel(Scaleout tr,
                                                               ScaleoutProbeParams p,   // see launch.hpp
                                                               commkit::TimeoutRecord* rec,
                                                               uint64_t timeout_ns) {
  const int lane = threadIdx.x;
  tr.put_signal(p.next, p.dst, p.src, p.bytes, lane, tr.rank, 1);
  tr.flush(lane);
  if (lane == 0) tr.wait_signal(p.prev, p.round, timeout_ns, rec, kOpScaleoutProbe, p.prev);
}

}  // namespace
}  // namespace elastic_ep
