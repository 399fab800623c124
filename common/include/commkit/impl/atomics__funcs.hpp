// Implementation of commkit/atomics.hpp; included inside namespace commkit.
// NOLINTBEGIN
namespace atomics_detail {
template <typename T>
struct Bits {
  static_assert(std::is_integral<T>::value && (sizeof(T) == 4 || sizeof(T) == 8),
                "commkit atomics support 32- and 64-bit integers");
  using U = typename std::conditional<sizeof(T) == 4, uint32_t, unsigned long long>::type;
};
}  // namespace atomics_detail

#if CK_IS_DEVICE_PASS

template <typename T>
CK_HD CK_INLINE T ld_acquire(const T* p) {
  using U = typename atomics_detail::Bits<T>::U;
  U v;
  if constexpr (sizeof(T) == 4)
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return static_cast<T>(v);
}
template <typename T>
CK_HD CK_INLINE T ld_relaxed(const T* p) {
  return *reinterpret_cast<const volatile T*>(p);
}
template <typename T>
CK_HD CK_INLINE void st_release(T* p, T value) {
  using U = typename atomics_detail::Bits<T>::U;
  U v = static_cast<U>(value);
  if constexpr (sizeof(T) == 4)
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
template <typename T>
CK_HD CK_INLINE void st_relaxed(T* p, T value) {
  *reinterpret_cast<volatile T*>(p) = value;
}
template <typename T>
CK_HD CK_INLINE T fetch_add(T* p, T value) {
  using U = typename atomics_detail::Bits<T>::U;
  U old, v = static_cast<U>(value);
  if constexpr (sizeof(T) == 4)
    asm volatile("atom.add.acq_rel.sys.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  else
    asm volatile("atom.add.acq_rel.sys.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return static_cast<T>(old);
}
template <typename T>
CK_HD CK_INLINE T cas(T* p, T expected, T value) {
  using U = typename atomics_detail::Bits<T>::U;
  U old, e = static_cast<U>(expected), v = static_cast<U>(value);
  if constexpr (sizeof(T) == 4)
    asm volatile("atom.cas.acq_rel.sys.global.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(e), "r"(v) : "memory");
  else
    asm volatile("atom.cas.acq_rel.sys.global.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(e), "l"(v) : "memory");
  return static_cast<T>(old);
}
template <typename T>
CK_HD CK_INLINE T exchange(T* p, T value) {
  using U = typename atomics_detail::Bits<T>::U;
  U old, v = static_cast<U>(value);
  if constexpr (sizeof(T) == 4)
    asm volatile("atom.exch.acq_rel.sys.global.b32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  else
    asm volatile("atom.exch.acq_rel.sys.global.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return static_cast<T>(old);
}
template <typename T>
CK_HD CK_INLINE void red_add_release(T* p, T value) {
  using U = typename atomics_detail::Bits<T>::U;
  U v = static_cast<U>(value);
  if constexpr (sizeof(T) == 4)
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
CK_HD CK_INLINE void fence_system() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

#else  // host

template <typename T>
CK_HD CK_INLINE T ld_acquire(const T* p) {
  (void)sizeof(typename atomics_detail::Bits<T>::U);
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
CK_HD CK_INLINE T ld_relaxed(const T* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
template <typename T>
CK_HD CK_INLINE void st_release(T* p, T value) {
  __atomic_store_n(p, value, __ATOMIC_RELEASE);
}
template <typename T>
CK_HD CK_INLINE void st_relaxed(T* p, T value) {
  __atomic_store_n(p, value, __ATOMIC_RELAXED);
}
template <typename T>
CK_HD CK_INLINE T fetch_add(T* p, T value) {
  return __atomic_fetch_add(p, value, __ATOMIC_ACQ_REL);
}
template <typename T>
CK_HD CK_INLINE void red_add_release(T* p, T value) {
  (void)sizeof(typename atomics_detail::Bits<T>::U);
  __atomic_fetch_add(p, value, __ATOMIC_RELEASE);
}
template <typename T>
CK_HD CK_INLINE T cas(T* p, T expected, T value) {
  __atomic_compare_exchange_n(p, &expected, value, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;  // holds the old value on failure, the expected one on success
}
template <typename T>
CK_HD CK_INLINE T exchange(T* p, T value) {
  return __atomic_exchange_n(p, value, __ATOMIC_ACQ_REL);
}
CK_HD CK_INLINE void fence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

#endif
#if defined(__CUDACC__)
// Device-only GPU-scope variants (declared in both nvcc passes so kernels parse in the host pass).
template <typename T>
CK_DEVICE CK_INLINE T ld_acquire_gpu(const T* p) {
  using U = typename atomics_detail::Bits<T>::U;
  U v;
  if constexpr (sizeof(T) == 4)
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return static_cast<T>(v);
}
template <typename T>
CK_DEVICE CK_INLINE void st_release_gpu(T* p, T value) {
  using U = typename atomics_detail::Bits<T>::U;
  U v = static_cast<U>(value);
  if constexpr (sizeof(T) == 4)
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// The barrier makes every thread's earlier stores happen-before thread 0's fence (causality is
// transitive through bar.sync), so thread 0's fence plus its next store or atomic is a release for
// the whole block: the pattern of cooperative groups' grid sync, at system scope.
CK_DEVICE CK_INLINE void block_fence_system() {
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) fence_system();
}
// One arrival per block on a grid-wide counter. The block's fence before thread 0's atomic releases
// the block's stores; the last block's fence after seeing the full count acquires every other
// block's (the "last block" pattern of the CUDA threadFenceReduction sample). Resetting the counter
// at once is safe: every block of this launch has already counted, and the next launch on the
// stream starts after this one.
template <bool kSystemScope>
CK_DEVICE CK_INLINE bool grid_arrive_last(uint32_t* counter) {
  __shared__ uint32_t s_last;
  const bool leader = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
  __syncthreads();
  if (leader) {
    if constexpr (kSystemScope)
      fence_system();
    else
      __threadfence();
    const uint32_t blocks = gridDim.x * gridDim.y * gridDim.z;
    s_last = atomicAdd(counter, 1u) == blocks - 1u ? 1u : 0u;
    if (s_last != 0u) *counter = 0u;
  }
  __syncthreads();
  const bool last = s_last != 0u;
  if (last) __threadfence();
  return last;
}

#endif
// NOLINTEND
