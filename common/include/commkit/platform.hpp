// commkit/platform.hpp -- compiler portability macros shared by host and device code.
//
// Contract:
//   CK_HD        marks a function callable from host and device code (empty in host-only TUs).
//   CK_DEVICE    device-only function qualifier (empty in host-only TUs).
//   CK_INLINE    forced inline, on both sides.
//   CK_IS_DEVICE_PASS  1 while nvcc compiles device code, 0 otherwise.
#pragma once

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#define CK_HD __host__ __device__
#define CK_DEVICE __device__
#define CK_INLINE __forceinline__
#else
#define CK_HD
#define CK_DEVICE
#define CK_INLINE inline __attribute__((always_inline))
#endif

#if defined(__CUDA_ARCH__)
#define CK_IS_DEVICE_PASS 1
#else
#define CK_IS_DEVICE_PASS 0
#endif
