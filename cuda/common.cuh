// Device helpers the kernel families share: BF16 bit conversions and stores, warp and
// block sums with a fixed reduction tree, and the inline-PTX wrappers of the
// tensor-core kernels (cp.async, ldmatrix, mma.sync m16n8k16 BF16, %dynamic_smem_size),
// and the split attention kernels' work lookup and chunk merge (find_work, merge_chunks).
//
// Each `.cu` file includes it as "common.cuh". NVRTC gets the header inside the
// source text, never by an include path: nvrtc.kernel_source expands the include in
// place (with #line markers), for CI's compile and for CuPy's RawModule alike, so
// CuPy's kernel cache, whose key is the source text and the options, changes when this
// header does. The CPU emulator (tests/kernel_emu/driver*.cpp) includes it once, at
// file scope, before any kernel source.
//
// NOTE: the trees of warp_sum and block_sum are part of the batch-invariance contract
// (DESIGN §4): a reduction's shape fixes its rounding, so changing a tree changes bits
// and every twin comparison that relies on it.
#ifndef REPRISE_COMMON_CUH
#define REPRISE_COMMON_CUH

#include <cuda_bf16.h>

namespace {

// ---- PTX wrappers -----------------------------------------------------------------
// Every inline-PTX statement (and the shared-window address they take) lives in these
// wrappers and in gemm_sm90.cu's own (wgmma, mbarriers), nowhere else. NOTE: the CPU
// emulator defines REPRISE_EMULATE_PTX and takes host definitions of these same
// functions, written to the PTX ISA, from tests/kernel_emu/ptx_emu.h; no GPU build
// defines it, so there the wrappers below are the only definitions.
#ifndef REPRISE_EMULATE_PTX

// Programmatic dependent launch (sm_90+; issue 18): wait until the grid before this one
// in the stream has completed and its writes are visible, then let the grid after this
// one start launching (its CTAs wait here in turn). Every kernel calls it before it
// writes global memory and before it reads anything a grid still running may write, so
// a kernel launched early (kernels.launch with REPRISE_PDL=1) never sees a buffer its
// predecessor is still writing or reading (a buffer CuPy's pool handed on). Most call it
// first; three read before it only what no running grid writes (every grid but the one
// just before has completed): the Hopper GEMM its constant weight, attention_tc.cu and
// kvcache.cu's rope_kv_write the step's uploaded metadata, and attention the KV pages
// wholly before the step's positions (tests/test_pdl.py checks each at the source).
// Launched without the attribute, the default, the wait returns at once; below sm_90 it
// is not emitted.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned shared_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes = 0 writes 16 zero bytes and
// reads nothing (PTX ISA "cp.async": the bytes past src-size are zero-filled).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most `PENDING` of this thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Four 8x8 b16 matrices (PTX ISA 9.7.14.5.15, ldmatrix): lanes 8j..8j+7 give the row
// addresses of matrix j, and each lane gets, from matrix j in r[j], row lane/4,
// columns 2*(lane%4) and +1 (the lower column in the lower 16 bits).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// The same four matrices transposed (ldmatrix .trans): lane gets, from matrix j in
// r[j], rows 2*(lane%4) and +1 of column lane/4 (the lower row in the lower 16 bits).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d = A (16x16, row) * B (16x8, col) + d, fp32 accumulate in place. Fragments as in PTX
// ISA 9.7.14.5.8 (mma.m16n8k16, floating point types), with g = lane / 4 and
// t = lane % 4: a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
// a[3] = A[g+8][2t+8, 2t+9]; b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; d[0], d[1] =
// D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1]; the lower index in the lower 16 bits.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Named barrier ID (1-15; 0 is __syncthreads'), for `count` threads of the CTA (an
// immediate id, so ptxas reserves only the barriers used).
template <unsigned ID>
__device__ __forceinline__ void named_barrier_sync(unsigned count) {
  static_assert(ID >= 1 && ID <= 15, "bar.sync ids 1-15");
  asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "r"(count) : "memory");
}

