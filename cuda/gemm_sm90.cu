// Linear layers on Hopper: y[M, N] = x[M, K] @ w[N, K]^T with warpgroup MMA
// (wgmma.mma_async, sm_90a). Launcher: gemm_sm90_kernel.py (its geometry: gemm_sm90_plan.py);
// twin: gemm.py's gemm_ref.
//
// x and w are BF16 bit patterns, row-major, w in the Hugging Face [out, in] layout as
// is (no packing); y is BF16 (round to nearest even of the fp32 accumulator) or fp32.
//
// Two kernels share the MMAs and the invariance argument below:
// gemm_sm90_tile (all threads load by cp.async, then all issue MMAs; w as is; the
// no-swizzle stage layout below) and gemm_sm90_ws_tile (a producer warpgroup feeds one
// or two consumer warpgroups through an mbarrier ring; w pre-packed once so its tiles
// come by 1-D bulk copies: no tensor maps; by default the 128-byte swizzle stage layout,
// see ws_chunk_offset; tiles 128 x 128, 128 x 256 and, for decodes, 64 x 64 and 64 x 128).
// The first, instantiated for a few tile shapes (gemm_sm90_plan.py's CONFIGS mirror the
// instantiations at the end of this file):
//   CTA tile BM x BN, one warpgroup (4 warps, 128 threads) per 64 rows, each issuing
//   BN / 128 wgmma.m64n128k16 per 16-wide K slice with both operands in shared memory;
//   K walked in tiles of BK = 64 through a STAGES-deep ring of shared buffers filled by
//   16-byte cp.async from every thread (zero-filled past M and N). K must be a multiple
//   of 64 (every Llama shape is): no K tail, so no branch among the MMAs of a k-tile.
//
// Shared layout of one operand tile (R rows x 64 k): the wgmma "core matrix" is 8 rows
// x 16 bytes (8 BF16 of k), stored as 128 contiguous bytes; core matrix (row group g,
// k chunk j) sits at byte (g * 8 + j) * 128. So the 16-byte chunk at byte c * 16 holds
// row 8 (c / 64) + c % 8, k chunk (c / 8) % 8: consecutive threads fill consecutive
// 16 bytes (no bank conflict) from 8 rows x 64 contiguous global bytes (whole sectors).
// In the no-swizzle K-major canonical layout of the PTX ISA's matrix descriptor this is
// leading byte offset (next core matrix along K) = 128 and stride byte offset (next
// 8 rows) = 1024.
//
// Pipeline (gemm_sm90_tile): before the MMAs of k-tile kt, tiles kt + 1 .. kt + STAGES - 2 are in flight;
// the MMAs of tile kt - 1 may still run (wgmma.wait_group 1). The slot refilled in
// iteration kt is that of tile kt - 2, whose MMAs every warpgroup finished before the
// barrier at the top of the iteration.
//
// NOTE: the invariance argument (DESIGN §4). Output element y[m, n] lives in one
// accumulator register of one thread of one CTA; nothing else ever adds into it.
//   1. It starts at +0.0f and takes exactly one wgmma.m64n128k16 per 16-wide K slice
//      s = 0, 1, ..., K/16 - 1, in ascending order (k-tiles ascend, slices ascend in a
//      k-tile; K % 64 == 0, so there is no tail). Every configuration issues this
//      same instruction shape; the tile shape only regroups the one sequence. With
//      S = 1 (below) there is no reduction across threads, warpgroups or CTAs.
//   2. In the wgmma of slice s the element's row of A is x[m, 16s : 16s+16] and its
//      column of B is w[n, 16s : 16s+16], copied bit for bit; other rows and columns of
//      the instruction (companion rows, zero padding past M or N) do not enter it.
//   3. The instruction's arithmetic for one element is fixed hardware behaviour, the
//      same at every row and column position of the m64n128 tile (an assumption about
//      the tensor cores, as gemm.cu makes for mma.sync; the GPU test checks rows at
//      many positions).
//   4. The epilogue rounds once, with __float2bfloat16_rn, or stores fp32 as is.
// So y[m, n] depends on x[m, :], w[n, :] and K alone: the same bits for every M, row
// offset, companion rows, tile configuration and kernel of this file.
//
// Split-K: gemm.cu's rule. S = gemm_kernel.split_k(N, K) is fixed per weight shape, never
// per M or device. With S > 1, K is cut into S contiguous splits of `split_len` elements
// (a multiple of 128, so of BK: no k-tile straddles two; the last split shorter), and 1.
// becomes: partial P_s = its own accumulator from +0.0f over split s's slices in
// ascending order (1.-3. as stated, on that K range), then
// y = (((0.0f + P_0) + P_1) + ...) + P_{S-1}, fp32 adds in ascending s, then 4. Two
// routes compute exactly that sequence (gemm.py's fold_partials is its NumPy twin):
//   PARTIAL (M up to the tile's BM, the decode grid S * ceil(N / BN)): CTA (split s,
//     m tile) stores P_s as fp32 into slab s of a workspace [S, M, N] and counts itself
//     in its tile's counter (an integer atomic); the CTA that counts last folds the
//     tile's S slabs per element in ascending s from +0.0f, writes y and zeroes the
//     counter (fold_split_partials, common.cuh). Which CTA is last changes who adds, not what is added.
//   FOLD (larger M): one CTA walks all of K; at each split boundary it waits for the
//     split's MMAs, adds its accumulator into a running total (total += acc) and
//     restarts the accumulator from +0.0f (fold_boundary); at the end total += acc.
//     A second accumulator set: the wide tile (128 a thread) has none, so it only runs
//     S = 1 weights (the launcher's plan).
// Both do the same wgmma per slice, the same slices per partial and the same fp32 adds
// in the same order, so a row's bits depend on neither M nor the route; the launcher
// never picks S by M. S = 1 runs neither route: WHOLE, 1.-4. as stated. No float atomics.
//
// A row need NOT equal gemm.cu's mma.sync result (another instruction, whose in-slice
// summation the ISA does not tie to this one), which is why the launcher's dispatch rule
// picks between the two by (device, N, K) only, never by M.
#include "common.cuh"  // cp.async, shared_addr, dynamic_smem_bytes, bf16_bits, store_pair
#include "rmsnorm.cuh"  // add_rmsnorm_row: the norm epilogue's rows (the _norm entry points)
#include "kvcache.cuh"  // rope_kv_write_pair: the rope epilogue's items (the _rope entry points)

// wgmma exists only on sm_90a (the arch-specific target); every other target (CI
// compiles every source for sm_80 and sm_90) builds entry points that trap.
#if defined(REPRISE_EMULATE_PTX) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define GEMM_SM90_ENABLED 1
#endif

namespace {

// ---- PTX wrappers -----------------------------------------------------------------
// Hopper's own: every other inline-PTX statement is in common.cuh's wrappers. NOTE: the
// CPU emulator (tests/kernel_emu/driver_sm90.cpp) defines REPRISE_EMULATE_PTX and takes
// host definitions of these same functions, written to the PTX ISA, from
// tests/kernel_emu/wgmma_emu.h and mbarrier_emu.h.
#if defined(GEMM_SM90_ENABLED) && !defined(REPRISE_EMULATE_PTX)

// Shared memory written through the generic proxy (cp.async, plain stores) is read by
// wgmma through the async proxy: each writing thread fences before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// wgmma.fence: orders this warpgroup's earlier register and shared accesses before
// the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Wait until at most PENDING of this warpgroup's committed wgmma groups are in flight.
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma in flight.
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 128 fp32, this warpgroup's) += A (64 x 16, K-major) * B (16 x 128, K-major:
// w rows), both from shared memory through matrix descriptors. D fragment (PTX ISA,
// "Register fragments, wgmma .m64nNk16", f32 accumulator): with warp w of the
// warpgroup and lane l, d[i] = D[16 w + l / 4 + 8 ((i / 2) % 2)][8 (i / 4) + 2 (l % 4) + i % 2].
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long desc_a,
                                                 unsigned long long desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "n"(1)
      : "memory");
}

// setmaxnreg: this warpgroup's registers a thread move to N (a multiple of 8, 24-256),
// given back to or taken from the CTA's pool. Takes effect only in a kernel with a
// register cap at entry (__launch_bounds__(threads, 1)), each warpgroup role one branch.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- mbarriers and bulk copies (the warp-specialized kernel) ----
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the bulk copies).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}

// Expect `bytes` more transaction bytes in the current phase, then arrive.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned addr, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes) : "memory");
}

// True once the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ bool mbar_try_wait(unsigned addr, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(addr), "r"(parity)
      : "memory");
  return done != 0;
}

// An arrival on the barrier once all of this thread's earlier cp.async have landed; the
// barrier's count includes it (noinc).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(unsigned addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}

// `bytes` (a multiple of 16) global -> shared by the bulk copy engine, completing as
// transaction bytes on the barrier.
__device__ __forceinline__ void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(mbar)
      : "memory");
}

// The same copy under an L2 cache policy (common.cuh's l2_evict_first_policy): a weight
// tile no other CTA of the launch reads.
__device__ __forceinline__ void bulk_copy_g2s_hinted(unsigned dst, const void* src, unsigned bytes, unsigned mbar,
                                                     unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(mbar), "l"(policy)
      : "memory");
}

// ---- clusters (the _c2 entry points: two CTAs along M share each weight tile) ----
// The same copy, landing at offset `dst` of every CTA of the cluster in `mask` and
// completing there on the barrier at offset `mbar` (sm_90a).
__device__ __forceinline__ void bulk_copy_g2s_multicast(unsigned dst, const void* src, unsigned bytes,
                                                        unsigned mbar, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(mbar), "h"(mask)
      : "memory");
}

// An arrival on the barrier at the same offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_peer(unsigned addr, unsigned rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(addr),
      "r"(rank)
      : "memory");
}

__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster (release, then acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// The CTA's dynamic shared memory (the emulator gives each CTA of a cluster its own).
__device__ __forceinline__ unsigned char* cta_smem(unsigned char* smem) { return smem; }


__device__ __forceinline__ unsigned cluster_size() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}

// The fp32 word at shared offset `addr` of CTA `rank` of the cluster.
__device__ __forceinline__ float ld_peer_f32(unsigned addr, unsigned rank) {
  float v;
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\nld.shared::cluster.f32 %0, [remote];\n}\n"
      : "=f"(v)
      : "r"(addr), "r"(rank)
      : "memory");
  return v;
}

#endif  // GEMM_SM90_ENABLED && !REPRISE_EMULATE_PTX

#ifdef GEMM_SM90_ENABLED

