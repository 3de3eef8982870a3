// Host emulation of the CUDA our kernels use, for tests/test_kernels_emulated.py.
//
// A launch runs one CTA at a time (or, for a kernel launched in clusters, one cluster's
// CTAs together: g_cluster_x) on the calling thread, its threads as fibers
// (coroutines with stacks of their own): each runs until it reaches a barrier or returns,
// then the next (or one warp at a time as far as it goes alone: g_warp_major); a
// __syncthreads releases once every thread still running waits at one, a __syncwarp
// once every such lane of its warp does (a thread that returned waits for nothing, as
// on a GPU), and anything else is a deadlock that aborts with a message. Warp shuffles
// and ballots go through shared slots, and __shared__ variables are static (so each
// CTA must finish before the next). It checks a kernel's indexing, masking and
// reductions against its NumPy twin on a machine without a GPU; it does not reproduce
// device arithmetic (host libm's expf, no tensor cores, no PTX) or the memory model.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ucontext.h>
#include <vector>
using std::max;
using std::min;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))  // as CUDA defines it: fits anywhere a GNU attribute does
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
struct dim3 { unsigned int x, y, z; };
inline dim3 threadIdx, blockIdx;  // the running thread's: set at every switch
inline dim3 blockDim, gridDim;
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// double arithmetic: the host's IEEE double, no contraction (x86-64's baseline has no FMA)
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __double2float_rn(double a) { return static_cast<float>(a); }
inline unsigned __double2uint_rn(double a) { return static_cast<unsigned>(std::nearbyint(a)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
namespace emu {
// Tests that compare fp32 values a kernel only shows rounded (attention's acc and denom,
// divided once into a BF16 output) set this: __fdiv_rn then returns an 8-bit hash of
// both operands' bits, an exact small float, so two runs' outputs differ wherever an
// operand differs in any bit (but for a 1 in 256 collision).
inline bool g_fdiv_probe = false;
}  // namespace emu
inline float __fdiv_rn(float a, float b) {
  if (emu::g_fdiv_probe) {
    uint32_t ua, ub;
    std::memcpy(&ua, &a, 4);
    std::memcpy(&ub, &b, 4);
    uint32_t h = ua * 0x9E3779B1u ^ (ub + 0x7F4A7C15u) * 0x85EBCA77u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    return static_cast<float>(h & 0xffu);
  }
  return a / b;
}
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
namespace emu {
inline void check_ready(const void* p, std::size_t bytes);  // below: reads before a grid's wait
}
template <class T> inline T __ldg(const T* p) {
  emu::check_ready(p, sizeof(T));
  return *p;
}
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
[[noreturn]] inline void __trap() {  // a device trap: abort the whole process, loudly
  std::fprintf(stderr, "__trap() in thread %u of block (%u, %u, %u)\n", threadIdx.x, blockIdx.x, blockIdx.y,
               blockIdx.z);
  std::abort();
}

namespace emu {
// Run a grid's CTAs last to first (set_reversed_ctas in driver.cpp): a kernel whose result
// depends on which CTA runs last shows it. A cluster's (run_cta) take turns last to first.
inline bool g_reversed_ctas = false;
// When set (a permutation of the grid's CTA indices, (z * grid.y + y) * grid.x + x),
// launch() runs the CTAs in this order instead; the caller keeps it alive and as long as
// the grid.
inline const unsigned* g_cta_order = nullptr;
// How a CTA's threads take turns (set_warp_major in the drivers). 0, the default: each
// round every running thread in index order, each until it waits. 1 (2): one warp at a
// time, first to last (last to first), each run alone as far as it can go, its own
// __syncwarp and shuffles released as it reaches them, before the next warp starts: a
// schedule a GPU may run, one warp ahead of the others up to the next CTA barrier. A
// kernel that lets a warp overwrite shared memory another warp has still to read (a
// reduction's scratch reused without a barrier between) gives other results under it.
// REPRISE_EMU_WARP_MAJOR=1 (or 2) in the environment makes it a process's default, to
// run a whole test suite so.
inline int g_warp_major = [] {
  const char* order = std::getenv("REPRISE_EMU_WARP_MAJOR");
  return order != nullptr ? std::atoi(order) : 0;
}();
constexpr int kMaxThreads = 1024;  // a CTA's
constexpr int kMaxFibers = 4096;   // a cluster's threads together (8 CTAs of 384, 4 of 1,024)
constexpr std::size_t kStackBytes = 256 * 1024;  // a thread's stack (its registers and locals)
enum class Wait : unsigned char { kRunning, kWarp, kBlock, kNamed, kCluster, kDone };
// Clusters (a kernel with __cluster_dims__(g_cluster_x, 1, 1)): that many CTAs along x run
// together, their threads fibers of one scheduler, fiber t being thread t % blockDim.x of
// the cluster's CTA t / blockDim.x (its rank). g_thread and g_rank are the running fiber's:
// per-thread emulator state is indexed by g_thread, not threadIdx.x, so the CTAs of a
// cluster never share it; g_on_switch (if set) is told the rank at every switch (the
// driver points the shared-memory window at that CTA's own).
inline unsigned g_cluster_x = 1;
inline unsigned g_thread = 0;
inline unsigned g_rank = 0;
inline void (*g_on_switch)(unsigned rank) = nullptr;

// Reads before a grid's wait. A kernel launched as a programmatic dependent may read,
// before its pdl_enter, only what no grid still running writes. A test names the bytes
// the grid before it writes (set_unready in the drivers: "unready"); a thread that,
// in a launch, reads them before its own pdl_enter (a cp.async source, an __ldg) is
// counted in g_unready_reads (emu_unready_reads), and its reads before the wait of
// other bytes in g_early_reads (so a test sees that the early reads happen at all).
inline unsigned long long g_launch_serial = 0;  // bumped by every launch
inline unsigned long long g_waited[kMaxFibers];  // a fiber's pdl_enter: the launch's serial
inline std::vector<std::pair<const char*, const char*>> g_unready;  // [begin, end)
inline unsigned long long g_unready_reads = 0, g_early_reads = 0;
inline void mark_waited() { g_waited[g_thread] = g_launch_serial; }
inline void check_ready(const void* p, std::size_t bytes) {
  if (g_unready.empty() || g_waited[g_thread] == g_launch_serial) return;
  const char* b = static_cast<const char*>(p);
  for (const auto& [first, last] : g_unready)
    if (b < last && b + bytes > first) {
      ++g_unready_reads;
      return;
    }
  ++g_early_reads;
}

// Switching between a CTA's threads: on x86-64 a stack switch that saves only the
// callee-saved registers (a function call's contract; ~10 ns), elsewhere ucontext
// (which also saves the signal mask, a system call each way; ~40 times slower).
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};
extern "C" void reprise_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type reprise_emu_switch, @function
reprise_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size reprise_emu_switch, .-reprise_emu_switch
)");
inline void switch_to(Context& save, Context& load) { reprise_emu_switch(&save.sp, load.sp); }
// A fresh stack whose first switch "returns" into `entry` (which never returns).
inline void start_context(Context& c, char* stack, void (*entry)(), Context&) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + kStackBytes) & ~std::uintptr_t{15};
  auto* slot = reinterpret_cast<void**>(top - 16);  // entry sees rsp = top - 8, as after a call
  slot[0] = reinterpret_cast<void*>(entry);
  slot[1] = nullptr;
  c.sp = slot - 6;  // the six callee-saved registers, popped as zeros
  std::memset(c.sp, 0, 6 * sizeof(void*));
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_to(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
inline void start_context(Context& c, char* stack, void (*entry)(), Context& back) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = kStackBytes;
  c.uc.uc_link = &back.uc;
  makecontext(&c.uc, entry, 0);
}
#endif

