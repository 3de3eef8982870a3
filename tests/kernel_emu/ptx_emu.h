// Host definitions of gemm.cu's PTX wrappers, for tests/test_kernels_emulated.py.
//
// gemm.cu keeps every inline-PTX statement in a few wrappers that it declares only
// when REPRISE_EMULATE_PTX is undefined; the driver defines that macro and includes
// this file first, so the kernel's own code runs unchanged on cuda_emu.h's threads.
// The definitions follow the PTX ISA's operand layouts (ldmatrix, mma.m16n8k16) and
// cp.async's group semantics; they check the kernel's logic (indexing, fragment
// layouts, masking, the copy pipeline), not the tensor cores' arithmetic: the mma
// sums each element's 16 products in fp32 in k order 0..15 (exact products, one
// rounding per add), which the hardware need not do.
//
// Shared memory: the launch's dynamic shared buffer is the window [g_ptx_smem,
// g_ptx_smem + g_ptx_smem_bytes); "shared addresses" are byte offsets into it, and
// every access through them is bounds- and alignment-checked (a failure aborts).
#pragma once
#ifndef REPRISE_EMULATE_PTX
#define REPRISE_EMULATE_PTX 1
#endif
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>

#include "cuda_emu.h"

inline unsigned char* g_ptx_smem = nullptr;  // the launch's dynamic shared memory
inline unsigned g_ptx_smem_bytes = 0;         // its size, as the launch asked for

[[noreturn]] inline void ptx_emu_fail(const char* what, unsigned long long value) {
  std::fprintf(stderr, "ptx_emu: %s (%llu) in thread %u of block (%u, %u)\n", what, value, threadIdx.x,
               blockIdx.x, blockIdx.y);
  std::abort();
}

// The host pointer behind `bytes` bytes at shared address `addr`, which must be
// `align`-aligned and inside the launch's window.
inline unsigned char* ptx_smem_at(unsigned addr, unsigned bytes, unsigned align) {
  if (addr % align != 0) ptx_emu_fail("misaligned shared address", addr);
  if (static_cast<unsigned long long>(addr) + bytes > g_ptx_smem_bytes)
    ptx_emu_fail("shared access past the dynamic shared memory", addr);
  return g_ptx_smem + addr;
}

// ---- griddepcontrol -------------------------------------------------------------------
// pdl_enter: the emulator runs one grid at a time, so there is nothing to wait for; it
// counts the threads that call it (emu_pdl_entered in driver.cpp), so a test can check
// that every thread of every kernel launched as a dependent calls it.
inline std::atomic<unsigned long long> g_pdl_entered{0};
inline void pdl_enter() {
  g_pdl_entered.fetch_add(1, std::memory_order_relaxed);
  emu::mark_waited();  // its reads from now on may see what the grid before it wrote
}

// __cvta_generic_to_shared: here, the offset into the dynamic shared window.
inline unsigned shared_addr(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (g_ptx_smem == nullptr || c < g_ptx_smem || c > g_ptx_smem + g_ptx_smem_bytes)
    ptx_emu_fail("generic address outside shared memory", reinterpret_cast<unsigned long long>(p));
  return static_cast<unsigned>(c - g_ptx_smem);
}

// ld.acquire.gpu / st.release.gpu and the spin's back-off (common.cuh's grid_sync): the
// CTAs of a persistent launch run together here (driver.cpp runs its grid as one cluster),
// one thread at a time, so a load and a store are plain; a store is progress (it may end
// another CTA's spin), and a spin's back-off is a turn for the other threads (emu::yield).
inline unsigned load_acquire_gpu(const unsigned* p) {
  emu::check_ready(p, sizeof *p);
  return *p;
}
inline void store_release_gpu(unsigned* p, unsigned v) {
  *p = v;
  emu::progress();
}
inline void spin_pause() { emu::yield(); }

// %dynamic_smem_size
inline unsigned dynamic_smem_bytes() { return g_ptx_smem_bytes; }