// The shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13
// start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
// 49-51 base offset (0), 62-63 swizzle mode (0: none).
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr, unsigned lead_bytes,
                                                        unsigned stride_bytes) {
  return static_cast<unsigned long long>((addr >> 4) & 0x3FFFu) |
         (static_cast<unsigned long long>((lead_bytes >> 4) & 0x3FFFu) << 16) |
         (static_cast<unsigned long long>((stride_bytes >> 4) & 0x3FFFu) << 32);
}

// ---- the kernel ---------------------------------------------------------------------

template <int BM_, int BN_, int STAGES_>
struct Sm90Tile {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_;
  static constexpr int WARPGROUPS = BM / 64;
  static constexpr int THREADS = 128 * WARPGROUPS;
  static constexpr int N_SUB = BN / 128;      // wgmma.m64n128k16 per warpgroup per K slice
  static constexpr int CHUNKS_PER_ROW = BK / 8;  // 16-byte chunks of one row of a k-tile
  static constexpr int A_CHUNKS = BM * CHUNKS_PER_ROW, B_CHUNKS = BN * CHUNKS_PER_ROW;
  static constexpr int A_BYTES = A_CHUNKS * 16;
  static constexpr int STAGE_BYTES = (A_CHUNKS + B_CHUNKS) * 16;  // x tile, then w tile
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
  static constexpr unsigned LEAD_BYTES = 128;                    // next core matrix along K
  static constexpr unsigned STRIDE_BYTES = 8 * CHUNKS_PER_ROW * 16;  // next 8 rows: 1024

  static_assert(BM % 64 == 0 && BN % 128 == 0, "whole m64n128 instructions");
  static_assert((A_CHUNKS + B_CHUNKS) % THREADS == 0 && A_CHUNKS % THREADS == 0,
                "every thread copies alike");
  static_assert(STAGES >= 3, "the slot refilled is two tiles behind the one consumed");
};

// See the split-K note at the top; FOLD_WS is FOLD with the running total in an fp32
// workspace instead of registers (the wide ws tile, whose second register set would not fit).
// CSPLIT is PARTIAL with the partials folded through the shared memory of a cluster of
// the S CTAs of one tile (gemm_sm90_ws_tile's note), not through a workspace.
enum class Split { WHOLE, PARTIAL, FOLD, FOLD_WS, CSPLIT };

// A CTA's place in the launch: its m tile, its k-tiles [kt_begin, kt_end) and (PARTIAL)
// the offset of its split's slab in the workspace. WHOLE and FOLD: grid.x = m tiles,
// all of K. PARTIAL: grid.x = S * m tiles, blockIdx.x = split * m tiles + m tile; the
// split covers K elements [split * split_len, min(K, (split + 1) * split_len)).
struct KRange {
  int m_tile, kt_begin, kt_end;
  long long slab;
};

template <class T, Split MODE>
__device__ __forceinline__ KRange k_range(int M, int N, int K, int split_len) {
  if constexpr (MODE == Split::CSPLIT) {  // grid.x = m tiles * S, blockIdx.x = m tile * S + split
    const int num_splits = (K + split_len - 1) / split_len;
    const int split = static_cast<int>(blockIdx.x) % num_splits;
    return {static_cast<int>(blockIdx.x) / num_splits, split * (split_len / T::BK),
            min(K, (split + 1) * split_len) / T::BK, 0LL};
  }
  if (MODE != Split::PARTIAL) return {static_cast<int>(blockIdx.x), 0, K / T::BK, 0LL};
  const int num_m_tiles = (M + T::BM - 1) / T::BM;
  const int split = static_cast<int>(blockIdx.x) / num_m_tiles;
  const int end = min(K, (split + 1) * split_len);
  return {static_cast<int>(blockIdx.x) % num_m_tiles, split * (split_len / T::BK), end / T::BK,
          static_cast<long long>(split) * M * N};
}

// FOLD, at a split boundary: wait for the finished split's MMAs, add its partial into
// the running total (total = total + acc, one fp32 add an element, in ascending split
// order), and restart the accumulator from +0.0f for the next split.
template <class T>
__device__ __forceinline__ void fold_boundary(float (&acc)[T::N_SUB][64], float (&total)[T::N_SUB][64]) {
  wgmma_wait<0>();
#pragma unroll
  for (int s = 0; s < T::N_SUB; ++s) {
    wgmma_fence_operands(acc[s]);
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      total[s][i] += acc[s][i];
      acc[s][i] = 0.0f;
    }
  }
}

// The global source of this thread's chunk i of k-tile kt, in the core-matrix layout
// above (chunk c of the stage holds row 8 (c / 64) + c % 8, k chunk (c / 8) % 8), and
// whether its row exists. NOTE: an invalid chunk still gets an in-bounds address;
// cp.async with src-size 0 reads none of it.
template <class T>
__device__ __forceinline__ const unsigned short* chunk_source(int i, const unsigned short* __restrict__ x,
                                                             const unsigned short* __restrict__ w, int M, int N,
                                                             int K, int m0, int n0, int kt, bool& valid) {
  const int chunk = static_cast<int>(threadIdx.x) + i * T::THREADS;
  const bool is_a = chunk < T::A_CHUNKS;  // uniform per i: A_CHUNKS % THREADS == 0
  const int c = is_a ? chunk : chunk - T::A_CHUNKS;
  const int row = 8 * (c / (8 * T::CHUNKS_PER_ROW)) + c % 8;
  const int k = kt * T::BK + ((c / 8) % T::CHUNKS_PER_ROW) * 8;
  const int g_row = (is_a ? m0 : n0) + row;
  valid = g_row < (is_a ? M : N);
  return (is_a ? x : w) + (valid ? static_cast<long long>(g_row) * K + k : 0LL);
}

// Copy k-tile `kt` of x rows [m0, m0 + BM) and w rows [n0, n0 + BN) into one stage;
// rows past M or N are zero-filled. Chunk i of this thread lands at byte
// (threadIdx.x + i * THREADS) * 16 of the stage (the w tile follows the x tile).
template <class T>
__device__ __forceinline__ void load_tile(unsigned char* stage, const unsigned short* __restrict__ x,
                                          const unsigned short* __restrict__ w, int M, int N, int K,
                                          int m0, int n0, int kt, bool vec) {
  constexpr int PER_THREAD = (T::A_CHUNKS + T::B_CHUNKS) / T::THREADS;
  unsigned char* dst = stage + threadIdx.x * 16;
  if (vec) {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      bool valid;
      const unsigned short* src = chunk_source<T>(i, x, w, M, N, K, m0, n0, kt, valid);
      cp_async_16(shared_addr(dst + i * T::THREADS * 16), src, valid);
    }
  } else {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      bool valid;
      const unsigned short* src = chunk_source<T>(i, x, w, M, N, K, m0, n0, kt, valid);
      unsigned v[4] = {0u, 0u, 0u, 0u};
      if (valid) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          v[j] = static_cast<unsigned>(src[2 * j]) | (static_cast<unsigned>(src[2 * j + 1]) << 16);
      }
      *reinterpret_cast<uint4*>(dst + i * T::THREADS * 16) = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

// x: [M, K], w: [N, K] BF16 bits; y: [M, N]. grid = (ceil(M / BM), ceil(N / BN)),
// block = THREADS, dynamic shared memory = SMEM_BYTES; K % 64 == 0 (the launcher checks).
template <class T, Split MODE, class OutT>
__device__ __forceinline__ void gemm_sm90_tile(const unsigned short* __restrict__ x,
                                               const unsigned short* __restrict__ w, OutT* __restrict__ y,
                                               int M, int N, int K, int split_len) {
  extern __shared__ __align__(128) unsigned char gemm_sm90_smem[];
  // NOTE: the launcher mirrors THREADS and SMEM_BYTES (and split_len's granule); a
  // mismatch must fail loudly, not read past the ring or mis-split K.
  if (blockDim.x != T::THREADS || dynamic_smem_bytes() < static_cast<unsigned>(T::SMEM_BYTES)) __trap();
  if (MODE != Split::WHOLE && (split_len <= 0 || split_len % T::BK != 0)) __trap();

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) % 32;
  const KRange range = k_range<T, MODE>(M, N, K, split_len);
  if (MODE == Split::PARTIAL) y += range.slab;  // this split's slab of the workspace
  const int m0 = range.m_tile * T::BM, n0 = static_cast<int>(blockIdx.y) * T::BN;
  const int kt_begin = range.kt_begin, num_k_tiles = range.kt_end - range.kt_begin;
  const unsigned long long in_bits =
      reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w);
  const bool vec_in = (in_bits & 15ull) == 0;  // rows are K * 2 bytes: a multiple of 128
  const unsigned smem_base = shared_addr(gemm_sm90_smem);

  float acc[T::N_SUB][64];
  float total[T::N_SUB][64];  // FOLD's running total of finished splits (dropped otherwise)
#pragma unroll
  for (int s = 0; s < T::N_SUB; ++s)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[s][i] = total[s][i] = 0.0f;

  // Prologue: this CTA's tiles 0 .. STAGES - 3 (local index t; k-tile kt_begin + t).
  // One commit per tile slot (empty past the end) keeps the group count uniform.
