// commkit/layout.hpp -- aligned-region layout math, constexpr and usable on host and device.
//
// Contract:
//   align_up(x, a) / align_down(x, a) / is_aligned(x, a) / ceil_div(x, y)   (a: power of two for
//       align_*; any positive for ceil_div). All constexpr, CK_HD.
//   Region { offset, bytes }           one sub-buffer of a larger allocation; end() = offset + bytes.
//   Layout                             a builder: each add(bytes, align) places a region after the
//                                      previous one at the next multiple of `align` and returns it;
//                                      total(align) is the size of the whole layout rounded up.
//   Every buffer layout in the project is a constexpr function returning Regions built with
//   Layout, so the CPU test suite checks offsets, alignment and non-overlap of every layout.
//   Overflow (host code): align_up, Region::end, Layout::add / add_array / total saturate at
//   kLayoutOverflow (UINT64_MAX, a size no allocator grants) instead of wrapping, and
//   Layout::overflowed() tells; ceil_div is exact for every x. Device code keeps the plain
//   arithmetic (its sizes come from layouts the host checked).
//   sat_add(a, b) / sat_mul(a, b) / sat_cast<To>(v)   the same saturating arithmetic for any integer
//       type, for operands >= 0: the type's maximum instead of a wrapped (unsigned) or undefined
//       (signed) result on the host, plain arithmetic on the device. Packages size their own
//       buffers with them (e.g. elastic_ep's int64 sizes saturate at INT64_MAX).
#pragma once

#include <cstddef>
#include <cstdint>

#include "commkit/platform.hpp"

namespace commkit {

// Sizes reach the layout math from user arguments (a capacity, a token count). A sum that wrapped
// past 2^64 would give a small total while the regions inside it stay huge, so callers would
// allocate little and write far past it. Saturating instead makes the total unallocatable.
constexpr uint64_t kLayoutOverflow = ~uint64_t(0);

// The largest value of an integer type (numeric_limits is not constexpr in device code without
// --expt-relaxed-constexpr).
template <typename T>
CK_HD constexpr T max_of() {
  return T(-1) > T(0) ? T(~T(0)) : T((uint64_t(1) << (8 * sizeof(T) - 1)) - 1);
}

// Device code keeps the plain arithmetic: kernels only see sizes the host already laid out and
// checked, and the kernels that passed on the GPU stay instruction for instruction the same.
template <typename T>
CK_HD constexpr T sat_add(T a, T b) {
#ifdef __CUDA_ARCH__
  return a + b;
#else
  return b > max_of<T>() - a ? max_of<T>() : T(a + b);
#endif
}
template <typename T>
CK_HD constexpr T sat_mul(T a, T b) {
#ifdef __CUDA_ARCH__
  return a * b;
#else
  return a != 0 && b > max_of<T>() / a ? max_of<T>() : T(a * b);
#endif
}
// v (>= 0) as a To, saturating at To's maximum on the host.
template <typename To, typename From>
CK_HD constexpr To sat_cast(From v) {
#ifdef __CUDA_ARCH__
  return To(v);
#else
  return uint64_t(v) > uint64_t(max_of<To>()) ? max_of<To>() : To(v);
#endif
}

CK_HD constexpr bool is_pow2(uint64_t a) { return a != 0 && (a & (a - 1)) == 0; }
CK_HD constexpr uint64_t align_up(uint64_t x, uint64_t a) {
#ifdef __CUDA_ARCH__
  return (x + a - 1) / a * a;
#else
  // a == 0 still divides by zero, so a zero alignment stays a compile error in constant expressions.
  return a != 0 && x > kLayoutOverflow - (a - 1) ? kLayoutOverflow : (x + a - 1) / a * a;
#endif
}
CK_HD constexpr uint64_t align_down(uint64_t x, uint64_t a) { return x / a * a; }
CK_HD constexpr bool is_aligned(uint64_t x, uint64_t a) { return x % a == 0; }
CK_HD constexpr uint64_t ceil_div(uint64_t x, uint64_t y) {
#ifdef __CUDA_ARCH__
  return (x + y - 1) / y;
#else
  return x / y + (x % y != 0 ? 1 : 0);
#endif
}

struct Region {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  CK_HD constexpr uint64_t end() const { return sat_add(offset, bytes); }
  CK_HD constexpr bool overlaps(const Region& o) const {
    return bytes != 0 && o.bytes != 0 && offset < o.end() && o.offset < end();
  }
  template <typename T>
  CK_HD T* at(void* base) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
  template <typename T>
  CK_HD const T* at(const void* base) const {
    return reinterpret_cast<const T*>(static_cast<const char*>(base) + offset);
  }
};

class Layout {
 public:
  CK_HD constexpr explicit Layout(uint64_t start = 0) : cursor_(start) {}
  CK_HD constexpr Region add(uint64_t bytes, uint64_t align = 16) {
    Region r{align_up(cursor_, align), bytes};
    cursor_ = r.end();
    return r;
  }
  template <typename T>
  CK_HD constexpr Region add_array(uint64_t count, uint64_t align = alignof(T) < 16 ? 16 : alignof(T)) {
    return add(sat_mul<uint64_t>(count, sizeof(T)), align);
  }
  CK_HD constexpr uint64_t cursor() const { return cursor_; }
  CK_HD constexpr bool overflowed() const { return cursor_ == kLayoutOverflow; }
  CK_HD constexpr uint64_t total(uint64_t align = 1) const { return align_up(cursor_, align); }

 private:
  uint64_t cursor_;
};

}  // namespace commkit