struct Cta {
  int threads = 0;  // a CTA's (blockDim.x)
  int ctas = 1;     // CTAs running together (a cluster's)
  unsigned base_x = 0;  // the first CTA's blockIdx.x
  Context scheduler;
  Context context[kMaxFibers];
  Wait wait[kMaxFibers];
  unsigned named[kMaxFibers];  // a fiber waiting at a named barrier (kNamed): its id
  unsigned named_count[kMaxFibers];  // and the threads that barrier takes
  unsigned int slots[kMaxFibers / 32][32];  // a warp's shuffle and ballot exchange, [fiber / 32][lane]
  void (*run)(void*) = nullptr;
  void* kernel = nullptr;
};
inline Cta g_cta;
inline char* g_stacks[kMaxFibers];  // allocated on first use, kept for later launches

inline void arrive(Wait at) {
  const unsigned t = g_thread;
  g_cta.wait[t] = at;
  switch_to(g_cta.context[t], g_cta.scheduler);
}

inline void thread_main() {
  g_cta.run(g_cta.kernel);
  arrive(Wait::kDone);  // never resumed
  std::abort();
}

// Release the waiters of barrier `at` among fibers [first, last) if every fiber there
// still running waits at it; true if it released any.
inline bool release_group(int first, int last, Wait at) {
  bool all = true, any = false;
  for (int t = first; t < last; ++t) {
    if (g_cta.wait[t] == Wait::kDone) continue;
    any |= g_cta.wait[t] == at;
    all &= g_cta.wait[t] == at;
  }
  if (!any || !all) return false;
  for (int t = first; t < last; ++t)
    if (g_cta.wait[t] == at) g_cta.wait[t] = Wait::kRunning;
  return true;
}

