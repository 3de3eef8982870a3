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
// Keyed by (CTA rank in the cluster, address): each CTA of a cluster has its own.
inline std::map<unsigned long long, Mbarrier> g_mbarriers;
inline unsigned long long mbar_key(unsigned rank, unsigned addr) {
  return (static_cast<unsigned long long>(rank) << 32) | addr;
}

// Clusters: the shared-memory window of each CTA of the running cluster (the driver's),
// the one ptx_emu.h's g_ptx_smem points at for the running thread's CTA.
constexpr unsigned MAX_CLUSTER = 8;  // the portable cluster size
inline unsigned char* g_cluster_smem[MAX_CLUSTER] = {};

// The host pointer behind `bytes` at shared address `addr` of CTA `rank` of the cluster.
inline unsigned char* cluster_smem_at(unsigned rank, unsigned addr, unsigned bytes, unsigned align) {
  if (rank >= emu::g_cluster_x) ptx_emu_fail("a CTA rank past the cluster", rank);
  if (emu::g_cluster_x == 1) return ptx_smem_at(addr, bytes, align);
  // another CTA's memory (the running thread's own CTA is live): only while it is there
  if (rank != emu::g_rank && !emu::cta_live(rank)) ptx_emu_fail("shared memory of a CTA that has exited", rank);
  if (addr % align != 0) ptx_emu_fail("misaligned shared address", addr);
  if (static_cast<unsigned long long>(addr) + bytes > g_ptx_smem_bytes)
    ptx_emu_fail("shared access past the dynamic shared memory", addr);
  return g_cluster_smem[rank] + addr;
}

inline Mbarrier& mbar_at_rank(unsigned rank, unsigned addr) {
  cluster_smem_at(rank, addr, 8, 8);
  auto it = g_mbarriers.find(mbar_key(rank, addr));
  if (it == g_mbarriers.end()) ptx_emu_fail("mbarrier used before mbarrier.init", addr);
  return it->second;
}

inline Mbarrier& mbar_at(unsigned addr) { return mbar_at_rank(emu::g_rank, addr); }

inline void mbar_complete_if_done(Mbarrier& b) {
  // (a phase's bytes may land before its expect_tx, a peer's multicast: the count goes
  // below zero only while an arrival is pending)
  if (b.pending == 0 && b.tx < 0) ptx_emu_fail("more transaction bytes than the phase expected", b.tx);
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
  g_mbarriers[mbar_key(emu::g_rank, addr)] = Mbarrier{count, count, 0, 0};
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

// The same copy under an L2 cache policy: a hint, so the same copy; the policy must be
// createpolicy's (ptx_emu.h), and the bytes count as read so (emu_evict_first_bytes).
inline void bulk_copy_g2s_hinted(unsigned dst, const void* src, unsigned bytes, unsigned mbar,
                                 unsigned long long policy) {
  if (policy != kEvictFirstPolicy) ptx_emu_fail("a bulk copy under a policy createpolicy did not make", policy);
  g_evict_first_bytes.fetch_add(bytes, std::memory_order_relaxed);
  bulk_copy_g2s(dst, src, bytes, mbar);
}

// Forget every mbarrier of the running thread's CTA (a CTA's shared memory does not
// outlive it; the other CTAs of its cluster keep theirs).
inline void mbar_emu_reset() {
  std::erase_if(g_mbarriers, [](const auto& kv) { return kv.first >> 32 == emu::g_rank; });
}

// ---- clusters (gemm_sm90.cu's cluster entry points) --------------------------------------

// %cluster_ctarank, %cluster_nctarank
inline unsigned cluster_ctarank() { return emu::g_rank; }
inline unsigned cluster_size() { return emu::g_cluster_x; }

// mapa.shared::cluster + ld.shared::cluster.f32: the word at offset `addr` of CTA `rank`.
inline float ld_peer_f32(unsigned addr, unsigned rank) {
  float v;
  std::memcpy(&v, cluster_smem_at(rank, addr, 4, 4), 4);
  return v;
}

// barrier.cluster.arrive.release + barrier.cluster.wait.acquire: every thread of the
// cluster (cuda_emu.h's emu_cluster_barrier).
inline void cluster_sync() { emu_cluster_barrier(); }

// The CTA's dynamic shared memory: its own window (a cluster's CTAs each have one).
inline unsigned char* cta_smem(unsigned char*) { return g_ptx_smem; }

// mapa.shared::cluster + mbarrier.arrive.release.cluster.shared::cluster.b64: an arrival on
// the barrier at the same offset in CTA `rank` of the cluster. The arriving thread then
// yields, as mbar_arrive does.
inline void mbar_arrive_peer(unsigned addr, unsigned rank) {
  Mbarrier& b = mbar_at_rank(rank, addr);
  if (b.pending == 0) ptx_emu_fail("mbarrier arrival past its count", addr);
  --b.pending;
  mbar_complete_if_done(b);
  emu::yield();
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster
// [dst], [src], bytes, [mbar], mask: the bytes land at offset `dst` of every CTA of the
// cluster whose rank's bit is set in `mask`, each completing them on its own barrier at
// offset `mbar` (as the unicast copy, at issue).
inline void bulk_copy_g2s_multicast(unsigned dst, const void* src, unsigned bytes, unsigned mbar,
                                    unsigned short mask) {
  if (bytes == 0 || bytes % 16 != 0) ptx_emu_fail("bulk copy size must be a positive multiple of 16", bytes);
  if (reinterpret_cast<unsigned long long>(src) % 16 != 0)
    ptx_emu_fail("misaligned bulk copy source", reinterpret_cast<unsigned long long>(src));
  if (mask == 0 || mask >> emu::g_cluster_x != 0) ptx_emu_fail("multicast mask off the cluster", mask);
  for (unsigned rank = 0; rank < emu::g_cluster_x; ++rank) {
    if (!(mask >> rank & 1u)) continue;
    std::memcpy(cluster_smem_at(rank, dst, bytes, 16), src, bytes);
    Mbarrier& b = mbar_at_rank(rank, mbar);
    b.tx -= bytes;
    mbar_complete_if_done(b);
  }
}

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