#pragma unroll
  for (int s = 0; s < T::STAGES - 2; ++s) {
    if (s < num_k_tiles)
      load_tile<T>(gemm_sm90_smem + s * T::STAGE_BYTES, x, w, M, N, K, m0, n0, kt_begin + s, vec_in);
    cp_async_commit();
  }

  for (int t = 0; t < num_k_tiles; ++t) {
    cp_async_wait<T::STAGES - 3>();  // this thread's copies of tile t have landed
    fence_proxy_async();
    // Every thread's copies of tile t are visible to the tensor cores, and every
    // warpgroup has finished the MMAs of tile t - 2, whose slot is refilled next.
    __syncthreads();
    const int next = t + T::STAGES - 2;
    if (next < num_k_tiles)
      load_tile<T>(gemm_sm90_smem + (next % T::STAGES) * T::STAGE_BYTES, x, w, M, N, K, m0, n0,
                   kt_begin + next, vec_in);
    cp_async_commit();

    const unsigned a_base = smem_base + (t % T::STAGES) * T::STAGE_BYTES + warpgroup * 8 * T::STRIDE_BYTES;
    const unsigned b_base = smem_base + (t % T::STAGES) * T::STAGE_BYTES + T::A_BYTES;
    if (MODE == Split::FOLD && t > 0 && (t * T::BK) % split_len == 0) fold_boundary<T>(acc, total);
#pragma unroll
    for (int s = 0; s < T::N_SUB; ++s) wgmma_fence_operands(acc[s]);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < T::BK / 16; ++ks) {
      const unsigned long long desc_a = smem_desc(a_base + ks * 2 * T::LEAD_BYTES, T::LEAD_BYTES, T::STRIDE_BYTES);
#pragma unroll
      for (int s = 0; s < T::N_SUB; ++s) {
        const unsigned long long desc_b = smem_desc(b_base + s * 16 * T::STRIDE_BYTES + ks * 2 * T::LEAD_BYTES,
                                                    T::LEAD_BYTES, T::STRIDE_BYTES);
        wgmma_m64n128k16(acc[s], desc_a, desc_b);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();  // the MMAs of tile kt - 1 are done; those of kt may still run
#pragma unroll
    for (int s = 0; s < T::N_SUB; ++s) wgmma_fence_operands(acc[s]);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int s = 0; s < T::N_SUB; ++s) wgmma_fence_operands(acc[s]);
  cp_async_wait<0>();  // only empty groups remain; leave none behind

  if (MODE == Split::FOLD) fold_boundary<T>(acc, total);  // the last split joins the total

  // D fragment (see wgmma_m64n128k16): d[i] at row 16 warp + lane / 4 + 8 ((i / 2) % 2),
  // column 8 (i / 4) + 2 (lane % 4) + i % 2. Rows >= M and columns >= N are never written.
  const bool vec_out = N % 2 == 0 && reinterpret_cast<unsigned long long>(y) % (2 * sizeof(OutT)) == 0;
#pragma unroll
  for (int s = 0; s < T::N_SUB; ++s) {
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      const int row = m0 + warpgroup * 64 + warp * 16 + lane / 4 + 8 * ((i / 2) % 2);
      const int col = n0 + s * 128 + 8 * (i / 4) + 2 * (lane % 4);
      const float* d = MODE == Split::FOLD ? total[s] : acc[s];
      if (row < M && col < N)
        store_pair(y, static_cast<long long>(row) * N + col, d[i], d[i + 1], col + 1 < N, vec_out);
    }
  }
}

// ---- the warp-specialized kernel: packed weight, bulk copies, mbarrier ring ----------
//
// Warpgroup 0 produces, warpgroups 1 .. BM / 64 consume. For k-tile kt in stage
// s = kt % STAGES, the producer waits until the consumers have released the stage's
// previous tile (barrier empty[s]), then its 128 threads copy the x tile by cp.async
// (each arriving on full[s] when its copies land) while its thread 0 copies the w
// tile's BN / 64 panels from the packed weight with the bulk copy engine (transaction
// bytes on full[s]). The consumers wait on full[s], issue the tile's MMAs, and once
// those of tile kt - 1 are retired (wgmma.wait_group 1) release its stage. The stage
// layout and the MMAs are those of gemm_sm90_tile: the invariance argument is unchanged.
//
// The packed weight (gemm_sm90_kernel.prepare_weight): w rows padded with zeros to a
// multiple of 256, cut into 64-row panels; panel p's k-tile kt is the 8,192 bytes at
// ((p * (K / 64)) + kt) * 8,192, in the stage layout of a 64 x 64 tile (ws_chunk_offset).
//
// Measured (H200, bench/results/2026-11-27-h200, bench_gemm_sm90 at M = 2,048, same
// run): the 128-byte swizzle against the no-swizzle layout, same tiles: qkv 240 vs 398 us,
// o 161 vs 272, down 584 vs 885, gate_up 902 vs 1,098; the wide tile against 128 x 128
// (S = 1 weights): gate_up 902 vs 1,222, lm_head 4,028 vs 5,252.
//
// BN is the columns a CTA owns and loads (BN / 64 panels a k-tile); the stage's w tile
// holds B_ROWS = max(BN, 128) rows, whole m64n128 instructions: with BN = 64 (the decode
// tile) its rows 64-127 are zeros written once at the start, never loaded or stored, so
// a CTA computes 64 padding columns to own 64 (at M <= 64 the product is bound by the
// weight stream, and twice the CTAs fill the device: WsDecode below).
//
// Rows past M: this m tile's x rows past M are zeros written once at the start, in every
// stage (no copy writes them afterwards), and a consumer whose 64 rows all lie past M
// (M <= 64 on a two-consumer tile) issues no MMA and releases no stage. So at a decode's
// M = 1 the producer copies one row of x a k-tile instead of zero-filling 127, and one
// warpgroup, not two, takes the tensor cores and reads the stage. Rows past M never
// enter another element's sum and are never stored: neither change reaches a bit.
template <int BM_, int BN_, int STAGES_>
struct Sm90WsTile {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_;
  static constexpr int CONSUMERS = BM / 64;
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int B_ROWS = BN < 128 ? 128 : BN;
  static constexpr int N_SUB = B_ROWS / 128;
  static constexpr int CHUNKS_PER_ROW = BK / 8;
  static constexpr int A_CHUNKS = BM * CHUNKS_PER_ROW;
  static constexpr int A_BYTES = A_CHUNKS * 16;
  static constexpr int PANEL_BYTES = 64 * BK * 2;
  static constexpr int LOAD_BYTES = BN * BK * 2;  // the w bytes a k-tile brings
  static constexpr int B_BYTES = B_ROWS * BK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int BARRIER_OFFSET = STAGES * STAGE_BYTES;  // full[STAGES], then empty[STAGES]
  static constexpr int SMEM_BYTES = BARRIER_OFFSET + 2 * STAGES * 8;
  static constexpr unsigned ROW_BYTES = BK * 2;  // 128: one row of a k-tile

  static_assert((BN == 64 || BN % 128 == 0) && BM % 64 == 0 && A_CHUNKS % 128 == 0,
                "whole instructions, every producer copies alike");
  static_assert(STAGES >= 2, "a ring");
  static_assert(STAGE_BYTES % 1024 == 0 && A_BYTES % 1024 == 0, "every operand tile on a swizzle atom");
  // FOLD_WS on the wide tile: its consumers hold 128 accumulators and the fold's
  // addressing where the entry cap is ENTRY_REGS (65,536 / 384 to a multiple of 8: 168)
  // and spill there, so the producer gives registers back (PRODUCER_REGS) and the
  // consumers take them (CONSUMER_REGS). NOTE: setmaxnreg.inc waits until the CTA's own
  // pool, the ENTRY_REGS * THREADS it was launched with, has the registers: a budget
  // over that pool never returns (so it hung every wide launch on an H200, 2026-11-27,
  // at 48 / 232: 65,536 > 64,512). 56 / 224 is the pool exactly. Other modes and tiles
  // keep the entry cap (the wide WHOLE fits it in 154 registers, measured on the H200).
  // The tall tile (three consumers, 512 threads) enters at 128 registers, which its FOLD's
  // 64 accumulators and 64 running totals a consumer thread fill on their own (WS's FOLD
  // takes 144 at its 168 cap), so every mode of it moves registers the same way: 56 / 152,
  // again the pool exactly (128 x 56 + 384 x 152 = 65,536).
  static constexpr int ENTRY_REGS = 65536 / THREADS / 8 * 8;
  static constexpr int PRODUCER_REGS = N_SUB == 2 || CONSUMERS == 3 ? 56 : 0;
  static constexpr int CONSUMER_REGS = N_SUB == 2 ? 224 : CONSUMERS == 3 ? 152 : 0;
  static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= ENTRY_REGS * THREADS,
                "setmaxnreg within the CTA's pool, or .inc waits forever");
  static_assert(CONSUMERS <= 3, "four consumers would enter at 102 registers: no FOLD fits");
};

// Whether a launch of tile T in MODE moves registers from its producer to its consumers
// (setmaxnreg; PRODUCER_REGS above): the wide tile's FOLD_WS, and every mode of the tall tile.
template <class T, Split MODE>
constexpr bool kMovesRegisters = T::PRODUCER_REGS > 0 && (MODE == Split::FOLD_WS || T::CONSUMERS == 3);

// The stage layout of the warp-specialized kernel (REPRISE_WS_SWIZZLE, set by the
// launcher to match the packed weight's layout, gemm_sm90_kernel.prepare_weight):
//   1 (the default): the 128-byte swizzle. Row r of a tile (64 k, 128 bytes) at byte
//     r * 128, its 16-byte chunk j (k 8j .. 8j + 7) at position j ^ (r % 8) of the row;
//     8 rows make a 1,024-byte atom, every tile starts on one (the kernel traps
//     otherwise). Descriptor: swizzle mode 1, stride byte offset 1,024 (next 8 rows),
//     leading byte offset unused (16); K slice ks starts 32 ks bytes into the row (the
//     hardware applies the XOR of address bits 4-6 with bits 7-9 to every address).
//   0: gemm_sm90_tile's no-swizzle core-matrix layout (the header): chunk (r, j) at byte
//     (r / 8) * 1,024 + j * 128 + (r % 8) * 16; K slice ks at 256 ks.
// Either way a row group of 8 rows is 1,024 bytes, so consumer c's 64 rows of x start at
// c * 8,192 and N-subtile j's 128 rows of w at j * 16,384. Only addresses differ: every
// wgmma reads the same operand values, so the layout never reaches a result's bits.
#ifndef REPRISE_WS_SWIZZLE
#define REPRISE_WS_SWIZZLE 1
#endif
// Rows past M (the note above Sm90WsTile): 1, the default, zeros written once and idle
// consumers; 0 the producer zero-fills them every k-tile and every consumer computes,
// as before 2026-11-27 (built by the launcher for bench_gemm_sm90's same-run baseline
// only, gemm_sm90_kernel.PAD_ONCE). The same bits either way.
#ifndef REPRISE_WS_PAD_ONCE
#define REPRISE_WS_PAD_ONCE 1
#endif
// Ablations of the warp-specialized kernel, built for bench_gemm_sm90's timing columns
// alone (`--ablate`: gemm_sm90_kernel.ABLATE; nothing else builds them): WRONG OUTPUT, a
// measure of what a part of a launch costs by its absence. 0, the default: none. 1: a
// PARTIAL CTA returns once its partial is stored (no fence, count or fold, no output: the
// split's tail). 2: the consumers issue no MMA (the stages still come and go through the
// ring, the output is zeros: the weight stream alone).
#ifndef REPRISE_GEMM_ABLATE
#define REPRISE_GEMM_ABLATE 0
#endif

// Byte offset, within a tile, of row r's 16-byte chunk j.
__device__ __forceinline__ unsigned ws_chunk_offset(int r, int j) {
#if REPRISE_WS_SWIZZLE
  return static_cast<unsigned>(r * 128 + ((j ^ (r & 7)) << 4));
#else
  return static_cast<unsigned>((r / 8) * 1024 + j * 128 + (r % 8) * 16);
#endif
}