// Release the barrier every waiting thread can pass; false when none can (a deadlock).
// A __syncthreads is its CTA's, a barrier.cluster the cluster's (every CTA's threads).
inline bool release() {
  const int n = g_cta.threads * g_cta.ctas;
  if (release_group(0, n, Wait::kCluster)) return true;
  bool released = false;
  for (int c = 0; c < g_cta.ctas; ++c)
    released |= release_group(c * g_cta.threads, (c + 1) * g_cta.threads, Wait::kBlock);
  if (released) return true;
  // a named barrier (bar.sync id, count): once `count` threads of the CTA wait at it
  for (int c = 0; c < g_cta.ctas; ++c) {
    const int first = c * g_cta.threads, last = first + g_cta.threads;
    for (int t = first; t < last; ++t) {
      if (g_cta.wait[t] != Wait::kNamed) continue;
      unsigned waiting = 0;
      for (int u = first; u < last; ++u) waiting += g_cta.wait[u] == Wait::kNamed && g_cta.named[u] == g_cta.named[t];
      if (waiting != g_cta.named_count[t]) continue;
      const unsigned id = g_cta.named[t];
      for (int u = first; u < last; ++u)
        if (g_cta.wait[u] == Wait::kNamed && g_cta.named[u] == id) g_cta.wait[u] = Wait::kRunning;
      released = true;
    }
  }
  if (released) return true;
  for (int c = 0; c < g_cta.ctas; ++c)
    for (int w = 0; 32 * w < g_cta.threads; ++w) {
      const int first = c * g_cta.threads + 32 * w;
      released |= release_group(first, min((c + 1) * g_cta.threads, first + 32), Wait::kWarp);
    }
  return released;
}

// A spin-wait's turn: the thread runs again next round. Whatever a spinning thread waits
// for (an mbarrier phase) is some other thread's doing, which calls progress().
inline bool g_progress = false;
inline int g_idle_rounds = 0;
inline void yield() {
  const unsigned t = g_thread;
  g_cta.wait[t] = Wait::kRunning;
  switch_to(g_cta.context[t], g_cta.scheduler);
}
inline void progress() { g_progress = true; }

// Whether CTA `rank` of the running cluster has a thread that has not returned (its
// shared memory and barriers still exist: nothing may copy or arrive into them after).
inline bool cta_live(unsigned rank) {
  for (int t = static_cast<int>(rank) * g_cta.threads; t < static_cast<int>(rank + 1) * g_cta.threads; ++t)
    if (g_cta.wait[t] != Wait::kDone) return true;
  return false;
}

// Make fiber t the running thread: its threadIdx, blockIdx and rank.
inline void enter(int t) {
  g_thread = static_cast<unsigned>(t);
  g_rank = static_cast<unsigned>(t / g_cta.threads);
  threadIdx = {static_cast<unsigned>(t % g_cta.threads), 0, 0};
  blockIdx.x = g_cta.base_x + g_rank;
  if (g_on_switch != nullptr) g_on_switch(g_rank);
}

