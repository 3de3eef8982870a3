// Host definitions of gemm_sm90.cu's warpgroup-MMA wrappers, for tests/test_gemm_sm90.py.
//
// Like ptx_emu.h (whose cp.async, shared_addr and dynamic_smem_bytes gemm_sm90.cu uses
// too), these follow the PTX ISA: "Asynchronous Warpgroup Level Matrix Multiply-
// Accumulate" (wgmma.fence, wgmma.mma_async, wgmma.commit_group, wgmma.wait_group),
// its shared-memory matrix descriptor and its canonical K-major layouts, and the
// register fragment of an .m64nNk16 fp32 accumulator. They check the kernel's logic
// (descriptors, layouts, fragment indexing, the async protocol), not the tensor cores'
// arithmetic: an element's 16 products are summed in fp32 in k order 0..15 onto the
// accumulator, one rounding per add, which the hardware need not do.
//
// The protocol is held to the ISA:
//   - a wgmma needs a wgmma.fence since this thread's last commit_group;
//   - a wgmma's result lands only at the wait_group that retires its group (the
//     latest point the ISA allows), so reading accumulators before waiting reads
//     stale values and fails the twin comparison;
//   - the shared operands an instruction reads must not change between its issue
//     and its retirement: the values each thread's elements need are captured at
//     issue and compared at retirement, and a cp.async of the retiring thread still
//     in flight into them aborts (a slot refilled while its MMAs may still run);
//   - the no-swizzle layout and the 128-byte swizzle are emulated, with base offset 0
//     (a swizzled operand's rows must start on a 1,024-byte atom); any other
//     descriptor bits abort.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ptx_emu.h"

// fence.proxy.async.shared::cta: the emulator has one view of shared memory.
inline void fence_proxy_async() {}

// The register fences that keep the compiler from moving accumulator accesses: nothing
// to do on the host.
inline void wgmma_fence_operands(float (&)[64]) {}

struct WgmmaLayout {  // a decoded matrix descriptor, byte addresses
  unsigned start, lead, stride;
  bool swizzle128;
};

// PTX ISA, "Matrix Descriptor Format": bits 0-13 start address >> 4, 16-29 leading
// dimension byte offset >> 4, 32-45 stride dimension byte offset >> 4, 49-51 base
// offset, 62-63 swizzle mode (0: none, 1: 128-byte); every other bit is 0.
inline WgmmaLayout wgmma_decode(unsigned long long desc) {
  constexpr unsigned long long FIELDS = 0x3FFFull | (0x3FFFull << 16) | (0x3FFFull << 32);
  const unsigned mode = static_cast<unsigned>(desc >> 62);
  if (mode > 1) ptx_emu_fail("wgmma descriptor: only no swizzle and the 128-byte swizzle are emulated", desc);
  if (((desc >> 49) & 7ull) != 0) ptx_emu_fail("wgmma descriptor: base offset must be 0", desc);
  if ((desc & ~FIELDS & ~(3ull << 62)) != 0) ptx_emu_fail("wgmma descriptor: reserved bits set", desc);
  const WgmmaLayout l{static_cast<unsigned>(desc & 0x3FFFull) << 4, static_cast<unsigned>((desc >> 16) & 0x3FFFull) << 4,
                      static_cast<unsigned>((desc >> 32) & 0x3FFFull) << 4, mode == 1};
  // Base offset 0 asserts that the pattern starts at the operand's rows: row 0 at the
  // start of an atom (address bits 7-9 zero), the next 8 rows a whole atom further.
  if (l.swizzle128 && ((l.start & 0x380u) != 0 || l.stride % 1024 != 0))
    ptx_emu_fail("wgmma descriptor: a 128-byte swizzled operand off its 1,024-byte atom", desc);
  return l;
}

// Byte address of element (row r, k) of a K-major operand (PTX ISA, "Shared Memory
// Matrix Layout"). No swizzle: 8 x 16-byte core matrices of 128 contiguous bytes, the
// next along K at the leading byte offset, the next 8 rows at the stride byte offset.
// 128-byte swizzle: row r % 8 of a row group 128 bytes after the previous one, k at
// 2 k bytes from the start (k < 16 stays inside the row's 128 bytes), the next 8 rows
// at the stride byte offset; then the address's 16-byte chunk bits (4-6) XOR its row
// bits (7-9), as the hardware does to every address of the pattern.
inline unsigned wgmma_address(const WgmmaLayout& l, int r, int k) {
  if (!l.swizzle128) return l.start + (r / 8) * l.stride + (k / 8) * l.lead + (r % 8) * 16 + (k % 8) * 2;
  const unsigned addr = l.start + (r / 8) * l.stride + (r % 8) * 128 + k * 2;
  return addr ^ (((addr >> 7) & 7u) << 4);
}

inline unsigned short wgmma_element(const WgmmaLayout& l, int r, int k) {
  unsigned short v;
  std::memcpy(&v, ptx_smem_at(wgmma_address(l, r, k), 2, 2), 2);
  return v;
}

struct WgmmaOp {
  float* d;  // the thread's 64 accumulators
  WgmmaLayout a, b;
  unsigned short a_rows[2][16];    // this thread's rows of A at issue
  unsigned short b_cols[32][16];   // this thread's 32 columns of B at issue
};
struct WgmmaThread {
  std::vector<WgmmaOp> open;                 // issued, not committed
  std::vector<std::vector<WgmmaOp>> groups;  // committed, oldest first
  bool fenced = false;
};
inline WgmmaThread g_wgmma_threads[emu::kMaxFibers];
inline WgmmaThread& wgmma_thread() { return g_wgmma_threads[emu::g_thread]; }  // the fiber's