// 2^x by the special function unit (PTX ISA "ex2": ex2.approx.ftz.f32, one MUFU.EX2 on
// sm_80 and sm_90; subnormal input and output flushed to zero, ex2(-inf) = +0). Not
// correctly rounded (at most about 2 ulp off), but a function of x alone on a given
// device: attention_tc.cu's softmax steps take it where expf (about nine instructions)
// was, and every path of theirs takes the same one.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A persistent launch's grid barrier (grid_sync below): a word loaded with acquire and
// stored with release semantics at GPU scope, and a short back-off while spinning.
__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_gpu(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void spin_pause() { __nanosleep(32); }

// A weight word, read once a step: through the read-only path, not kept in L1, and in L2
// under a policy that marks it first to go (createpolicy's evict_first, fraction 1), so a
// decode step's stream of weights (the default model's 270 MB against the H200's 60 MB of
// L2) does not push out what a step reads again: the KV pages, activations and partials.
// A hint: the value is the plain load's.
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ unsigned ldg_evict_first(const unsigned* p, unsigned long long policy) {
  unsigned v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;\n" : "=r"(v) : "l"(p), "l"(policy));
  return v;
}

// The launch's dynamic shared memory in bytes; kernels check it against what they need.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
  return bytes;
}

#endif  // REPRISE_EMULATE_PTX

// ---- BF16 -------------------------------------------------------------------------

// The cosine and sine that rotate pair i of `token`'s heads: the fp32 tables' row of its
// absolute position [max_positions, half], so a rotation depends on the position alone.
__device__ __forceinline__ void rope_angle(const int* __restrict__ positions, const float* __restrict__ cos_table,
                                           const float* __restrict__ sin_table, int token, int i, int half,
                                           float& c, float& s) {
  const long long pos = __ldg(positions + token);
  c = __ldg(cos_table + pos * half + i);
  s = __ldg(sin_table + pos * half + i);
}

// Rotary position embedding of one pair (x[i], x[i + half]) of a head's row into dst, Hugging
// Face's half-split layout: products and sums round as the twin's fp32 numpy expressions do (no
// fused multiply-add), out1 = x1 * c - x2 * s, out2 = x2 * c + x1 * s, then BF16 (twin: rope.py).
// rope_store: the same of the pair's values (x1, x2) already read.
__device__ __forceinline__ void rope_store(__nv_bfloat16* __restrict__ dst, int i, int half, float x1, float x2,
                                           float c, float s) {
  dst[i] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
  dst[i + half] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

__device__ __forceinline__ void rope_pair(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ dst,
                                          int i, int half, float c, float s) {
  rope_store(dst, i, half, __bfloat162float(x[i]), __bfloat162float(x[i + half]), c, s);
}

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// The BF16 bit pattern of v rounded to nearest even (the one rounding every kernel uses).
__device__ __forceinline__ unsigned bf16_bits(float v) {
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}

// Two floats as BF16 in one 32-bit word, the first in the lower half (the lower address).
__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }

// y[idx] = v0 and, if has_second, y[idx + 1] = v1: BF16 bits (rounded as bf16_bits) or
// fp32 as is; `vec` (the caller checked the alignment) stores the pair as one word.
__device__ __forceinline__ void store_pair(unsigned short* __restrict__ y, long long idx, float v0, float v1,
                                           bool has_second, bool vec) {
  if (vec && has_second) {
    *reinterpret_cast<unsigned*>(y + idx) = bf16_pair(v0, v1);
  } else {
    y[idx] = static_cast<unsigned short>(bf16_bits(v0));
    if (has_second) y[idx + 1] = static_cast<unsigned short>(bf16_bits(v1));
  }
}

__device__ __forceinline__ void store_pair(float* __restrict__ y, long long idx, float v0, float v1,
                                           bool has_second, bool vec) {
  if (vec && has_second) {
    *reinterpret_cast<float2*>(y + idx) = make_float2(v0, v1);
  } else {
    y[idx] = v0;
    if (has_second) y[idx + 1] = v1;
  }
}

// ---- SwiGLU -------------------------------------------------------------------------
// silu(gate) * up = gate / (1 + e^-gate) * up in fp32, of a (gate, up) pair as the
// fused gate/up projection's BF16 outputs hold them; the caller rounds it once to BF16.
// The one formula activation.cu's silu_mul and the Hopper GEMM's gated epilogue share,
// so a fused product gives the bits of the two kernels it replaces (twin:
// activation.silu_mul_ref).
__device__ __forceinline__ float silu_mul_value(float gate, float up) {
  const float silu = __fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate)));
  return __fmul_rn(silu, up);
}