// g_warp_major's turns over threads [first, last): each warp runs alone, its warp-level
// waits released as it reaches them, until it waits at a CTA-level barrier, returns, or
// spins (a spin-wait is another warp's to end: the next warp runs).
inline void run_warps_alone(int first, int last) {
  const int warps = (last - first + 31) / 32;
  for (int i = 0; i < warps; ++i) {
    const int w = g_warp_major == 1 ? i : warps - 1 - i;
    const int wf = first + 32 * w, wl = min(last, wf + 32);
    for (;;) {
      bool ran = false;
      for (int t = wf; t < wl; ++t) {
        if (g_cta.wait[t] != Wait::kRunning) continue;
        enter(t);
        switch_to(g_cta.scheduler, g_cta.context[t]);
        ran = true;
      }
      bool spinning = false;
      for (int t = wf; t < wl; ++t) spinning |= g_cta.wait[t] == Wait::kRunning;
      if (!ran || spinning || !release_group(wf, wl, Wait::kWarp)) break;
    }
  }
}

// Run the current CTA's (or cluster's) threads until every one has returned.
//
// A cluster's CTAs run one at a time, each as far as it can go: CTA r's threads until
// they can go no further without another CTA (a barrier or a spin-wait only another can
// release, seen as 50 rounds without progress), then the next CTA's that can run. So the
// first CTA runs ahead of the second as far as the kernel lets it: a kernel that reaches
// a CTA before that CTA has set itself up (a copy or an arrival on barriers it has not
// initialised), or that leaves while its peer still copies or arrives into it
// (cluster_smem_at), fails here, as it might on a GPU whose CTAs start and run apart.
inline void run_cta() {
  const int n = g_cta.threads * g_cta.ctas;
  for (int t = 0; t < n; ++t) {
    if (g_stacks[t] == nullptr) g_stacks[t] = new char[kStackBytes];
    start_context(g_cta.context[t], g_stacks[t], thread_main, g_cta.scheduler);
    g_cta.wait[t] = Wait::kRunning;
  }
  const int patience = g_cta.ctas > 1 ? 50 : 1000;  // idle rounds before a CTA counts as stuck
  // the CTA whose threads run (a cluster's: one at a time); g_reversed_ctas: the last
  // first, then down, so another CTA runs on from each barrier's release
  const int step = g_reversed_ctas ? g_cta.ctas - 1 : 1;
  int active = g_reversed_ctas ? g_cta.ctas - 1 : 0;
  int stuck = 0;   // CTAs in a row found stuck since the last progress
  for (;;) {
    bool done = true;
    const int first = active * g_cta.threads, last = first + g_cta.threads;
    if (g_warp_major == 0) {
      for (int t = first; t < last; ++t) {
        if (g_cta.wait[t] != Wait::kRunning) continue;
        enter(t);
        switch_to(g_cta.scheduler, g_cta.context[t]);
      }
    } else {
      run_warps_alone(first, last);
    }
    for (int t = 0; t < n; ++t) done &= g_cta.wait[t] == Wait::kDone;
    if (done) return;
    // Threads that yielded (spin-waits: yield() below) run again next round, as long
    // as some thread made progress (`g_progress`) within the last `patience` rounds.
    bool yielded = false;
    for (int t = first; t < last; ++t) yielded |= g_cta.wait[t] == Wait::kRunning;
    if (yielded && g_progress) {
      g_progress = false;
      g_idle_rounds = 0;
      stuck = 0;
      continue;
    }
    if (yielded && ++g_idle_rounds < patience) continue;
    g_idle_rounds = 0;
    if (release()) {
      stuck = 0;
      continue;
    }
    // This CTA can go no further alone: run the next one that has a thread to run.
    if (g_cta.ctas > 1 && ++stuck < 2 * 1000 / patience * g_cta.ctas) {
      do active = (active + step) % g_cta.ctas;
      while (!cta_live(static_cast<unsigned>(active)));
      g_progress = false;
      continue;
    }
    std::fprintf(stderr, "deadlock in block (%u, %u): threads wait at barriers no other thread reaches:",
                 blockIdx.x, blockIdx.y);
    for (int t = 0; t < n; ++t)
      if (g_cta.wait[t] != Wait::kDone)
        std::fprintf(stderr, " %d:%s", t,
                     g_cta.wait[t] == Wait::kWarp    ? "syncwarp"
                     : g_cta.wait[t] == Wait::kBlock ? "syncthreads"
                     : g_cta.wait[t] == Wait::kCluster ? "barrier.cluster"
                     : g_cta.wait[t] == Wait::kNamed   ? "bar.sync"
                                                       : "spin");
    std::fprintf(stderr, "\n");
    std::abort();
  }
}
}  // namespace emu