// The descriptor of a 64- or 128-row operand starting at row group `tile` (1,024-byte
// aligned), K slice ks (16 k) of the k-tile.
__device__ __forceinline__ unsigned long long ws_desc(unsigned tile, int ks) {
#if REPRISE_WS_SWIZZLE
  return smem_desc(tile + ks * 32, 16, 1024) | (1ull << 62);
#else
  return smem_desc(tile + ks * 256, 128, 1024);
#endif
}

// The global source of x chunk c of k-tile kt, and whether its row exists: row c / 8,
// 16-byte chunk c % 8 (a warp reads 4 whole rows of 128 bytes); it lands at
// ws_chunk_offset(row, chunk). An invalid chunk still gets an in-bounds address.
template <class T>
__device__ __forceinline__ const unsigned short* ws_x_source(int c, const unsigned short* __restrict__ x, int M,
                                                            int K, int m0, int kt, bool& valid) {
  const int row = c / T::CHUNKS_PER_ROW;
  const int k = kt * T::BK + (c % T::CHUNKS_PER_ROW) * 8;
  valid = m0 + row < M;
  return x + (valid ? static_cast<long long>(m0 + row) * K + k : 0LL);
}

// Element i of N-subtile j of this thread's accumulators (the D fragment of
// wgmma_m64n128k16): row row0 + lane / 4 + 8 ((i / 2) % 2), column col0 + 128 j + 8 (i / 4)
// + 2 (lane % 4) + i % 2, with row0 the warp's first row and col0 the tile's first column.
__device__ __forceinline__ int ws_row(int row0, int lane, int i) { return row0 + lane / 4 + 8 * ((i / 2) % 2); }
__device__ __forceinline__ int ws_col(int col0, int lane, int j, int i) {
  return col0 + j * 128 + 8 * (i / 4) + 2 * (lane % 4) + i % 2;
}

// The most splits FOLD_WS takes (gemm_sm90_plan.WIDE_FOLD_MAX_SPLITS repeats it; more
// trap): its split loop is unrolled (gemm_sm90_ws_tile). Llama-3.1-8B's weights split 4
// ways at most.
constexpr int FOLD_WS_MAX_SPLITS = 4;

// FOLD_WS, at a split boundary (last: false) or after the last split (last: true): wait
// for the split's MMAs, then for each of this thread's elements inside M x N, sum =
// (first ? +0.0f : total[row, col]) + acc, one fp32 add in ascending split order (the
// register FOLD's total = total + acc, fold_boundary, with total from +0.0f); at a
// boundary the sum goes back to the workspace and acc restarts from +0.0f, at the end it
// stays in acc for the epilogue. Each element's workspace word is written and read by
// this thread alone, in program order: no barrier, no atomics.
template <class T>
__device__ __forceinline__ void fold_to_workspace(float (&acc)[T::N_SUB][64], float* __restrict__ total, int row0,
                                                  int col0, int lane, int M, int N, bool first, bool last) {
  // Few live registers beside the 128 accumulators: one base word and the bounds as
  // counts left, every element's offset from them a compile-time constant or N * 8.
  const int row = ws_row(row0, lane, 0), col = ws_col(col0, lane, 0, 0);
  float* base = total + static_cast<long long>(row) * N + col;
  const int rows_left = M - row, cols_left = N - col;
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < T::N_SUB; ++j) {
    wgmma_fence_operands(acc[j]);
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int dr = 8 * ((i / 2) % 2), dc = ws_col(0, 0, j, i);  // ws_row / ws_col less row, col
      if (dr < rows_left && dc < cols_left) {
        float* word = base + (dr ? static_cast<long long>(N) * 8 : 0LL) + dc;
        const float sum = (first ? 0.0f : *word) + acc[j][i];
        if (last) acc[j][i] = sum;
        else *word = sum;
      }
      if (!last) acc[j][i] = 0.0f;
    }
  }
}

// CSPLIT: where element (r, c) of a consumer's 64 rows (r < 64, c < BN) keeps its fp32
// partial, row-major through the consumer's own x rows of the ring's stages (8,192 bytes a
// stage: 64 rows of 128 bytes), which no other warpgroup reads and no copy writes once
// the consumer has taken its last tile.
template <class T>
__device__ __forceinline__ unsigned stash_offset(int consumer, int r, int c) {
  constexpr unsigned kChunk = 64 * T::ROW_BYTES;  // a consumer's x rows in one stage
  static_assert(64 * T::BN * 4 <= T::STAGES * kChunk, "a consumer's partial fits its x rows of the ring");
  const unsigned byte = static_cast<unsigned>(r * T::BN + c) * 4u;
  return (byte / kChunk) * T::STAGE_BYTES + consumer * kChunk + byte % kChunk;
}

// CSPLIT: this thread's elements of the consumer's partial into its stash (stash_offset),
// as column pairs (BN even: 8-byte aligned, never across a stage's chunk), in the rows that
// exist (`rows_left` of the consumer's 64: those the fold reads). NOTE: the row test also
// keeps the MMAs pipelined: with every element stored unconditionally, ptxas serialized
// every wgmma of these entry points (C7515), as it did not for ws_store's.
template <class T>
__device__ __forceinline__ void ws_stash(unsigned char* smem, const float (&d)[T::N_SUB][64], int consumer,
                                         int warp, int lane, int rows_left) {
#pragma unroll
  for (int j = 0; j < T::N_SUB; ++j) {
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      if (j * 128 + 8 * (i / 4) >= T::BN) continue;  // padding columns (the decode tile)
      const int r = ws_row(warp * 16, lane, i), c = ws_col(0, lane, j, i);
      if (r < rows_left)
        *reinterpret_cast<float2*>(smem + stash_offset<T>(consumer, r, c)) = make_float2(d[j][i], d[j][i + 1]);
    }
  }
}

// The epilogue: this thread's elements d inside M x N into dst (BF16, rounded once, or
// fp32), as pairs of columns where the alignment allows.
template <class T, class DstT>
__device__ __forceinline__ void ws_store(DstT* __restrict__ dst, const float (&d)[T::N_SUB][64], int row0,
                                         int col0, int lane, int M, int N) {
  const bool vec_out = N % 2 == 0 && reinterpret_cast<unsigned long long>(dst) % (2 * sizeof(DstT)) == 0;
#pragma unroll
  for (int j = 0; j < T::N_SUB; ++j) {
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      if (j * 128 + 8 * (i / 4) >= T::BN) continue;  // padding columns (the decode tile)
      const int row = ws_row(row0, lane, i), col = ws_col(col0, lane, j, i);
      if (row < M && col < N)
        store_pair(dst, static_cast<long long>(row) * N + col, d[j][i], d[j][i + 1], col + 1 < N, vec_out);
    }
  }
}

// ---- row epilogues (the _norm and _rope entry points) -----------------------------------
// A decode's o and down projections feed add_rmsnorm (the residual add, then the next
// norm) and nothing else, and its bias-free qkv projection feeds rope_kv_write (the
// queries and keys rotated, the keys and values into their cache slots) and nothing else.
// With a row epilogue the product's own launch runs that kernel's work: every CTA that
// completes a tile of y (WHOLE: each; PARTIAL: the tile's folding CTA) counts itself in
// its m tile's epilogue counter, and the one that counts last (every n tile of the m tile
// written) runs it over the m tile's rows:
//   NORM: rmsnorm.cuh's add_rmsnorm_row a row, with all its 256 threads: the add_rmsnorm
//     kernel's own function and thread count, so its tree and its bits (DESIGN §4);
//   ROPE: kvcache.cuh's rope_kv_write_pair for every (row, head, pair), the
//     rope_kv_write kernel's own work item (elementwise: any thread may take any item).
// One kernel launch a layer fewer for each (three a layer). The y tiles are written and
// fenced before the count, as the split's partials are (fold_split_partials), and read
// through L2. One CTA does the rows: the launcher takes a row epilogue only up to
// gemm_sm90_plan.EPILOGUE_MAX_ROWS rows, where they cost less than a launch. The counter
// sits past the fold counters (gridDim.y * m tiles of them) and is left zero.
enum class RowEpi { NONE, NORM, ROPE };

struct NormArgs {
  const float* residual;        // [M, N] fp32, the residual stream before the add
  const __nv_bfloat16* weight;  // [N], the next RMSNorm's
  float* summed;                // [M, N] fp32: residual + y
  __nv_bfloat16* normed;        // [M, N]: rmsnorm(summed)
  float eps;
};

// What a row epilogue needs besides y: NORM's arguments or ROPE's (kvcache.cuh's; y is
// then [M, heads + 2 * kv_heads, head_dim]).
struct TailArgs {
  NormArgs norm;
  RopeKvArgs rope;
};

template <class T, RowEpi EPI>
__device__ __forceinline__ void row_epilogue(const unsigned short* __restrict__ y, const TailArgs& tail,
                                             unsigned* __restrict__ counters, int M, int N, int m_tile,
                                             bool tile_done, unsigned char* smem) {
  static_assert(EPI != RowEpi::NORM || T::THREADS == RMSNORM_THREADS, "add_rmsnorm's tree: its thread count");
  unsigned* const flag = reinterpret_cast<unsigned*>(smem);  // the drained ring's first words
  float* const scratch = reinterpret_cast<float*>(smem + 128);
  const int num_m_tiles = (M + T::BM - 1) / T::BM;
  unsigned* const counter = counters + static_cast<long long>(gridDim.y) * num_m_tiles + m_tile;
  __threadfence();  // this thread's y stores are visible device-wide before the count below
  __syncthreads();  // every thread's are (and every thread has read tile_done's flag)
  if (threadIdx.x == 0)
    *flag = tile_done && atomicAdd(counter, 1u) == gridDim.y - 1 ? 1u : 0u;
  __syncthreads();
  if (*flag == 0u) return;
  __threadfence();
  const int m0 = m_tile * T::BM, rows = min(T::BM, M - m0);
  const __nv_bfloat16* const rows_of_y = reinterpret_cast<const __nv_bfloat16*>(y);
  if constexpr (EPI == RowEpi::NORM) {
    const NormArgs& norm = tail.norm;
    for (int r = 0; r < rows; ++r) {
      const long long at = static_cast<long long>(m0 + r) * N;
      add_rmsnorm_row(norm.residual + at, rows_of_y + at, norm.weight, norm.summed + at, norm.normed + at, N,
                      norm.eps, scratch);
      __syncthreads();  // every thread has read this row's sum before the next row's writes scratch
    }
  } else if constexpr (EPI == RowEpi::ROPE) {
    const RopeKvArgs& rope = tail.rope;
    const int half = rope.head_dim >> 1, per_row = (rope.heads + rope.kv_heads) * half;
    for (int item = static_cast<int>(threadIdx.x); item < rows * per_row; item += T::THREADS) {
      const int r = item / per_row, pair = item % per_row;
      rope_kv_write_pair<true>(rows_of_y, N, rope, m0 + r, pair / half, pair % half);
    }
  }
  if (threadIdx.x == 0) *counter = 0u;  // the next launch, after this one in stream order, sees 0
}

