// Host definitions of gemm_sm90.cu's mbarrier and bulk-copy wrappers (PTX ISA,
// "mbarrier", "cp.async.mbarrier.arrive", "cp.async.bulk"), for tests/test_gemm_sm90.py.
//
// An mbarrier lives at a shared address; its state here is a side table keyed by that
// address (reset per CTA): the arrival count it was initialised with, the arrivals
// still pending in the current phase, the transaction bytes still expected, and the
// number of completed phases. A phase completes when both its pending arrivals and its
// transaction count reach zero; the next phase then starts with the full count.
// try_wait.parity P is true once the phase of parity P has completed, i.e. when the
// current phase's parity is not P; a waiting thread yields to the others (cuda_emu.h).
//
// Copies land early here (the bulk copy at issue, a thread's cp.async at its
// cp.async.mbarrier.arrive.noinc): the ISA allows it, and wgmma_emu.h's in-flight
// check (operands captured at issue, compared at retirement) is what catches a stage
// overwritten while its MMAs may still run.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "ptx_emu.h"

struct Mbarrier {
  unsigned count = 0;    // arrivals a phase expects
  unsigned pending = 0;  // arrivals still missing in the current phase
  long long tx = 0;      // transaction bytes still expected in the current phase
  unsigned phase = 0;    // phases completed
};
inline std::map<unsigned, Mbarrier> g_mbarriers;

inline Mbarrier& mbar_at(unsigned addr) {
  ptx_smem_at(addr, 8, 8);
  auto it = g_mbarriers.find(addr);
  if (it == g_mbarriers.end()) ptx_emu_fail("mbarrier used before mbarrier.init", addr);
  return it->second;
}

inline void mbar_complete_if_done(Mbarrier& b) {
  if (b.pending == 0 && b.tx == 0) {
    ++b.phase;
    b.pending = b.count;
  }
  emu::progress();
}

// mbarrier.init.shared::cta.b64 [addr], count
inline void mbar_init(unsigned addr, unsigned count) {
  ptx_smem_at(addr, 8, 8);
  if (count == 0) ptx_emu_fail("mbarrier.init with a count of 0", addr);
  g_mbarriers[addr] = Mbarrier{count, count, 0, 0};
}

// fence.mbarrier_init.release.cluster: one view of shared memory here.
inline void mbar_init_fence() {}

inline void mbar_arrive_on(unsigned addr) {
  Mbarrier& b = mbar_at(addr);
  if (b.pending == 0) ptx_emu_fail("mbarrier arrival past its count", addr);
  --b.pending;
  mbar_complete_if_done(b);
}

// mbarrier.arrive.shared::cta.b64 _, [addr]. The arriving thread then yields: whoever
// waited for this phase (a producer refilling a released stage) runs at once, as early
// as a GPU could run it, before the arriving thread's next step.
inline void mbar_arrive(unsigned addr) {
  mbar_arrive_on(addr);
  emu::yield();
}

// mbarrier.arrive.expect_tx.shared::cta.b64 _, [addr], bytes: expect, then arrive.
inline void mbar_arrive_expect_tx(unsigned addr, unsigned bytes) {
  mbar_at(addr).tx += bytes;
  mbar_arrive_on(addr);
}

// mbarrier.try_wait.parity.shared::cta.b64 p, [addr], parity
inline bool mbar_try_wait(unsigned addr, unsigned parity) {
  const bool done = (mbar_at(addr).phase & 1u) != (parity & 1u);
  if (!done) emu::yield();
  return done;
}

// cp.async.mbarrier.arrive.noinc.shared::cta.b64 [addr]: an arrival once every earlier
// cp.async of this thread has landed (committed or not); they land now.
inline void cp_async_mbar_arrive_noinc(unsigned addr) {
  PtxThread& t = ptx_thread();
  t.groups.push_back(std::move(t.open));
  t.open.clear();
  for (const auto& group : t.groups)
    for (const PtxCopy& c : group) {
      unsigned char* d = ptx_smem_at(c.dst, 16, 16);
      std::memcpy(d, c.src, c.src_size);
      std::memset(d + c.src_size, 0, 16 - c.src_size);
    }
  t.groups.clear();
  mbar_arrive_on(addr);
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], bytes, [mbar]
inline void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned mbar) {
  if (bytes == 0 || bytes % 16 != 0) ptx_emu_fail("bulk copy size must be a positive multiple of 16", bytes);
  if (reinterpret_cast<unsigned long long>(src) % 16 != 0)
    ptx_emu_fail("misaligned bulk copy source", reinterpret_cast<unsigned long long>(src));
  std::memcpy(ptx_smem_at(dst, bytes, 16), src, bytes);
  Mbarrier& b = mbar_at(mbar);
  b.tx -= bytes;
  mbar_complete_if_done(b);
}

// Forget every mbarrier (a CTA's shared memory does not outlive it).
inline void mbar_emu_reset() { g_mbarriers.clear(); }

// setmaxnreg.{dec,inc}.sync.aligned.u32 N: a register budget, nothing to do on the host
// beyond the ISA's operand rule (a multiple of 8 in 24-256).
template <int N>
inline void setmaxnreg_dec() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in 24-256");
}
template <int N>
inline void setmaxnreg_inc() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in 24-256");
}
