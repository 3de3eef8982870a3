// Host emulation of the CUDA our kernels use, for tests/test_kernels_emulated.py.
//
// A launch runs one CTA at a time, its threads as host threads; __syncthreads and
// __syncwarp are barriers, warp shuffles and ballots go through shared slots, and
// __shared__ variables are static (so each CTA must finish before the next). It
// checks a kernel's indexing, masking and reductions against its NumPy twin on a
// machine without a GPU; it does not reproduce device arithmetic (host libm's expf,
// no tensor cores, no PTX) or the memory model.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using std::max;
using std::min;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)
#define __align__(n) __attribute__((aligned(n)))  // as CUDA defines it: fits anywhere a GNU attribute does
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
struct dim3 { unsigned int x, y, z; };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
template <class T> inline T __ldg(const T* p) { return *p; }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
[[noreturn]] inline void __trap() {  // a device trap: abort the whole process, loudly
  std::fprintf(stderr, "__trap() in thread %u of block (%u, %u)\n", threadIdx.x, blockIdx.x, blockIdx.y);
  std::abort();
}

struct CtaSync {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warp;
  unsigned int slots[32][32];
  explicit CtaSync(int threads) : block(new std::barrier<>(threads)) {
    for (int i = 0; i < threads / 32; ++i) warp.emplace_back(new std::barrier<>(32));
  }
};
inline CtaSync* g_sync;
inline void __syncthreads() { g_sync->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_sync->warp[threadIdx.x / 32]->arrive_and_wait(); }
template <class T> inline T exchange(T v, int src) {
  static_assert(sizeof(T) == 4);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned u;
  std::memcpy(&u, &v, 4);
  g_sync->slots[w][lane] = u;
  __syncwarp();
  u = g_sync->slots[w][src];
  __syncwarp();
  T r;
  std::memcpy(&r, &u, 4);
  return r;
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return exchange(v, src); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int off) { return exchange(v, (int)(threadIdx.x % 32) ^ off); }
template <class T> inline T __shfl_up_sync(unsigned, T v, int off) {
  const int lane = threadIdx.x % 32;
  return exchange(v, lane >= off ? lane - off : lane);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  g_sync->slots[w][lane] = pred ? 1u : 0u;
  __syncwarp();
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= g_sync->slots[w][i] << i;
  __syncwarp();
  return r;
}

// Run `kernel()` for every CTA of `grid` with `threads` threads (a multiple of 32).
template <class F> void launch(dim3 grid, int threads, F kernel) {
  blockDim = {(unsigned)threads, 1, 1};
  gridDim = grid;
  CtaSync sync(threads);
  g_sync = &sync;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      threadIdx = {(unsigned)t, 0, 0};
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = {x, y, 0};
          kernel();
          __syncthreads();  // the CTA is done before the next one reuses __shared__
        }
    });
  }
  for (auto& th : pool) th.join();
}