// D fragment of .m64nNk16 with an fp32 accumulator (PTX ISA, "Register Fragments and
// Shared Memory Matrix Layouts", wgmma .m64nNk16 D): warp w of the warpgroup, lane l,
// d[i] = D[16 w + l / 4 + 8 ((i / 2) % 2)][8 (i / 4) + 2 (l % 4) + i % 2].
inline int wgmma_row(int i) { return 16 * static_cast<int>(threadIdx.x / 32 % 4) + static_cast<int>(threadIdx.x % 32) / 4 + 8 * ((i / 2) % 2); }
inline int wgmma_col(int i) { return 8 * (i / 4) + 2 * static_cast<int>(threadIdx.x % 4) + i % 2; }

// The operands this thread's elements read: rows r0, r0 + 8 of A, its 32 columns of B.
inline void wgmma_capture(const WgmmaOp& op, unsigned short (&a_rows)[2][16], unsigned short (&b_cols)[32][16]) {
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 16; ++k) a_rows[h][k] = wgmma_element(op.a, wgmma_row(2 * h), k);
  for (int j = 0; j < 32; ++j)
    for (int k = 0; k < 16; ++k) b_cols[j][k] = wgmma_element(op.b, wgmma_col(4 * (j / 2) + j % 2), k);
}

// wgmma.fence.sync.aligned
inline void wgmma_fence() { wgmma_thread().fenced = true; }

// wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 d, desc_a, desc_b, 1, 1, 1, 0, 0:
// d += A (64 x 16, K-major) * B (16 x 128, K-major, i.e. 128 rows of k), queued.
inline void wgmma_m64n128k16(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b) {
  WgmmaThread& t = wgmma_thread();
  if (blockDim.x % 128 != 0) ptx_emu_fail("wgmma in a block that is not whole warpgroups", blockDim.x);
  if (!t.fenced) ptx_emu_fail("wgmma without a wgmma.fence since the last commit_group", 0);
  WgmmaOp op{d, wgmma_decode(desc_a), wgmma_decode(desc_b), {}, {}};
  wgmma_capture(op, op.a_rows, op.b_cols);
  t.open.push_back(op);
}

inline void wgmma_commit() {
  WgmmaThread& t = wgmma_thread();
  t.groups.push_back(std::move(t.open));  // an empty group is a group too
  t.open.clear();
  t.fenced = false;
}

inline float wgmma_bf16(unsigned short bits) { return __bfloat162float(__nv_bfloat16{bits}); }

// Whether 16 bytes at `dst` hold an element the op reads: A's 64 rows and B's 128, the
// 8-element runs k 0-7 and 8-15 of each (16 contiguous bytes in either layout).
inline bool wgmma_reads(const WgmmaOp& op, unsigned dst) {
  for (int r = 0; r < 128; ++r)
    for (int j = 0; j < 2; ++j) {
      const unsigned b = wgmma_address(op.b, r, 8 * j);
      if (dst + 16 > b && dst < b + 16) return true;
      const unsigned a = wgmma_address(op.a, r, 8 * j);
      if (r < 64 && dst + 16 > a && dst < a + 16) return true;
    }
  return false;
}

inline void wgmma_retire(const WgmmaOp& op) {
  // NOTE: a cp.async of this thread still in flight into the op's operands is a race
  // the latest-landing copies of ptx_emu.h would hide (it lands after this retires).
  const PtxThread& copies = ptx_thread();
  for (const PtxCopy& c : copies.open)
    if (wgmma_reads(op, c.dst)) ptx_emu_fail("cp.async into shared operands of a wgmma in flight", c.dst);
  for (const auto& group : copies.groups)
    for (const PtxCopy& c : group)
      if (wgmma_reads(op, c.dst)) ptx_emu_fail("cp.async into shared operands of a wgmma in flight", c.dst);
  unsigned short a_rows[2][16], b_cols[32][16];
  wgmma_capture(op, a_rows, b_cols);
  if (std::memcmp(a_rows, op.a_rows, sizeof a_rows) != 0 || std::memcmp(b_cols, op.b_cols, sizeof b_cols) != 0)
    ptx_emu_fail("shared operands of a wgmma changed while it was in flight", op.a.start);
  for (int i = 0; i < 64; ++i) {
    const unsigned short* a = a_rows[(i / 2) % 2];
    const unsigned short* b = b_cols[2 * (i / 4) + i % 2];
    float acc = op.d[i];
    for (int k = 0; k < 16; ++k) acc = acc + wgmma_bf16(a[k]) * wgmma_bf16(b[k]);  // exact products
    op.d[i] = acc;
  }
}

// wgmma.wait_group.sync.aligned N: retire every committed group but the N most recent.
template <int PENDING>
inline void wgmma_wait() {
  static_assert(PENDING >= 0);
  auto& groups = wgmma_thread().groups;
  size_t done = 0;
  for (; groups.size() - done > static_cast<size_t>(PENDING); ++done)
    for (const WgmmaOp& op : groups[done]) wgmma_retire(op);
  groups.erase(groups.begin(), groups.begin() + static_cast<long>(done));
}

// True when this thread left no wgmma behind (none uncommitted, none in flight); resets
// the thread's state for its next CTA.
inline bool wgmma_emu_drained() {
  WgmmaThread& t = wgmma_thread();
  const bool drained = t.open.empty() && t.groups.empty();
  t = WgmmaThread{};
  return drained;
}