// v as its BF16 value (rounded to nearest even, as bf16_bits), back in fp32.
__device__ __forceinline__ float bf16_value(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// An element of a gated output: a GEMM whose weight rows interleave the gate and up
// projections (row 2j gate j, row 2j + 1 up j: gemm_sm90_kernel.prepare_weight's
// `gated`) stores, for output columns 2j and 2j + 1 of a row, one BF16 value
// silu(gate) * up at column j of an [M, N / 2] output: each of gate and up rounded to
// BF16 first, as the plain product stores them and silu_mul reads them. BF16 bits.
struct GatedBf16 {
  unsigned short bits;
};

// y is the [M, N / 2] output: columns idx and idx + 1 of the [M, N] product (idx even,
// N even: the launcher checks) land at idx / 2.
__device__ __forceinline__ void store_pair(GatedBf16* __restrict__ y, long long idx, float gate, float up,
                                           bool has_second, bool vec) {
  (void)has_second;
  (void)vec;
  y[idx / 2].bits = static_cast<unsigned short>(bf16_bits(silu_mul_value(bf16_value(gate), bf16_value(up))));
}

template <class OutT>
struct IsGated {
  static constexpr bool value = false;
};
template <>
struct IsGated<GatedBf16> {
  static constexpr bool value = true;
};

// ---- reductions -------------------------------------------------------------------

// The sum of v over the 32 lanes of a full warp, in every lane: a butterfly over lane
// distances 16, 8, 4, 2, 1. NOTE: every lane adds the same two values at each level
// (in swapped order; fp32 addition commutes), so all lanes hold the same bits.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over a block of THREADS threads, returned to every thread: warp_sum in
// each warp, then warp 0 sums the warps' sums (warp order, padded with zeros to 32)
// with warp_sum again. `scratch`: THREADS / 32 floats of shared memory. NOTE: the tree
// depends on THREADS alone; every thread of the block must call it (two barriers).
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32 of them");
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

// Every CTA of a persistent launch (one whose CTAs are all resident at once: decode_block.cu)
// waits here until every other has arrived; each CTA's global stores before it are visible
// to every CTA after it. bar[0] counts this round's arrivals (zero between rounds, left
// zero), bar[1] the rounds: the last CTA to arrive zeroes the count, then releases the
// next round's number, which the others wait for. `round`: thread 0's copy of bar[1] as
// this round began (grid_round, once a launch, after its wait), advanced here, so an
// arrival costs one atomic and the wait's loads. Thread 0 arrives for its CTA after the
// CTA's barrier, as cooperative groups' grid sync does; every thread must call it.
__device__ __forceinline__ unsigned grid_round(const unsigned* bar) {
  return threadIdx.x == 0 ? load_acquire_gpu(bar + 1) : 0u;
}

__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& round) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the CTA's stores (ordered before this thread's by the barrier) first
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      bar[0] = 0u;
      store_release_gpu(bar + 1, round + 1u);
    } else {
      while (load_acquire_gpu(bar + 1) == round) spin_pause();
    }
    ++round;
    __threadfence();
  }
  __syncthreads();
}

// Split attention (attention.cu, attention_tc.cu): the merge of the next chunk's state (m2, denom2, acc2) into a row's total over the
// chunks before it (m1, denom1, acc1), paged_attention_ref's _RowState.merge op for op:
// m' = max(m1, m2), a1 = exp(m1 - m'), a2 = exp(m2 - m'), then each sum x becomes
// merged(x1, a1, x2, a2) = x1 * a1 + x2 * a2, every op rounded on its own. BASE2: the
// maxima are in log2 units (attention_tc.cu's scores times scale * log2(e)), and the
// factors are exp2_approx of the differences.
template <bool BASE2 = false>
__device__ __forceinline__ float merge_factors(float m1, float m2, float& a1, float& a2) {
  const float m = fmaxf(m1, m2);
  if constexpr (BASE2) {
    a1 = exp2_approx(__fsub_rn(m1, m));
    a2 = exp2_approx(__fsub_rn(m2, m));
  } else {
    a1 = expf(__fsub_rn(m1, m));
    a2 = expf(__fsub_rn(m2, m));
  }
  return m;
}

__device__ __forceinline__ float merged(float x1, float a1, float x2, float a2) {
  return __fadd_rn(__fmul_rn(x1, a1), __fmul_rn(x2, a2));
}

// ---- split attention: the work item and the chunk merge ----------------------------
// attention.cu and attention_tc.cu share these. NOTE: the CPU emulator includes this
// header once at file scope, before those sources, so nothing here may name a constant
// of theirs: the chunk size comes in as a template argument (their kKvChunk).