// WHOLE, FOLD: y is the output; PARTIAL: y is the fp32 workspace [S, M, N], and the
// tile's last CTA folds it into out (fold_split_partials, common.cuh); FOLD_WS: y is the
// fp32 workspace [M, N] of the running totals, out the output. Launch geometry as gemm_sm90_tile.
//
// CLUSTER = 2 (the _c2 entry points, launched in clusters of two CTAs along x: m tiles
// 2c and 2c + 1 of the same n tile, WHOLE or FOLD on a two-consumer tile): the two CTAs
// take the same weight tiles, so each brings half of every k-tile's panels and the bulk
// copy engine multicasts them into both CTAs' stages (each stage's full barrier still
// expects the tile's LOAD_BYTES: half from its own producer, half from the peer's). So a
// stage is refilled only when the consumers of both CTAs are done with it: each
// consumer thread releases it on its own CTA's empty barrier and on the peer's, which
// count both CTAs' active consumers. A cluster barrier after the barriers' init (no
// multicast or remote arrival before the peer's barriers exist) and one before exit (none
// into a CTA that has left). Why: the tiles' loads come from L2, and the large-M launches
// of bench/results/2026-11-28-h200 (128 x 128 FOLD, wide WHOLE) imply 6.1-6.9 TB/s of
// them (tile bytes over the measured time, not a counter), the same rate whatever the
// tile: sharing the weight tile halves the weight's L2 reads. The x tile (cp.async, the CTA's own rows) and every MMA are unchanged, so
// the element's bits are (the invariance argument above). The launcher pairs m tiles
// that both hold rows (an even number of m tiles), which the kernel checks.
template <class T, Split MODE, int CLUSTER = 1, RowEpi EPI = RowEpi::NONE, class OutT, class FinalT>
__device__ __forceinline__ void gemm_sm90_ws_tile(const unsigned short* __restrict__ x,
                                                  const unsigned char* __restrict__ w_packed,
                                                  OutT* __restrict__ y, FinalT* __restrict__ out,
                                                  unsigned* __restrict__ counters, int M, int N, int K,
                                                  int split_len, const TailArgs& tail = TailArgs{}) {
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && (MODE == Split::WHOLE || MODE == Split::FOLD) &&
                                  T::CONSUMERS == 2 && (T::BN / 64) % CLUSTER == 0),
                "clusters of two m tiles, WHOLE or FOLD, each CTA bringing whole panels");
  static_assert(EPI == RowEpi::NONE || (CLUSTER == 1 && (MODE == Split::WHOLE || MODE == Split::PARTIAL)),
                "a row epilogue: one CTA a tile, WHOLE or PARTIAL");
  extern __shared__ __align__(128) unsigned char gemm_sm90_smem[];
  unsigned char* const smem = cta_smem(gemm_sm90_smem);
  if (blockDim.x != T::THREADS || dynamic_smem_bytes() < static_cast<unsigned>(T::SMEM_BYTES)) __trap();
  if (MODE != Split::WHOLE && (split_len <= 0 || split_len % T::BK != 0)) __trap();
  if (MODE == Split::FOLD_WS && (K + split_len - 1) / split_len > FOLD_WS_MAX_SPLITS) __trap();
  // CSPLIT: launched in clusters of the tile's S splits along x, rank = split
  if (MODE == Split::CSPLIT && (cluster_size() != static_cast<unsigned>((K + split_len - 1) / split_len) ||
                                cluster_ctarank() != blockIdx.x % cluster_size()))
    __trap();

  const int tid = static_cast<int>(threadIdx.x);
  const int warpgroup = tid / 128;
  const KRange range = k_range<T, MODE>(M, N, K, split_len);
  const int m0 = range.m_tile * T::BM, n0 = static_cast<int>(blockIdx.y) * T::BN;
  const int kt_begin = range.kt_begin, num_k_tiles = range.kt_end - range.kt_begin;
  const int panel_tiles = K / T::BK;  // k-tiles of one packed panel
  const unsigned smem_base = shared_addr(smem);
  if (smem_base % 1024 != 0) __trap();  // the swizzle atoms (ws_chunk_offset) need it
  const unsigned full0 = smem_base + T::BARRIER_OFFSET, empty0 = full0 + T::STAGES * 8;
  // The x rows of this m tile that exist (rows_here, at least 1) and the consumers that
  // own any of them (active); see "Rows past M" above.
  const int rows_here = REPRISE_WS_PAD_ONCE ? min(T::BM, M - m0) : T::BM;
  const int active = (rows_here + 63) / 64;
  // A cluster: this CTA's rank, and the consumers of the peer (m tile m_tile ^ 1) that
  // release its stages too. Both m tiles must hold rows (the launcher pairs only such).
  const unsigned rank = CLUSTER > 1 ? cluster_ctarank() : 0u;
  int peer_active = 0;
  if constexpr (CLUSTER > 1) {
    const int peer_rows = REPRISE_WS_PAD_ONCE ? min(T::BM, M - (range.m_tile ^ 1) * T::BM) : T::BM;
    if (rows_here < 1 || peer_rows < 1 || gridDim.x % CLUSTER != 0) __trap();
    peer_active = (peer_rows + 63) / 64;
  }

  if (tid == 0) {
    for (int s = 0; s < T::STAGES; ++s) {
      mbar_init(full0 + s * 8, 128 + 1);    // the producers' copies, thread 0's expect_tx
      mbar_init(empty0 + s * 8, 128 * (active + peer_active));  // every thread of an active consumer
    }
    mbar_init_fence();
  }
  // Zeros written once: the w tiles' padding rows (the decode tile) and the x tiles' rows
  // past M, in every stage; no copy writes either afterwards.
  const int pad_x = (T::BM - rows_here) * T::CHUNKS_PER_ROW;  // x chunks a stage
  constexpr int PAD_W = (T::B_ROWS - T::BN) * T::CHUNKS_PER_ROW;  // w chunks a stage
  if (pad_x + PAD_W > 0) {
    for (int c = tid; c < T::STAGES * (pad_x + PAD_W); c += T::THREADS) {
      const int stage = c / (pad_x + PAD_W), chunk = c % (pad_x + PAD_W);
      const unsigned offset =
          chunk < pad_x
              ? ws_chunk_offset(rows_here + chunk / T::CHUNKS_PER_ROW, chunk % T::CHUNKS_PER_ROW)
              : T::A_BYTES + T::BN * T::ROW_BYTES + (chunk - pad_x) * 16;
      *reinterpret_cast<uint4*>(smem + stage * T::STAGE_BYTES + offset) = make_uint4(0u, 0u, 0u, 0u);
    }
    fence_proxy_async();  // plain stores, read by wgmma
  }
  __syncthreads();
  if constexpr (CLUSTER > 1) cluster_sync();  // the peer's barriers exist before any copy or arrival reaches them

  // Thread 0 of the producer: expect local tile t's weight bytes on its stage's full
  // barrier and start their bulk copies (the tile's BN / 64 panels; in a cluster, the
  // panels of this CTA's rank, multicast to both CTAs). With one m tile (M <= BM: a
  // decode's rows) no other CTA reads a tile, so each weight byte is read once a launch:
  // under L2's evict-first policy (common.cuh), so a decode step's weight stream (8B's 16
  // GB, the default model's 270 MB with its 57 MB lm_head last) leaves L2 to what the next
  // step reads again, the KV pages above all. A hint: the same bytes land.
  const bool weights_once = CLUSTER == 1 && M <= T::BM;
  const auto issue_weight = [&](int t) {
    const int s = t % T::STAGES;
    mbar_arrive_expect_tx(full0 + s * 8, T::LOAD_BYTES);
    const long long panel0 = n0 / 64;
#pragma unroll
    for (int i = 0; i < T::BN / 64; ++i) {
      const unsigned dst = smem_base + s * T::STAGE_BYTES + T::A_BYTES + i * T::PANEL_BYTES;
      const unsigned char* src = w_packed + ((panel0 + i) * panel_tiles + kt_begin + t) * T::PANEL_BYTES;
      if constexpr (CLUSTER > 1) {
        if (i % CLUSTER == static_cast<int>(rank))
          bulk_copy_g2s_multicast(dst, src, T::PANEL_BYTES, full0 + s * 8, static_cast<unsigned short>((1u << CLUSTER) - 1));
      } else if (weights_once) {
        bulk_copy_g2s_hinted(dst, src, T::PANEL_BYTES, full0 + s * 8, l2_evict_first_policy());
      } else {
        bulk_copy_g2s(dst, src, T::PANEL_BYTES, full0 + s * 8);
      }
    }
  };
  // The first stages' weight tiles go before this grid waits for the one before it
  // (pdl_enter): the packed weight never changes and lands in this CTA's shared memory
  // only, so a launch as a programmatic dependent (pdl.py) streams it while the
  // previous kernel finishes. Nothing else is read or written before the wait.
  if (tid == 0)
    for (int t = 0; t < T::STAGES && t < num_k_tiles; ++t) issue_weight(t);
  pdl_enter();

  // Local tile t (k-tile kt_begin + t) sits in stage t % STAGES.
  if (warpgroup == 0) {  // ---- producer ----
    if constexpr (kMovesRegisters<T, MODE>) setmaxnreg_dec<T::PRODUCER_REGS>();
    const bool vec = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0;
    for (int t = 0; t < num_k_tiles; ++t) {
      const int s = t % T::STAGES, kt = kt_begin + t;
      if (t >= T::STAGES)  // the consumers released the stage's previous tile, t - STAGES
        while (!mbar_try_wait(empty0 + s * 8, ((t / T::STAGES) + 1) & 1)) {
        }
      unsigned char* stage = smem + s * T::STAGE_BYTES;
      if (tid == 0 && t >= T::STAGES) issue_weight(t);  // the first stages' went before
      // The x tile's rows that exist (the rest stay the zeros written at the start).
      if (vec) {
#pragma unroll
        for (int i = 0; i < T::A_CHUNKS / 128; ++i) {
          bool valid;
          const int c = tid + i * 128;
          const unsigned short* src = ws_x_source<T>(c, x, M, K, m0, kt, valid);
          if (valid || !REPRISE_WS_PAD_ONCE)
            cp_async_16(shared_addr(stage + ws_chunk_offset(c / T::CHUNKS_PER_ROW, c % T::CHUNKS_PER_ROW)), src,
                        valid);
        }
      } else {
#pragma unroll
        for (int i = 0; i < T::A_CHUNKS / 128; ++i) {
          bool valid;
          const int c = tid + i * 128;
          const unsigned short* src = ws_x_source<T>(c, x, M, K, m0, kt, valid);
          if (!valid && REPRISE_WS_PAD_ONCE) continue;
          unsigned v[4] = {0u, 0u, 0u, 0u};
          if (valid) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
              v[j] = static_cast<unsigned>(src[2 * j]) | (static_cast<unsigned>(src[2 * j + 1]) << 16);
          }
          *reinterpret_cast<uint4*>(stage + ws_chunk_offset(c / T::CHUNKS_PER_ROW, c % T::CHUNKS_PER_ROW)) =
              make_uint4(v[0], v[1], v[2], v[3]);
        }
        fence_proxy_async();  // plain stores, read by wgmma
      }
      cp_async_mbar_arrive_noinc(full0 + s * 8);
    }
    cp_async_commit();  // leave no copy of this thread in flight behind its exit
    cp_async_wait<0>();
    if (MODE != Split::PARTIAL && MODE != Split::CSPLIT && CLUSTER == 1 && EPI == RowEpi::NONE) return;
  } else if (warpgroup - 1 < active) {  // ---- consumers owning a row below M ----
    // (A consumer whose 64 rows all lie past M, at M <= 64 on a two-consumer tile, takes
    // neither branch: it waits for no stage and releases none, empty[s] counting the
    // active consumers' threads only, and goes on to PARTIAL's fold.)
    if constexpr (kMovesRegisters<T, MODE>) setmaxnreg_inc<T::CONSUMER_REGS>();
    const int consumer = warpgroup - 1;
    const int warp = (tid / 32) % 4, lane = tid % 32;
    const int row0 = m0 + consumer * 64 + warp * 16;  // this warp's first row
    float acc[T::N_SUB][64];
    float total[T::N_SUB][64];  // FOLD's running total of finished splits (dropped otherwise)
#pragma unroll
    for (int s = 0; s < T::N_SUB; ++s)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[s][i] = total[s][i] = 0.0f;

    // FOLD_WS walks K one split at a time, the pipeline drained between them, in a loop
    // unrolled to FOLD_WS_MAX_SPLITS runs: ptxas serializes every wgmma of a function
    // whose wgmma loop carries the accumulators through memory accesses (C7515), as a
    // loop over the splits would. Every other mode: one run of all its tiles.
    constexpr int RUNS = MODE == Split::FOLD_WS ? FOLD_WS_MAX_SPLITS : 1;
    const int run_tiles = MODE == Split::FOLD_WS ? split_len / T::BK : num_k_tiles;
#pragma unroll
    for (int run = 0; run < RUNS; ++run) {
      const int t0 = run * run_tiles;
      if (t0 >= num_k_tiles) break;
      if (MODE == Split::FOLD_WS && run > 0)
        fold_to_workspace<T>(acc, reinterpret_cast<float*>(y), row0, n0, lane, M, N, run == 1, false);
      const int t1 = min(num_k_tiles, t0 + run_tiles);
      for (int t = t0; t < t1; ++t) {
        const int s = t % T::STAGES;
        while (!mbar_try_wait(full0 + s * 8, (t / T::STAGES) & 1)) {
        }
        fence_proxy_async();  // the x tile came through the generic proxy (cp.async)
        const unsigned a_base = smem_base + s * T::STAGE_BYTES + consumer * 64 * T::ROW_BYTES;
        const unsigned b_base = smem_base + s * T::STAGE_BYTES + T::A_BYTES;
        if (MODE == Split::FOLD && t > 0 && (t * T::BK) % split_len == 0) fold_boundary<T>(acc, total);
#pragma unroll
        for (int j = 0; j < T::N_SUB; ++j) wgmma_fence_operands(acc[j]);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < T::BK / 16; ++ks) {
#pragma unroll
          for (int j = 0; j < T::N_SUB; ++j)
            if (REPRISE_GEMM_ABLATE != 2)  // the weight stream's ablation: no MMA
              wgmma_m64n128k16(acc[j], ws_desc(a_base, ks), ws_desc(b_base + j * 128 * T::ROW_BYTES, ks));
        }
        wgmma_commit();
        wgmma_wait<1>();  // the MMAs of tile t - 1 are retired: release its stage
#pragma unroll
        for (int j = 0; j < T::N_SUB; ++j) wgmma_fence_operands(acc[j]);
        if (t > 0) {
          mbar_arrive(empty0 + ((t - 1) % T::STAGES) * 8);
          if constexpr (CLUSTER > 1) mbar_arrive_peer(empty0 + ((t - 1) % T::STAGES) * 8, rank ^ 1u);
        }
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < T::N_SUB; ++j) wgmma_fence_operands(acc[j]);
    if (MODE == Split::FOLD) fold_boundary<T>(acc, total);  // the last split joins the total
    if constexpr (MODE == Split::FOLD_WS) {
      fold_to_workspace<T>(acc, reinterpret_cast<float*>(y), row0, n0, lane, M, N, K <= split_len, true);
      ws_store<T>(out, acc, row0, n0, lane, M, N);
    } else if constexpr (MODE == Split::CSPLIT) {
      // every warp of the consumer past its last MMA before any overwrites the x rows
      // they read (the stash spans the warpgroup's rows)
      if (consumer == 0) named_barrier_sync<1>(128);
      else named_barrier_sync<2>(128);
      ws_stash<T>(smem, acc, consumer, warp, lane, M - m0 - consumer * 64);
    } else {
      ws_store<T>(MODE == Split::PARTIAL ? y + range.slab : y, MODE == Split::FOLD ? total : acc, row0, n0, lane,
                  M, N);
    }
  }
  // PARTIAL: all 3 warpgroups count the CTA in and, in the last, fold. The flag word is
  // the first stage's, which no copy or MMA touches any more.
  if constexpr (MODE == Split::PARTIAL) {
    if (REPRISE_GEMM_ABLATE == 1) return;  // the tail's ablation: the partial stored, nothing folded
    fold_split_partials<T::BM, T::BN, T::THREADS>(y, out, counters, M, N, K, split_len, range.m_tile,
                                                  static_cast<int>(blockIdx.y), reinterpret_cast<unsigned*>(smem));
  }
  // A row epilogue: every CTA that wrote a tile of the output (WHOLE: each; PARTIAL: the
  // tile's folding CTA, whose flag word is still set) counts in; the last runs it.
  if constexpr (EPI != RowEpi::NONE) {
    const bool tile_done = MODE == Split::WHOLE || *reinterpret_cast<volatile unsigned*>(smem) != 0u;
    row_epilogue<T, EPI>(reinterpret_cast<const unsigned short*>(out), tail, counters, M, N, range.m_tile,
                         tile_done, smem);
  }
  // A cluster: no CTA leaves while the peer may still multicast into it or arrive on its
  // barriers (every thread of both: the producers did not return above).
  if constexpr (CLUSTER > 1) cluster_sync();
  // CSPLIT: once every CTA of the cluster (the tile's S splits) has stashed its partial,
  // each folds a share of the tile's elements from all S stashes (fold_partials_of: the
  // PARTIAL route's arithmetic) into y; then none leaves while another still reads it.
  if constexpr (MODE == Split::CSPLIT) {
    cluster_sync();
    const int num_splits = (K + split_len - 1) / split_len;
    const int rank = static_cast<int>(blockIdx.x) % num_splits;
    constexpr int kCols = IsGated<OutT>::value ? 2 : 1;  // a gated output's (gate, up) pairs
    constexpr int kPerRow = T::BN / kCols;
    for (int e = rank * T::THREADS + tid; e < rows_here * kPerRow; e += num_splits * T::THREADS) {
      const int r = e / kPerRow, c = e % kPerRow * kCols;
      if (m0 + r >= M || n0 + c >= N) continue;
      const unsigned at = smem_base + stash_offset<T>(r / 64, r % 64, c);
      store_folded(y, static_cast<long long>(m0 + r) * N + n0 + c,
                   fold_partials_of<kCols>(num_splits, [&](int split, int col) {
                     return ld_peer_f32(at + col * 4, static_cast<unsigned>(split));
                   }));
    }
    cluster_sync();
  }
}