// createpolicy.fractional.L2::evict_first and a load under it (common.cuh): a cache hint,
// so the load is plain; the policy is a value of its own, which the load checks it was
// given, and the bytes so read are counted (emu_evict_first_bytes: each weight word a
// launch reads, once).
constexpr unsigned long long kEvictFirstPolicy = 0xE71C7F1257ull;
inline std::atomic<unsigned long long> g_evict_first_bytes{0};
inline unsigned long long l2_evict_first_policy() { return kEvictFirstPolicy; }
inline unsigned ldg_evict_first(const unsigned* p, unsigned long long policy) {
  if (policy != kEvictFirstPolicy) ptx_emu_fail("a load under a policy createpolicy did not make", policy);
  emu::check_ready(p, sizeof *p);
  g_evict_first_bytes.fetch_add(sizeof *p, std::memory_order_relaxed);
  return *p;
}

// ex2.approx.ftz.f32: the hardware's approximation is not specified to the bit, so this
// is 2^x rounded once to fp32, with ftz's flushes (a subnormal input counts as zero, a
// subnormal result is +0). Like the device's, a function of x alone, which is all the
// kernels' bit-identity arguments use.
inline float exp2_approx(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
  const float y = static_cast<float>(std::exp2(static_cast<double>(x)));
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

// ---- cp.async -------------------------------------------------------------------------
// Each thread's copies are queued: commit_group closes the open group, wait_group N
// completes every committed group but the N most recent, oldest first. A copy lands
// only then, the latest the PTX ISA allows, so a kernel that reads a stage before
// waiting for it reads the poison the driver leaves in shared memory.

struct PtxCopy {
  unsigned dst;      // shared address
  const void* src;   // global source
  unsigned src_size; // bytes read from src; the rest of the 16 are zero-filled
};
struct PtxThread {  // a thread's own state (threads are fibers: no thread_local)
  std::vector<PtxCopy> open;                 // cp.async issued, not committed
  std::vector<std::vector<PtxCopy>> groups;  // committed, oldest first
  unsigned phase = 0;                        // the staging buffer of its next collective
};
inline PtxThread g_ptx_threads[emu::kMaxFibers];
inline PtxThread& ptx_thread() { return g_ptx_threads[emu::g_thread]; }  // the fiber's (cuda_emu.h)

// cp.async.cg.shared.global [dst], [src], 16, src_bytes (src_bytes = valid ? 16 : 0).
inline void cp_async_16(unsigned dst, const void* src, bool valid) {
  ptx_smem_at(dst, 16, 16);
  if (reinterpret_cast<unsigned long long>(src) % 16 != 0)
    ptx_emu_fail("misaligned cp.async source", reinterpret_cast<unsigned long long>(src));
  if (valid) emu::check_ready(src, 16);  // issued before the wait, it may read before it
  ptx_thread().open.push_back({dst, src, valid ? 16u : 0u});
}

inline void cp_async_commit() {
  PtxThread& t = ptx_thread();
  t.groups.push_back(std::move(t.open));  // an empty group is a group too
  t.open.clear();
}

template <int PENDING>
inline void cp_async_wait() {
  static_assert(PENDING >= 0);
  auto& groups = ptx_thread().groups;
  size_t done = 0;
  for (; groups.size() - done > static_cast<size_t>(PENDING); ++done) {
    for (const PtxCopy& c : groups[done]) {
      unsigned char* d = ptx_smem_at(c.dst, 16, 16);
      std::memcpy(d, c.src, c.src_size);
      std::memset(d + c.src_size, 0, 16 - c.src_size);
    }
  }
  groups.erase(groups.begin(), groups.begin() + static_cast<long>(done));
}

// True when this thread left no copy behind (none uncommitted, none in flight); resets
// the thread's state for its next CTA.
inline bool ptx_emu_cp_async_drained() {
  PtxThread& t = ptx_thread();
  const bool drained = t.open.empty() && t.groups.empty();
  t = PtxThread{};
  return drained;
}

// ---- warp-collective operands -----------------------------------------------------------
// ldmatrix and mma are .sync.aligned: every lane of the warp executes them together
// and each lane's result depends on the other lanes' operands. Lanes publish up to 8
// words into a per-warp staging row and __syncwarp; the staging is double-buffered
// (alternating per collective, the same sequence on every lane of a warp), so the
// next barrier also orders this collective's reads before the buffer's next writes.

constexpr int PTX_STAGE_WORDS = 8;
inline unsigned g_ptx_stage[2][emu::kMaxFibers / 32][32][PTX_STAGE_WORDS];  // [phase][fiber / 32][lane][word]

// Publish this lane's `n` words; returns the warp's rows: lane L's word i at [L][i].
inline const unsigned (*ptx_warp_gather(const unsigned* mine, int n))[PTX_STAGE_WORDS] {
  const unsigned warp = emu::g_thread / 32, lane = threadIdx.x % 32;  // a cluster's warps apart
  unsigned& phase = ptx_thread().phase;
  auto& rows = g_ptx_stage[phase][warp];
  phase ^= 1u;
  for (int i = 0; i < n; ++i) rows[lane][i] = mine[i];
  __syncwarp();
  return rows;
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (PTX ISA, "ldmatrix"): lanes 8j..8j+7 give
// the addresses of rows 0..7 of matrix j (16 bytes each); lane l receives in r[j]
// row l / 4 of matrix j, columns 2 * (l % 4) and +1, the lower column in the lower
// 16 bits.
inline void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  const auto rows = ptx_warp_gather(&addr, 1);
  const unsigned lane = threadIdx.x % 32;
  for (int j = 0; j < 4; ++j) {
    const unsigned row_addr = rows[8 * j + lane / 4][0];
    const unsigned char* row = ptx_smem_at(row_addr, 16, 16);
    unsigned short h[2];  // columns 2 (lane % 4) and +1
    std::memcpy(h, row + 4 * (lane % 4), 4);
    r[j] = static_cast<unsigned>(h[0]) | (static_cast<unsigned>(h[1]) << 16);
  }
}

inline float ptx_bf16_half(unsigned word, int upper) {
  return __bfloat162float(__nv_bfloat16{static_cast<unsigned short>(upper ? word >> 16 : word & 0xffffu)});
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, {b0, b1}, d (PTX ISA,
// "Matrix fragments for mma.m16n8k16 with floating point type"), g = lane / 4,
// t = lane % 4:
//   A (16x16): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
//              a[3] = A[g+8][2t+8, 2t+9];
//   B (16x8):  b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
//   C, D (16x8 fp32): d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1];
// the lower index of a pair in the lower 16 bits. So A[r][k] sits in lane
// 4 (r % 8) + (k % 8) / 2, register (r / 8) + 2 (k / 8), half k % 2, and B[k][n] in
// lane 4 n + (k % 8) / 2, register k / 8, half k % 2.
// mma.sync by warps other than each CTA's first, since the last call of emu_mma_past_warp0:
// which warps share a page's work (attention_tc.cu's shared page).
inline std::atomic<unsigned long long> g_mma_past_warp0{0};
inline void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if (threadIdx.x >= 32) g_mma_past_warp0.fetch_add(1, std::memory_order_relaxed);
  const unsigned mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const auto ops = ptx_warp_gather(mine, 6);
  const int lane = static_cast<int>(threadIdx.x % 32), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) {
      const float av = ptx_bf16_half(ops[4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
      const float bv = ptx_bf16_half(ops[4 * col + (k % 8) / 2][4 + k / 8], k % 2);
      const float product = av * bv;  // exact: two 8-bit significands
      acc = acc + product;
    }
    d[i] = acc;
  }
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 (PTX ISA, "ldmatrix", .trans: each
// matrix is read in column-major order): lanes 8j..8j+7 give the addresses of rows
// 0..7 of matrix j, as without .trans; lane l receives in r[j] the elements at rows
// 2 * (l % 4) and +1 of column l / 4 of matrix j, the lower row in the lower 16 bits.
inline void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  const auto rows = ptx_warp_gather(&addr, 1);
  const unsigned lane = threadIdx.x % 32;
  for (int j = 0; j < 4; ++j) {
    unsigned short h[2];  // rows 2 (lane % 4) and +1, column lane / 4
    for (int i = 0; i < 2; ++i) {
      const unsigned char* row = ptx_smem_at(rows[8 * j + 2 * (lane % 4) + i][0], 16, 16);
      std::memcpy(&h[i], row + 2 * (lane / 4), 2);
    }
    r[j] = static_cast<unsigned>(h[0]) | (static_cast<unsigned>(h[1]) << 16);
  }
}