// The CTA's (sequence, query tile) for work item `work`, from a prefix sum over the
// sequences' query lengths (query_start_loc), a warp at a time. Every warp computes it,
// to the same answer; false when the item is past the last tile (the grid is an upper
// bound).
__device__ __forceinline__ bool find_work(const int* __restrict__ query_start_loc, int num_seqs,
                                          int tokens_per_cta, int work, int lane, int& seq,
                                          int& q_tile) {
  int base = 0;  // tiles of the sequences before `first`
  for (int first = 0; first < num_seqs; first += 32) {
    const int b = first + lane;
    int count = 0;
    if (b < num_seqs) {
      const int q_len = query_start_loc[b + 1] - query_start_loc[b];
      count = q_len > 0 ? (q_len + tokens_per_cta - 1) / tokens_per_cta : 0;
    }
    int inclusive = count;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int below = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += below;
    }
    const int exclusive = inclusive - count;
    const unsigned int hit =
        __ballot_sync(0xffffffffu, base + exclusive <= work && work < base + inclusive);
    if (hit != 0u) {  // warp-uniform
      const int src = __ffs(hit) - 1;
      seq = first + src;
      q_tile = work - base - __shfl_sync(0xffffffffu, exclusive, src);
      return true;
    }
    base += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return false;
}

// The split's last step, in the CTA that finishes its (work item, head slot) last: for
// each of its rows (row r: token token0 + r / group_rows, head head0 + r % group_rows, at
// position first_pos + r / group_rows), the chunk states 0 .. position / KV_CHUNK from the
// workspace merged in ascending order (merge_factors / merged), then out = bf16(acc /
// denom) (zero_sign: -0 as +0). Thread i takes elements i, i + blockDim.x, ... of the
// rows' [rows, head_dim] outputs (or, given `first` and `stride`, elements first, first +
// stride, ...: half a persistent CTA's threads). BASE2: as merge_factors.
// NOTE: the states are read kMergeBatch chunks at a time, all loads of a batch before its
// merges, so a row's chunks cost one L2 round trip a batch, not one a chunk (a chunk's
// loads do not depend on the merge before it; the merges stay in ascending order, so the
// batching reaches no bit). A round trip a chunk is what the H200's figures suggest: their
// crude fit in README.md charges about 1 us a chunk merged (not yet timed since).
constexpr int kMergeBatch = 4;

template <int HEAD_DIM, int KV_CHUNK, bool BASE2 = false>
__device__ __forceinline__ void merge_chunks(unsigned short* __restrict__ out, const float* __restrict__ ws_acc,
                                             const float* __restrict__ ws_ml, int num_rows, int group_rows,
                                             long long token0, int first_pos, int num_heads, int head0,
                                             int max_chunks, bool zero_sign, int first = -1, int stride = 0) {
  if (first < 0) first = static_cast<int>(threadIdx.x), stride = static_cast<int>(blockDim.x);
  for (int idx = first; idx < num_rows * HEAD_DIM; idx += stride) {
    const int r = idx / HEAD_DIM, d = idx % HEAD_DIM;
    const long long at = (token0 + r / group_rows) * num_heads + head0 + r % group_rows;
    const int num_chunks = (first_pos + r / group_rows) / KV_CHUNK + 1;
    const long long slot = at * max_chunks;  // the row's chunk 0
    float m = 0.0f, denom = 0.0f, acc = 0.0f;
    for (int c0 = 0; c0 < num_chunks; c0 += kMergeBatch) {
      float ms[kMergeBatch], denoms[kMergeBatch], accs[kMergeBatch];
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        if (c0 + i < num_chunks) {
          ms[i] = __ldcg(ws_ml + (slot + c0 + i) * 2);
          denoms[i] = __ldcg(ws_ml + (slot + c0 + i) * 2 + 1);
          accs[i] = __ldcg(ws_acc + (slot + c0 + i) * HEAD_DIM + d);
        }
      }
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        if (c0 + i >= num_chunks) break;
        if (c0 + i == 0) {  // chunk 0: taken as it is
          m = ms[i];
          denom = denoms[i];
          acc = accs[i];
          continue;
        }
        float a1, a2;
        m = merge_factors<BASE2>(m, ms[i], a1, a2);
        denom = merged(denom, a1, denoms[i], a2);
        acc = merged(acc, a1, accs[i], a2);
      }
    }
    if (zero_sign && acc == 0.0f) acc = 0.0f;
    out[at * HEAD_DIM + d] = static_cast<unsigned short>(bf16_bits(__fdiv_rn(acc, denom)));
  }
}