// PARTIAL on a cp.async tile: this CTA's partial into the workspace, then the tile's
// last CTA folds (fold_split_partials, common.cuh). The flag word is the drained ring's first.
template <class T, class OutT>
__device__ __forceinline__ void gemm_sm90_split(const unsigned short* __restrict__ x,
                                                const unsigned short* __restrict__ w, float* __restrict__ ws,
                                                OutT* __restrict__ y, unsigned* __restrict__ counters, int M,
                                                int N, int K, int split_len) {
  extern __shared__ __align__(128) unsigned char gemm_sm90_smem[];
  gemm_sm90_tile<T, Split::PARTIAL>(x, w, ws, M, N, K, split_len);
  const int m_tile = static_cast<int>(blockIdx.x) % ((M + T::BM - 1) / T::BM);
  fold_split_partials<T::BM, T::BN, T::THREADS>(ws, y, counters, M, N, K, split_len, m_tile,
                                                static_cast<int>(blockIdx.y), reinterpret_cast<unsigned*>(gemm_sm90_smem));
}

using Ws = Sm90WsTile<128, 128, 6>;      // 3 warpgroups, 196,704 B shared
using WsWide = Sm90WsTile<128, 256, 4>;  // 128 accumulators a consumer thread (no FOLD; FOLD_WS): 196,672 B
// M <= 64 (decode): one consumer, 64 columns owned, 98,368 B shared: 2 CTAs an SM, twice
// WS's CTAs (o and down at M = 1: 256, one round on 132 SMs; WS: 128, one a SM).
using WsDecode = Sm90WsTile<64, 64, 4>;
static_assert(WsDecode::THREADS == 256 && 2 * (WsDecode::SMEM_BYTES + 1024) <= 232448, "2 CTAs an SM");
// M <= 64 where WS's grid passes a wave (gate_up, lm_head at decode): one consumer, all
// 128 columns owned, 98,368 B shared: 2 CTAs an SM, so WS's CTAs run in half the rounds
// (gate_up at M = 1: 224 CTAs in one round on 132 SMs, not 132 then 92) with a stage of
// 16 KB of weight each, where WS at M <= 64 holds a 128-row x tile whose second half and
// second consumer have nothing to do.
using WsM64 = Sm90WsTile<64, 128, 4>;
static_assert(WsM64::THREADS == 256 && 2 * (WsM64::SMEM_BYTES + 1024) <= 232448, "2 CTAs an SM");
static_assert(Ws::THREADS == 384 && WsWide::THREADS == 384, "launch bounds below");
// Past one m tile on split weights (FOLD), with TALL_FOLD_BY_DEFAULT (gemm_sm90_plan): three
// consumers of 64 x 128, each with FOLD's running totals in registers (kMovesRegisters), so
// a k-tile's 40 KB of x and w feed 192 x 128 outputs, where WS's 32 KB feed 128 x 128 (a
// fifth fewer tile bytes read from L2 a product) and the wide tile, which has no register
// FOLD, would need 48 KB for 128 x 256. 204,880 B shared.
using WsTall = Sm90WsTile<192, 128, 5>;
static_assert(WsTall::THREADS == 512 && WsTall::SMEM_BYTES + 1024 <= 232448, "launch bounds below; one CTA an SM");