inline void __syncthreads() { emu::arrive(emu::Wait::kBlock); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::arrive(emu::Wait::kWarp); }
// barrier.cluster.arrive + barrier.cluster.wait: every thread of every CTA of the cluster.
inline void emu_cluster_barrier() { emu::arrive(emu::Wait::kCluster); }
// bar.sync ID, count (ID 1-15): released once `count` threads of the CTA wait at it.
template <unsigned ID>
inline void named_barrier_sync(unsigned count) {
  const unsigned id = ID;
  if (id == 0 || id > 15 || count == 0 || count % 32 != 0 || count > blockDim.x) {
    std::fprintf(stderr, "bar.sync %u, %u: the id must be 1-15 and the count whole warps of the block\n", id, count);
    std::abort();
  }
  emu::g_cta.named[emu::g_thread] = id;
  emu::g_cta.named_count[emu::g_thread] = count;
  emu::arrive(emu::Wait::kNamed);
}
// One CTA runs at a time, on one host thread: a fence orders nothing more, an atomic is a
// plain read-modify-write, and a load that bypasses L1 is a load.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline float __ldcg(const float* p) {
  emu::check_ready(p, sizeof *p);
  return *p;
}
inline int __ldcg(const int* p) {
  emu::check_ready(p, sizeof *p);
  return *p;
}
inline unsigned short __ldcg(const unsigned short* p) {
  emu::check_ready(p, sizeof *p);
  return *p;
}
inline unsigned __ldcg(const unsigned* p) {
  emu::check_ready(p, sizeof *p);
  return *p;
}
template <class T> inline T exchange(T v, int src) {
  static_assert(sizeof(T) == 4);
  const int w = emu::g_thread / 32, lane = threadIdx.x % 32;
  unsigned u;
  std::memcpy(&u, &v, 4);
  emu::g_cta.slots[w][lane] = u;
  __syncwarp();
  u = emu::g_cta.slots[w][src];
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
  const int w = emu::g_thread / 32, lane = threadIdx.x % 32;
  emu::g_cta.slots[w][lane] = pred ? 1u : 0u;
  __syncwarp();
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= emu::g_cta.slots[w][i] << i;
  __syncwarp();
  return r;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0u; }

// Run `kernel()` for every CTA of `grid` with `threads` threads (at most 1024 a
// cluster's CTAs together), the CTAs of a cluster (emu::g_cluster_x along x, which must
// divide grid.x) together; CTA i of the launch order is (x, y, z) with i = (z * grid.y +
// y) * grid.x + x.
template <class F> void launch(dim3 grid, int threads, F kernel) {
  const unsigned cluster = emu::g_cluster_x;
  if (threads < 1 || threads > emu::kMaxThreads || threads * static_cast<int>(cluster) > emu::kMaxFibers) {
    std::fprintf(stderr, "launch with %d threads in clusters of %u: a block has 1 to %d, a cluster at most %d\n",
                 threads, cluster, emu::kMaxThreads, emu::kMaxFibers);
    std::abort();
  }
  if (cluster < 1 || grid.x % cluster != 0) {
    std::fprintf(stderr, "launch of grid.x = %u in clusters of %u: the grid must be whole clusters\n", grid.x,
                 cluster);
    std::abort();
  }
  blockDim = {(unsigned)threads, 1, 1};
  ++emu::g_launch_serial;  // no thread of this launch has waited yet
  gridDim = grid;
  emu::g_cta.threads = threads;
  emu::g_cta.ctas = static_cast<int>(cluster);
  emu::g_cta.kernel = &kernel;
  emu::g_cta.run = [](void* k) { (*static_cast<F*>(k))(); };
  const unsigned across = grid.x / cluster;  // clusters along x
  const unsigned depth = grid.z == 0 ? 1 : grid.z;  // a 2-d grid's {x, y} leaves z 0
  gridDim.z = depth;
  const unsigned count = across * grid.y * depth;
  for (unsigned i = 0; i < count; ++i) {  // launch order, or backwards, or g_cta_order's
    const unsigned at = emu::g_cta_order != nullptr ? emu::g_cta_order[i]
                        : emu::g_reversed_ctas     ? count - 1 - i
                                                   : i;
    emu::g_cta.base_x = at % across * cluster;
    blockIdx = {emu::g_cta.base_x, at / across % grid.y, at / (across * grid.y)};
    emu::run_cta();
  }
}