// Split-K's last step (gemm.cu's skinny route, gemm_sm90.cu's PARTIAL route), once every
// thread of the CTA stored its fp32 partial of the (BM x BN) tile (n tile `n_tile`,
// m tile `m_tile`) into slab `split` of ws [S, M, N], S = ceil(K / split_len): the CTA
// that counts last in the tile's counter (one zero per (n tile, m tile), at n_tile *
// m tiles + m tile) folds the S partials in ascending split order from +0.0f, writes y
// (BF16 bits, rounded once as bf16_bits, or fp32, or GatedBf16: silu(gate) * up of each
// column pair, [M, N / 2]) and leaves the counter zero.
// One output element's split partials folded (kCols = 2: a gated output's (gate, up)
// column pair, each folded as any column): from +0, in ascending split order, each
// partial(s, c) an fp32 read; kMergeBatch reads at a time, every read of a batch before
// its adds (one round trip a batch, as merge_chunks). Every split route's fold (the
// PARTIAL route's through the workspace, the cluster split's through its CTAs' shared
// memory) is this one, so they add the same values in the same order.
template <int kCols>
struct Folded {
  float sums[kCols];
};
template <int kCols, class Partial>
__device__ __forceinline__ Folded<kCols> fold_partials_of(int num_splits, Partial partial) {
  Folded<kCols> folded;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float sum = 0.0f;
    for (int s0 = 0; s0 < num_splits; s0 += kMergeBatch) {
      float part[kMergeBatch];
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        if (s0 + i < num_splits) part[i] = partial(s0 + i, c);
      }
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        if (s0 + i < num_splits) sum = __fadd_rn(sum, part[i]);
      }
    }
    folded.sums[c] = sum;
  }
  return folded;
}

// A folded element into y[at]: BF16 rounded once, fp32 as is, or (gated) the pair's
// silu(gate) * up.
template <class OutT, int kCols>
__device__ __forceinline__ void store_folded(OutT* __restrict__ y, long long at, const Folded<kCols>& f) {
  if constexpr (IsGated<OutT>::value) {
    store_pair(y, at, f.sums[0], f.sums[kCols - 1], true, false);
  } else if constexpr (sizeof(OutT) == 2) {
    y[at] = static_cast<unsigned short>(bf16_bits(f.sums[0]));
  } else {
    y[at] = f.sums[0];
  }
}

// NOTE: the CUDA programming guide's last-block pattern: every thread's stores,
// __threadfence, one atomicAdd per CTA; the CTA that sees S - 1 fences again and reads
// the partials through L2 (__ldcg, never a stale L1 line). Which CTA is last changes who
// adds, never what is added. `flag` is a word of shared memory no thread reads any more.
template <int BM, int BN, int THREADS, class OutT>
__device__ __forceinline__ void fold_split_partials(const float* __restrict__ ws, OutT* __restrict__ y,
                                                    unsigned* __restrict__ counters, int M, int N, int K,
                                                    int split_len, int m_tile, int n_tile, unsigned* flag) {
  const int num_m_tiles = (M + BM - 1) / BM, num_splits = (K + split_len - 1) / split_len;
  unsigned* counter = counters + static_cast<long long>(n_tile) * num_m_tiles + m_tile;
  __threadfence();  // this thread's partial is visible device-wide before the count below
  __syncthreads();  // every thread's is
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == static_cast<unsigned>(num_splits - 1) ? 1u : 0u;
  __syncthreads();
  if (*flag == 0u) return;
  __threadfence();
  const int m0 = m_tile * BM, n0 = n_tile * BN;
  const long long slab = static_cast<long long>(M) * N;
  // a gated output folds a (gate, up) pair of columns an iteration, each as any column
  constexpr int kCols = IsGated<OutT>::value ? 2 : 1;
  for (int e = static_cast<int>(threadIdx.x); e < BM * BN / kCols; e += THREADS) {
    const int row = m0 + e / (BN / kCols), col = n0 + e % (BN / kCols) * kCols;
    if (row >= M || col >= N) continue;
    const long long at = static_cast<long long>(row) * N + col;
    store_folded(y, at, fold_partials_of<kCols>(num_splits, [&](int s, int c) {
                   return __ldcg(ws + s * slab + at + c);
                 }));
  }
  if (threadIdx.x == 0) *counter = 0u;  // the next launch, after this one in stream order, sees 0
}

}  // namespace

#endif  // REPRISE_COMMON_CUH