// Tile shapes; gemm_sm90_plan.py's CONFIGS repeat these numbers (BM, BN, stages).
using Wg1 = Sm90Tile<64, 128, 8>;    // M <= 64 (decode): 1 warpgroup, 196,608 B shared
using Wg2 = Sm90Tile<128, 128, 6>;   // 2 warpgroups, 196,608 B shared
using Wg2Wide = Sm90Tile<128, 256, 4>;  // 2 warpgroups, 128 fp32 accumulators a thread, 196,608 B
static_assert(Wg1::THREADS == 128 && Wg2::THREADS == 256 && Wg2Wide::THREADS == 256, "launch bounds below");

#endif  // GEMM_SM90_ENABLED

}  // namespace

// Entry points: x: [M, K], w: [N, K] BF16 bits (gemm_sm90_ws_*: the packed weight),
// y: [M, N]. WHOLE (S = 1): (x, w, y, M, N, K). *_fold (FOLD; S > 1, any M): the same
// and split_len. *_split (PARTIAL; S > 1, M <= BM: one m tile): partials through the fp32
// workspace ws [S, M, N], folded by each tile's last CTA, counted in `counters`.
#ifdef GEMM_SM90_ENABLED
#define GEMM_SM90_BODY(TILE) gemm_sm90_tile<TILE, Split::WHOLE>(x, w, y, M, N, K, 0)
#define GEMM_SM90_FOLD_BODY(TILE) gemm_sm90_tile<TILE, Split::FOLD>(x, w, y, M, N, K, split_len)
#define GEMM_SM90_SPLIT_BODY(TILE) gemm_sm90_split<TILE>(x, w, ws, y, counters, M, N, K, split_len)
#define GEMM_SM90_WS_BODY(TILE, MODE, Y, OUT, SPLIT_LEN) \
  gemm_sm90_ws_tile<TILE, MODE>(x, w_packed, Y, OUT, static_cast<unsigned*>(nullptr), M, N, K, SPLIT_LEN)
#define GEMM_SM90_WS_SPLIT_BODY(TILE) \
  gemm_sm90_ws_tile<TILE, Split::PARTIAL>(x, w_packed, ws, y, counters, M, N, K, split_len)
#define GEMM_SM90_WS_GATED_SPLIT_BODY(TILE) \
  gemm_sm90_ws_tile<TILE, Split::PARTIAL>(x, w_packed, ws, gated(y), counters, M, N, K, split_len)
#define GEMM_SM90_WS_C2_BODY(TILE, MODE, Y, SPLIT_LEN) \
  gemm_sm90_ws_tile<TILE, MODE, 2>(x, w_packed, Y, Y, static_cast<unsigned*>(nullptr), M, N, K, SPLIT_LEN)
#define GEMM_SM90_WS_CSPLIT_BODY(TILE, Y) \
  gemm_sm90_ws_tile<TILE, Split::CSPLIT>(x, w_packed, Y, Y, static_cast<unsigned*>(nullptr), M, N, K, split_len)
#define GEMM_SM90_NORM_ARGS TailArgs{NormArgs{residual, norm_weight, summed, normed, eps}, RopeKvArgs{}}
#define GEMM_SM90_ROPE_ARGS                                                                              \
  TailArgs{NormArgs{}, RopeKvArgs{positions, cos_table, sin_table, q_out, slots, cache, layer, num_layers, \
                                  heads, kv_heads, block_size, head_dim}}
#define GEMM_SM90_WS_NORM_BODY(TILE)                                                                 \
  gemm_sm90_ws_tile<TILE, Split::WHOLE, 1, RowEpi::NORM>(x, w_packed, y, y, counters, M, N, K, 0, \
                                                         GEMM_SM90_NORM_ARGS)
#define GEMM_SM90_WS_NORM_SPLIT_BODY(TILE)                                                                     \
  gemm_sm90_ws_tile<TILE, Split::PARTIAL, 1, RowEpi::NORM>(x, w_packed, ws, y, counters, M, N, K, split_len, \
                                                           GEMM_SM90_NORM_ARGS)
#define GEMM_SM90_WS_ROPE_BODY(TILE)                                                                 \
  gemm_sm90_ws_tile<TILE, Split::WHOLE, 1, RowEpi::ROPE>(x, w_packed, y, y, counters, M, N, K, 0, \
                                                         GEMM_SM90_ROPE_ARGS)
#define GEMM_SM90_WS_ROPE_SPLIT_BODY(TILE)                                                                     \
  gemm_sm90_ws_tile<TILE, Split::PARTIAL, 1, RowEpi::ROPE>(x, w_packed, ws, y, counters, M, N, K, split_len, \
                                                           GEMM_SM90_ROPE_ARGS)
#else
#define GEMM_SM90_BODY(TILE) __trap()
#define GEMM_SM90_FOLD_BODY(TILE) __trap()
#define GEMM_SM90_SPLIT_BODY(TILE) __trap()
#define GEMM_SM90_WS_BODY(TILE, MODE, Y, OUT, SPLIT_LEN) __trap()
#define GEMM_SM90_WS_SPLIT_BODY(TILE) __trap()
#define GEMM_SM90_WS_C2_BODY(TILE, MODE, Y, SPLIT_LEN) __trap()
#define GEMM_SM90_WS_CSPLIT_BODY(TILE, Y) __trap()
#define GEMM_SM90_WS_GATED_SPLIT_BODY(TILE) __trap()
#define GEMM_SM90_WS_NORM_BODY(TILE) __trap()
#define GEMM_SM90_WS_NORM_SPLIT_BODY(TILE) __trap()
#define GEMM_SM90_WS_ROPE_BODY(TILE) __trap()
#define GEMM_SM90_WS_ROPE_SPLIT_BODY(TILE) __trap()
#endif

// The gated entry points' output, [M, N / 2] BF16 bits, as the epilogues take it.
__device__ __forceinline__ GatedBf16* gated(unsigned short* y) { return reinterpret_cast<GatedBf16*>(y); }

extern "C" __global__ void __launch_bounds__(128, 1)
gemm_sm90_bf16_wg1(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                   unsigned short* __restrict__ y, int M, int N, int K) {
  pdl_enter();
  GEMM_SM90_BODY(Wg1);
}

extern "C" __global__ void __launch_bounds__(128, 1)
gemm_sm90_f32_wg1(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                  float* __restrict__ y, int M, int N, int K) {
  pdl_enter();
  GEMM_SM90_BODY(Wg1);
}

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_sm90_bf16_wg2(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                   unsigned short* __restrict__ y, int M, int N, int K) {
  pdl_enter();
  GEMM_SM90_BODY(Wg2);
}

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_sm90_f32_wg2(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                  float* __restrict__ y, int M, int N, int K) {
  pdl_enter();
  GEMM_SM90_BODY(Wg2);
}

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_sm90_bf16_wg2wide(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                       unsigned short* __restrict__ y, int M, int N, int K) {
  pdl_enter();
  GEMM_SM90_BODY(Wg2Wide);
}

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_sm90_f32_wg2wide(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                      float* __restrict__ y, int M, int N, int K) {
  pdl_enter();
  GEMM_SM90_BODY(Wg2Wide);
}

extern "C" __global__ void __launch_bounds__(128, 1)
gemm_sm90_bf16_wg1_split(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                         float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M, int N,
                         int K, int split_len) {
  pdl_enter();
  GEMM_SM90_SPLIT_BODY(Wg1);
}

extern "C" __global__ void __launch_bounds__(128, 1)
gemm_sm90_f32_wg1_split(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                        float* __restrict__ ws, float* __restrict__ y, unsigned* __restrict__ counters, int M, int N,
                        int K, int split_len) {
  pdl_enter();
  GEMM_SM90_SPLIT_BODY(Wg1);
}

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_sm90_bf16_wg2_fold(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                        unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  pdl_enter();
  GEMM_SM90_FOLD_BODY(Wg2);
}

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_sm90_f32_wg2_fold(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                       float* __restrict__ y, int M, int N, int K, int split_len) {
  pdl_enter();
  GEMM_SM90_FOLD_BODY(Wg2);
}

// The warp-specialized kernel: w_packed is the packed weight (see Sm90WsTile).
extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_bf16(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                  unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(Ws, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_f32(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                 float* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(Ws, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

// The wide tile (BN = 256) on S = 1 weights, for launches whose grid fills the device.
extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_wide(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                       unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsWide, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_f32_wide(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                      float* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsWide, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

// The decode tile (M <= 64): WHOLE and PARTIAL, as gemm_sm90_ws_* and *_split.
extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_bf16_decode(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                         unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsDecode, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_f32_decode(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                        float* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsDecode, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_bf16_decode_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                               float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters,
                               int M, int N, int K, int split_len) {
  GEMM_SM90_WS_SPLIT_BODY(WsDecode);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_f32_decode_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                              float* __restrict__ ws, float* __restrict__ y, unsigned* __restrict__ counters, int M,
                              int N, int K, int split_len) {
  GEMM_SM90_WS_SPLIT_BODY(WsDecode);  // pdl_enter() inside, after the weight prologue
}

// The 64 x 128 tile (M <= 64): WHOLE and PARTIAL, as gemm_sm90_ws_* and *_split.
extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_bf16_m64(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                      unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsM64, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_f32_m64(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                     float* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsM64, Split::WHOLE, y, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_bf16_m64_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                            float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters,
                            int M, int N, int K, int split_len) {
  GEMM_SM90_WS_SPLIT_BODY(WsM64);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_f32_m64_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                           float* __restrict__ ws, float* __restrict__ y, unsigned* __restrict__ counters, int M,
                           int N, int K, int split_len) {
  GEMM_SM90_WS_SPLIT_BODY(WsM64);  // pdl_enter() inside, after the weight prologue
}

// The wide tile on S > 1 weights past one m tile: FOLD_WS, the running totals in ws [M, N].
extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_wide_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                            float* __restrict__ ws, unsigned short* __restrict__ y, int M, int N, int K,
                            int split_len) {
  GEMM_SM90_WS_BODY(WsWide, Split::FOLD_WS, ws, y, split_len);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_f32_wide_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                           float* __restrict__ ws, float* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_BODY(WsWide, Split::FOLD_WS, ws, y, split_len);  // pdl_enter() inside, after the weight prologue
}

// The tall tile (WsTall) on S > 1 weights past one m tile: FOLD, three consumers.
extern "C" __global__ void __launch_bounds__(512, 1)
gemm_sm90_ws_bf16_tall_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                            unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_BODY(WsTall, Split::FOLD, y, y, split_len);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(512, 1)
gemm_sm90_ws_f32_tall_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                           float* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_BODY(WsTall, Split::FOLD, y, y, split_len);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                       unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_BODY(Ws, Split::FOLD, y, y, split_len);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_f32_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                      float* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_BODY(Ws, Split::FOLD, y, y, split_len);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                        float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M, int N,
                        int K, int split_len) {
  GEMM_SM90_WS_SPLIT_BODY(Ws);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_f32_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                       float* __restrict__ ws, float* __restrict__ y, unsigned* __restrict__ counters, int M, int N,
                       int K, int split_len) {
  GEMM_SM90_WS_SPLIT_BODY(Ws);  // pdl_enter() inside, after the weight prologue
}

// The gated entry points (gemm_sm90_ws_gated*): the weight's rows interleave the gate and
// up projections (row 2j gate j, row 2j + 1 up j; prepare_weight's `gated`), and y is
// [M, N / 2]: y[m, j] = bf16(silu(gate) * up) of the product's columns 2j and 2j + 1,
// each rounded to BF16 first (store_pair for GatedBf16, common.cuh), so the bits of the
// plain product followed by activation.cu's silu_mul, in one kernel and without the
// [M, N] product in memory. Every column's sum is the plain product's, on every tile and
// route (the epilogue changes only what is stored): WHOLE on each tile, PARTIAL on each
// M <= 64 tile, FOLD on WS. No wide FOLD (off by default, and its totals live in [M, N]).
extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_gated(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                   unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(Ws, Split::WHOLE, gated(y), gated(y), 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_gated_wide(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                        unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsWide, Split::WHOLE, gated(y), gated(y), 0);  // pdl_enter() inside
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_gated_decode(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                          unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsDecode, Split::WHOLE, gated(y), gated(y), 0);  // pdl_enter() inside
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_gated_m64(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                       unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_BODY(WsM64, Split::WHOLE, gated(y), gated(y), 0);  // pdl_enter() inside
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_gated_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                         float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters,
                         int M, int N, int K, int split_len) {
  GEMM_SM90_WS_GATED_SPLIT_BODY(Ws);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_gated_decode_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                                float* __restrict__ ws, unsigned short* __restrict__ y,
                                unsigned* __restrict__ counters, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_GATED_SPLIT_BODY(WsDecode);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_gated_m64_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                             float* __restrict__ ws, unsigned short* __restrict__ y,
                             unsigned* __restrict__ counters, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_GATED_SPLIT_BODY(WsM64);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_gated_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                        unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_BODY(Ws, Split::FOLD, gated(y), gated(y), split_len);  // pdl_enter() inside
}

extern "C" __global__ void __launch_bounds__(512, 1)
gemm_sm90_ws_gated_tall_fold(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                             unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_BODY(WsTall, Split::FOLD, gated(y), gated(y), split_len);  // pdl_enter() inside
}

// The norm epilogue's entry points (gemm_sm90_ws_norm_*; gemm_sm90_plan's
// NORM_EPILOGUE_BY_DEFAULT): the BF16 product y of the decode tile or the 64 x 128 tile,
// WHOLE or PARTIAL as gemm_sm90_ws_bf16_{decode,m64}[_split], then (row_epilogue's NORM)
// summed = residual + y (fp32) and normed = rmsnorm(summed) * norm_weight (BF16), the bits of
// the add_rmsnorm kernel after the plain product. Each takes ws and split_len (WHOLE: unused)
// and the tile counters (one past the fold's for each m tile).
extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_norm_decode(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                         float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                         int N, int K, int split_len, const float* __restrict__ residual,
                         const __nv_bfloat16* __restrict__ norm_weight, float* __restrict__ summed,
                         __nv_bfloat16* __restrict__ normed, float eps) {
  GEMM_SM90_WS_NORM_BODY(WsDecode);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_norm_decode_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                               float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                               int N, int K, int split_len, const float* __restrict__ residual,
                               const __nv_bfloat16* __restrict__ norm_weight, float* __restrict__ summed,
                               __nv_bfloat16* __restrict__ normed, float eps) {
  GEMM_SM90_WS_NORM_SPLIT_BODY(WsDecode);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_norm_m64(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                      float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                      int N, int K, int split_len, const float* __restrict__ residual,
                      const __nv_bfloat16* __restrict__ norm_weight, float* __restrict__ summed,
                      __nv_bfloat16* __restrict__ normed, float eps) {
  GEMM_SM90_WS_NORM_BODY(WsM64);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_norm_m64_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                            float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                            int N, int K, int split_len, const float* __restrict__ residual,
                            const __nv_bfloat16* __restrict__ norm_weight, float* __restrict__ summed,
                            __nv_bfloat16* __restrict__ normed, float eps) {
  GEMM_SM90_WS_NORM_SPLIT_BODY(WsM64);  // pdl_enter() inside, after the weight prologue
}

// The rope epilogue's entry points (gemm_sm90_ws_rope_*; gemm_sm90_plan's
// ROPE_EPILOGUE_BY_DEFAULT): the BF16 product y ([M, heads + 2 * kv_heads, head_dim]) of the
// decode tile or the 64 x 128 tile, WHOLE or PARTIAL as gemm_sm90_ws_bf16_{decode,m64}[_split],
// then (row_epilogue) rope_kv_write's work on its rows: the queries rotated into q_out, the
// keys rotated and the values copied into their cache slots, the bits of the rope_kv_write
// kernel after the plain product. Each takes ws and split_len (WHOLE: unused) and the tile
// counters (one past the fold's for each m tile).
extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_rope_decode(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                         float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                         int N, int K, int split_len, const int* __restrict__ positions,
                         const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                         __nv_bfloat16* __restrict__ q_out, const long long* __restrict__ slots,
                         __nv_bfloat16* __restrict__ cache, int layer, int num_layers, int heads, int kv_heads,
                         int block_size, int head_dim) {
  GEMM_SM90_WS_ROPE_BODY(WsDecode);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_rope_decode_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                               float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                               int N, int K, int split_len, const int* __restrict__ positions,
                               const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                               __nv_bfloat16* __restrict__ q_out, const long long* __restrict__ slots,
                               __nv_bfloat16* __restrict__ cache, int layer, int num_layers, int heads, int kv_heads,
                               int block_size, int head_dim) {
  GEMM_SM90_WS_ROPE_SPLIT_BODY(WsDecode);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_rope_m64(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                      float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                      int N, int K, int split_len, const int* __restrict__ positions,
                      const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                      __nv_bfloat16* __restrict__ q_out, const long long* __restrict__ slots,
                      __nv_bfloat16* __restrict__ cache, int layer, int num_layers, int heads, int kv_heads,
                      int block_size, int head_dim) {
  GEMM_SM90_WS_ROPE_BODY(WsM64);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_rope_m64_split(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                            float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters, int M,
                            int N, int K, int split_len, const int* __restrict__ positions,
                            const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                            __nv_bfloat16* __restrict__ q_out, const long long* __restrict__ slots,
                            __nv_bfloat16* __restrict__ cache, int layer, int num_layers, int heads, int kv_heads,
                            int block_size, int head_dim) {
  GEMM_SM90_WS_ROPE_SPLIT_BODY(WsM64);  // pdl_enter() inside, after the weight prologue
}

// Clusters of two CTAs along M sharing each weight tile (gemm_sm90_ws_tile's CLUSTER = 2;
// gemm_sm90_plan's CLUSTER_BY_DEFAULT): WHOLE on WS and the wide tile, FOLD on WS, each
// with BF16, fp32 and gated (SwiGLU) output. grid.x (the m tiles) even. Only sm_90a has
// clusters here (elsewhere the bodies trap and no cluster is declared).
#if defined(GEMM_SM90_ENABLED) && !defined(REPRISE_EMULATE_PTX)
#define GEMM_SM90_CLUSTER_OF_2 __cluster_dims__(2, 1, 1)
#else
#define GEMM_SM90_CLUSTER_OF_2
#endif

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                     unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_C2_BODY(Ws, Split::WHOLE, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_f32_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                    float* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_C2_BODY(Ws, Split::WHOLE, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_gated_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                      unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_C2_BODY(Ws, Split::WHOLE, gated(y), 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_wide_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                          unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_C2_BODY(WsWide, Split::WHOLE, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_f32_wide_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                         float* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_C2_BODY(WsWide, Split::WHOLE, y, 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_gated_wide_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                           unsigned short* __restrict__ y, int M, int N, int K) {
  GEMM_SM90_WS_C2_BODY(WsWide, Split::WHOLE, gated(y), 0);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_fold_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                          unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_C2_BODY(Ws, Split::FOLD, y, split_len);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_f32_fold_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                         float* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_C2_BODY(Ws, Split::FOLD, y, split_len);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)
gemm_sm90_ws_gated_fold_c2(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                           unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_C2_BODY(Ws, Split::FOLD, gated(y), split_len);  // pdl_enter() inside, after the weight prologue
}

// The cluster split (CSPLIT; S > 1, M <= BM: one m tile): launched in clusters of the
// tile's S splits along x (a launch attribute: gemm_sm90_kernel launches it through
// pdl.launch), grid.x = S * m tiles with blockIdx.x = m tile * S + split; each CTA's
// partial folded from the cluster's shared memory, no workspace, no counters. (x, w_packed,
// y, M, N, K, split_len), y BF16, fp32 or gated [M, N / 2].

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_bf16_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                         unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(Ws, y);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_f32_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                        float* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(Ws, y);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(384, 1)
gemm_sm90_ws_gated_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                          unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(Ws, gated(y));  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_bf16_decode_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                                unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(WsDecode, y);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_f32_decode_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                               float* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(WsDecode, y);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_gated_decode_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                                 unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(WsDecode, gated(y));  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_bf16_m64_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                             unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(WsM64, y);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_f32_m64_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                            float* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(WsM64, y);  // pdl_enter() inside, after the weight prologue
}

extern "C" __global__ void __launch_bounds__(256, 2)
gemm_sm90_ws_gated_m64_csplit(const unsigned short* __restrict__ x, const unsigned char* __restrict__ w_packed,
                              unsigned short* __restrict__ y, int M, int N, int K, int split_len) {
  GEMM_SM90_WS_CSPLIT_BODY(WsM64, gated(y));  // pdl_enter() inside, after the weight prologue
}
