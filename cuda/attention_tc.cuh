// The tensor-core paged attention's device code: attention_tc.cu's kernel body
// (paged_attention_tc) and its page steps, ring and merge, which attention_tc.cu's entry
// points instantiate and decode_block.cu's persistent launch runs too (VIRTUAL: half a
// CTA a planned CTA), so both compute the same bits. attention_tc.cu's header says how it
// works and why its bits are what they are.
//
// NOTE: no include guard. NVRTC gets each header once (nvrtc.kernel_source expands a
// header once a source); the CPU emulator includes this file once in each kernel's own
// namespace (tests/kernel_emu/driver.cpp: attention_tc.cu's, decode_block.cu's), which a
// guard would reduce to the first.
#include "common.cuh"

// The softmax step's p: 0, the default, the exponential of every key's difference (a
// masked key's is -inf: +0); 1 a select around each, as before 2026-11-27 (built by the
// launcher for bench_gpu_kernels' same-run baseline only, attention_tc_kernel.BUILD).
// The same bits either way (tests/test_attention_tc_emulated.py).
#ifndef REPRISE_ATTN_EXP_SELECT
#define REPRISE_ATTN_EXP_SELECT 0
#endif
// The page step: 0, the default, the softmax in base 2 (scores and maxima in log2 units,
// s * scale * log2(e), each p one FFMA and one ex2.approx), acc * a skipped where every a
// of the warp's rows is 1, the masks skipped on a page the warp sees whole; 1 the step as
// it was before those (built by the launcher for bench_gpu_kernels' same-run baseline
// only, attention_tc_kernel.BUILD): the accurate expf of scores in natural units
// (s * scale), about nine instructions each, acc * a and the masks on every page. Other
// bits, the same invariance either way.
#ifndef REPRISE_ATTN_EXPF
#define REPRISE_ATTN_EXPF 0
#endif
// The shared page: 0, the default, a deep kernel's CTA runs its pages on the warps that
// hold its rows (at decode, one m16 tile: warp 0 alone, the others idle); 1, a CTA whose
// rows fit one m16 tile runs each page on all four warps (attend_page_coop, "The shared
// page" below). The same bits either way (tests/test_attention_tc_emulated.py); built
// for bench_gpu_kernels' `tc coop` rows and the engine through attention_tc_kernel.COOP.
#ifndef REPRISE_ATTN_COOP
#define REPRISE_ATTN_COOP 0
#endif
// Ablations, built for bench_gpu_kernels' timing rows alone (`tc notail`, `tc nomath`,
// through attention_tc_kernel.BUILD; nothing else builds them): WRONG OUTPUT, a measure
// of what a part of a launch costs by its absence. 0, the default: none. 1: a split CTA
// returns once its chunks' states are stored (no fence, count or merge, and no output
// written: the split's tail). 2: no page's math (the pages still come through the ring,
// the states stay fresh: the page step beside its loads).
#ifndef REPRISE_ATTN_ABLATE
#define REPRISE_ATTN_ABLATE 0
#endif

namespace {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * 32;
constexpr int kRowsPerWarp = 16;  // one m16 tile
constexpr int kRowsPerCta = kNumWarps * kRowsPerWarp;  // ROWS_PER_CTA in attention_tc_kernel.py
constexpr unsigned int kFullMask = 0xffffffffu;
// Keys of a KV chunk (KV_CHUNK in attention.py): the key range is cut at multiples of it.
// REPRISE_KV_CHUNK builds another chunk for a benchmark (bench_gpu_kernels' `tc chunk64`,
// `tc chunk128`: fewer pages a CTA walks in a row at short contexts, more chunks merged)
// and its emulated test, with the launch planned and the twin cut alike: other bits than
// the default's everywhere (DESIGN §4 holds within a build), so never one to serve beside
// KV_CHUNK's 256 until attention.py, attention.cu and this default change together.
#ifndef REPRISE_KV_CHUNK
#define REPRISE_KV_CHUNK 256
#endif
constexpr int kKvChunk = REPRISE_KV_CHUNK;
static_assert(kKvChunk % 64 == 0, "a KV chunk is whole pages of every block size (16, 32, 64)");
constexpr bool kBase2 = !REPRISE_ATTN_EXPF;
// the shared page is built on the default page step: the baselines' builds of the step
// before base 2 (REPRISE_ATTN_EXPF, REPRISE_ATTN_EXP_SELECT) keep one warp on a page
constexpr bool kCoop = REPRISE_ATTN_COOP && kBase2 && !REPRISE_ATTN_EXP_SELECT;
constexpr float kLog2e = 1.4426950408889634f;

// e^(x / log2(e)) for x in the softmax's units: 2^x (kBase2), else e^x.
__device__ __forceinline__ float softmax_exp(float x) { return kBase2 ? exp2_approx(x) : expf(x); }

// The soft cap (Gemma 2's; attention.py's softcap_scores) of a page's raw scores x (CAP
// in attend_page): y = cap * tanhf(fp32(x * scale) * r), r = 1 / cap, each product rounded:
// in natural units, then in the softmax's units as attend_page takes them (times log2(e)
// in base 2).
struct SoftCap {
  float scale;
  float cap;
  float r;
};
__device__ __forceinline__ float softcapped(float x, const SoftCap& c) {
  return __fmul_rn(c.cap, tanhf(__fmul_rn(__fmul_rn(x, c.scale), c.r)));
}

// The PTX wrappers, BF16 helpers, find_work and the chunk merge come from common.cuh.

// Pages in a ring (Ring's STAGES; num_stages in attention_tc_kernel.py repeats both).
// The normal ring holds at least 64 keys' worth, so small pages still overlap their loads
// with the mmas; the deep ring (the split launches': see "The deep ring" in the header)
// at least 128 keys and 3 pages.
constexpr int ring_stages(int block_size) { return block_size >= 32 ? 2 : 64 / block_size; }
constexpr int deep_ring_stages(int block_size) { return 128 / block_size > 3 ? 128 / block_size : 3; }

// A page's layout in shared memory and the fragments it is read into: what every ring
// depth shares.
template <int HEAD_DIM, int BLOCK_SIZE>
struct Config {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim must be 64, 128 or 256");
  static_assert(BLOCK_SIZE == 16 || BLOCK_SIZE == 32 || BLOCK_SIZE == 64,
                "block_size must be 16, 32 or 64");
  // Shared rows are head_dim + 8 halves: the eight 16-byte rows an ldmatrix phase
  // reads are an odd number of 16-byte units apart, in eight different bank groups.
  static constexpr int kLds = HEAD_DIM + 8;
  static constexpr int kPageHalves = BLOCK_SIZE * kLds;  // one K or V page
  static constexpr int kStageHalves = 2 * kPageHalves;   // K, then V
  static constexpr int kTotalFloats = HEAD_DIM / 2 + 4;  // a thread's merged state: acc (4 an n8 tile), m, denom
  static constexpr int kTilesPerChunk = kKvChunk / BLOCK_SIZE;
  static_assert(kKvChunk % BLOCK_SIZE == 0, "a KV chunk is whole pages");
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks of a row
  static constexpr int kDimSlices = HEAD_DIM / 16;  // k16 slices of Q.K^T
  static constexpr int kDimTiles = HEAD_DIM / 8;    // n8 tiles of acc
  static constexpr int kKeyTiles = BLOCK_SIZE / 8;  // n8 tiles of S
  static constexpr int kKeySlices = BLOCK_SIZE / 16;  // k16 slices of P.V
  static_assert((2 * BLOCK_SIZE * kChunks) % kNumThreads == 0, "every thread copies alike");
};

// The page ring of STAGES stages and the CTA's dynamic shared memory around it. A
// SPLIT_ONLY kernel (the deep ring's) runs split launches alone, which merge the chunks
// from the workspace: it has no area for a thread's merged state.
template <int HEAD_DIM, int BLOCK_SIZE, int STAGES, bool SPLIT_ONLY>
struct Ring : Config<HEAD_DIM, BLOCK_SIZE> {
  static_assert(STAGES >= 2, "a page in flight while one is read");
  static constexpr int kStages = STAGES;
  // the ring, then (one lane) the merged acc of every thread: smem_bytes() in the launcher
  using Page = Config<HEAD_DIM, BLOCK_SIZE>;
  static constexpr int kSmemBytes =
      kStages * Page::kStageHalves * 2 + (SPLIT_ONLY ? 0 : kNumThreads * Page::kTotalFloats * 4);
};

// Issue the cp.async copies of one page's K and V into a ring stage; key slots at or
// past `num_valid` (seq_len) are zero-filled, their (stale, maybe NaN) bytes unread.
// Thread x (`tid`) copies 16-byte chunk x % kChunks of keys x / kChunks + i * kKeyStep, of K and
// of V (`v_offset` elements after K): `dst` and `k_src` are the addresses of its first
// copy (key x / kChunks, columns from x % kChunks * 8), every other copy at a constant
// offset from them. (Found once by the kernel, not for every page: the block's page is
// one multiply-add from the thread's first copy in block 0.)
template <int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ void load_page(unsigned dst, const unsigned short* k_src, long long v_offset,
                                          int num_valid, int tid) {
  using C = Config<HEAD_DIM, BLOCK_SIZE>;
  constexpr int kKeyStep = kNumThreads / C::kChunks;  // keys a round of copies covers
  static_assert(kNumThreads % C::kChunks == 0 && BLOCK_SIZE % kKeyStep == 0, "whole rounds");
  const int key0 = tid / C::kChunks;
  // NOTE: an invalid slot's address is still in the page (a page holds BLOCK_SIZE
  // slots); cp.async with src-size 0 reads none of it.
  const unsigned short* v_src = k_src + v_offset;
#pragma unroll
  for (int i = 0; i < BLOCK_SIZE / kKeyStep; ++i) {
    const bool valid = key0 + i * kKeyStep < num_valid;
    cp_async_16(dst + i * kKeyStep * C::kLds * 2, k_src + i * kKeyStep * HEAD_DIM, valid);
    cp_async_16(dst + (C::kPageHalves + i * kKeyStep * C::kLds) * 2, v_src + i * kKeyStep * HEAD_DIM, valid);
  }
}

// The first key a query at `pos` (>= 0) sees: pos - window + 1 under a sliding window, at
// least key 0 (window 0: no window, key 0). It ascends with pos, as a CTA's rows do.
// NOTE: pos - min(pos, window - 1) in unsigned, where window 0's window - 1 is the
// largest value: no select tells window 0 apart (its predicate, held through the page
// loop, spilled). For pos -1 (a padding row, which sees nothing) it gives -window or 0.
__device__ __forceinline__ int window_start(int pos, int window) {
  return pos - static_cast<int>(min(static_cast<unsigned>(pos), static_cast<unsigned>(window) - 1u));
}

// A CTA's work item: its query rows, row r being query token0 + r / sub_group of the
// batch, at position first_pos + r / sub_group of its sequence, with query head
// head0 + r % sub_group; the KV chunks they see (from the one holding the first row's
// window_start: every chunk from there to the last row's is seen by some row); and,
// split, its (work item, head slot) counter.
struct CtaWork {
  long long token0;
  int first_pos;
  int num_rows;
  int sub_group;
  int head0;
  int num_chunks;
  int counter;
  // row r's token * num_heads + head: its q and out vectors, its workspace slots
  __device__ __forceinline__ long long row_at(int r, int num_heads) const {
    return (token0 + r / sub_group) * num_heads + head0 + r % sub_group;
  }
};

// Where a CTA of this kernel runs. Its own launch: blockIdx, gridDim, its threads and its
// dynamic shared memory. VIRTUAL (decode_block.cu's persistent launch): `half` of a CTA of
// 2 * kNumThreads threads, taking the planned grid's CTA (bx, by) of (gx, gy), with its own
// ring and state (`smem`: Ring::kSmemBytes) and work item (`work`), meeting at named
// barrier 1 + half instead of __syncthreads, waiting for no grid (its launch did).
struct VirtualCta {
  int bx, by, gx, gy, half;
  unsigned short* smem;
  CtaWork* work;
};

template <bool VIRTUAL>
__device__ __forceinline__ int cta_tid() {
  return VIRTUAL ? static_cast<int>(threadIdx.x) % kNumThreads : static_cast<int>(threadIdx.x);
}

template <bool VIRTUAL>
__device__ __forceinline__ void cta_sync(const VirtualCta& v) {
  if constexpr (VIRTUAL) {
    if (v.half) named_barrier_sync<2>(kNumThreads);
    else named_barrier_sync<1>(kNumThreads);
  } else {
    (void)v;
    __syncthreads();
  }
}

// The online softmax state of the two rows a thread holds in the fragments (g and
// g + 8 of its warp's m16 tile; the four threads of a quad hold the same m and denom).
template <int HEAD_DIM>
struct RowState {
  float m[2];
  float denom[2];
  float acc[HEAD_DIM / 8][4];  // n8 tiles of head_dim, in the mma's accumulator layout
};

// A chunk's fresh online softmax state (RowState, or a warp's CoopState): m = -inf,
// denom = 0, acc = 0.
template <class State>
__device__ __forceinline__ void fresh_state(State& st) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st.m[h] = negative_infinity();
    st.denom[h] = 0.0f;
  }
  constexpr int kTiles = sizeof(st.acc) / sizeof(st.acc[0]);
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st.acc[n][e] = 0.0f;
  }
}

// A thread's 2 * KEY_TILES values of row h (s[j][2h + e]) reduced by `op` as a balanced
// tree: pairs (j, e = 0, 1), then adjacent n8 tiles, ..., so a page's max and sum are
// log2 chains of dependent ops, not one chain through every key. The tree's shape is
// fixed by block_size (KEY_TILES = block_size / 8), so every path sums alike.
template <int KEY_TILES, class Op>
__device__ __forceinline__ float tile_tree(float (&v)[KEY_TILES], Op op) {
#pragma unroll
  for (int width = 1; width < KEY_TILES; width *= 2) {
#pragma unroll
    for (int j = 0; j + width < KEY_TILES; j += 2 * width) v[j] = op(v[j], v[j + width]);
  }
  return v[0];
}
template <int KEY_TILES, class Op>
__device__ __forceinline__ float row_reduce(const float (&s)[KEY_TILES][4], int h, Op op) {
  float v[KEY_TILES];
#pragma unroll
  for (int j = 0; j < KEY_TILES; ++j) v[j] = op(s[j][2 * h], s[j][2 * h + 1]);
  return tile_tree<KEY_TILES>(v, op);  // the pairs, then adjacent n8 tiles, ...
}

// acc = acc * a, then acc += P.V for PAIRS pairs of n8 tiles of head_dim from pair `pair0`
// (acc[2i], acc[2i + 1]: pair pair0 + i), from p in BF16 (`pa`, the A fragments of each
// 16-key slice) and the page's V (`v_tile`). acc * a is skipped by the warp when every a
// of its rows is 1 (a row whose max did not move, or that does not see the page), unless
// `always`: x * 1 is x exactly, so the skip reaches no bit. After the first pages of a
// chunk a row's max seldom moves, and each skip saves 4 multiplies a tile a thread.
template <int HEAD_DIM, int BLOCK_SIZE, int PAIRS>
__device__ __forceinline__ void scale_and_add_pv(float (&acc)[2 * PAIRS][4],
                                                 const unsigned (&pa)[BLOCK_SIZE / 16][4],
                                                 const unsigned short* v_tile, const float (&alpha)[2],
                                                 bool always, int pair0, int lane) {
  using C = Config<HEAD_DIM, BLOCK_SIZE>;
  if (always || __any_sync(kFullMask, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int n = 0; n < 2 * PAIRS; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = __fmul_rn(acc[n][e], alpha[e / 2]);
    }
  }
#pragma unroll
  for (int i2 = 0; i2 < PAIRS; ++i2) {  // two n8 tiles of head_dim at a time
    const int dp = pair0 + i2;
#pragma unroll
    for (int i = 0; i < C::kKeySlices; ++i) {
      // B fragment (col layout, B[key][d] = V[key][d], read transposed): matrices
      // (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15);
      // lane l points at key (l % 8) + ((l / 8) % 2) * 8, d (l / 16) * 8.
      const int key = i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const int dim = dp * 16 + (lane >> 4) * 8;
      unsigned b[4];
      ldmatrix_x4_trans(b, shared_addr(v_tile + key * C::kLds + dim));
      // NOTE: a row that does not see the page has p = +0 throughout: its acc takes
      // only exact zero terms, which leave a nonzero acc exactly as it was (see the
      // header), with no copy of the old acc kept alive for a select.
      mma_bf16_16816(acc[2 * i2], pa[i], b[0], b[1]);
      mma_bf16_16816(acc[2 * i2 + 1], pa[i], b[2], b[3]);
    }
  }
}

// One page for a warp's m16 tile of rows: S = Q.K^T, the softmax step, acc += P.V.
// `pos` are the positions of the thread's two rows (-1: a padding row, which sees
// nothing) and `lo` their first visible keys (window_start): row h sees keys lo[h] ..
// pos[h]; `stage` holds the page's K and V; `units` the factor from a score to the
// softmax's units: scale * log2(e) (kBase2), else scale. CAP: each score is soft-capped
// first (softcapped, `cap`: in natural units, every score of the page), and `units` is
// the factor from a capped score: log2(e) (kBase2; else unused). WHOLE: every real row of the
// warp sees every key of the page (the page ends at or before the warp's first row's
// position and starts at or after its last row's first visible key), so no score is
// masked: for those rows the masks would keep every score, the same values either way;
// the warp's padding rows (zero q) then take the page into a state no one reads (never
// stored, merged or written: their position is -1).
template <int HEAD_DIM, int BLOCK_SIZE, bool WHOLE, bool CAP = false>
__device__ __forceinline__ void attend_page(RowState<HEAD_DIM>& st,
                                            const unsigned (&qf)[HEAD_DIM / 16][4],
                                            const unsigned short* stage, const int (&pos)[2],
                                            const int (&lo)[2], int tile_start, float units, int lane,
                                            const SoftCap& cap = SoftCap{}) {
  using C = Config<HEAD_DIM, BLOCK_SIZE>;
  const unsigned short* k_tile = stage;
  const unsigned short* v_tile = stage + C::kPageHalves;
  const int quad_lane = lane % 4;

  // --- S = Q.K^T: s[j] is the n8 tile of keys 8j .. 8j + 7 ---
  float s[C::kKeyTiles][4];
#pragma unroll
  for (int j = 0; j < C::kKeyTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
  }
#pragma unroll
  for (int ds = 0; ds < C::kDimSlices; ++ds) {
    // B fragment (col layout, B[d][key] = K[key][d]): one x4 covers two n8 tiles of
    // keys: matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7),
    // (keys 8-15, d 8-15); lane l points at key (l % 8) + (l / 16) * 8, d ((l / 8) % 2) * 8.
#pragma unroll
    for (int kp = 0; kp < C::kKeyTiles / 2; ++kp) {
      const int key = kp * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int dim = ds * 16 + ((lane >> 3) & 1) * 8;
      unsigned b[4];
      ldmatrix_x4(b, shared_addr(k_tile + key * C::kLds + dim));
      mma_bf16_16816(s[2 * kp], qf[ds], b[0], b[1]);
      mma_bf16_16816(s[2 * kp + 1], qf[ds], b[2], b[3]);
    }
  }

  // --- the softmax step, per row h (fragment rows g, g + 8; s[j][2h + e] is key
  // 8j + 2 * quad_lane + e), in the softmax's units: scores times `units`, so that each
  // p is softmax_exp of a difference. Base 2 (kBase2): x stays the raw score, the tile
  // max is scaled once (rounding is monotonic: the max of the rounded products is the
  // rounded max), and p = exp2(fma(x, units, -m')), one FFMA and one MUFU.EX2 a key, as
  // FlashAttention does; natural units: x = s * scale rounded, p = expf(x - m'). ---
  float alpha[2];
  bool sees[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // keys begin .. end - 1 of the page are the row's (none where end <= begin): WHOLE,
    // every key of the page for each real row of the warp
    const int begin = WHOLE ? 0 : max(lo[h] - tile_start, 0);
    const int end = WHOLE ? BLOCK_SIZE : min(max(pos[h] - tile_start + 1, 0), BLOCK_SIZE);
    // NOTE: a masked key's score is replaced by -inf and its p by +0, by selects:
    // whatever S holds there never enters the row's state.
#pragma unroll
    for (int j = 0; j < C::kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = 8 * j + 2 * quad_lane + e;
        float& x = s[j][2 * h + e];
        if constexpr (CAP) x = softcapped(x, cap);  // in natural units, before the mask (a NaN's too)
        x = key >= begin && key < end ? (kBase2 || CAP ? x : __fmul_rn(x, units)) : negative_infinity();
      }
    }
    float tile_max = row_reduce<C::kKeyTiles>(s, h, [](float a, float b) { return fmaxf(a, b); });
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
    if (kBase2) tile_max = __fmul_rn(tile_max, units);
    // NOTE: a row that sees the page sees some key of it, so tile_max and m' are
    // finite. A row that sees none of it (in its future, or before its window) keeps m
    // and denom, and gets a = 1: even with m = -inf, before its window's first page.
    sees[h] = begin < end;
    const float m_new = sees[h] ? fmaxf(st.m[h], tile_max) : st.m[h];
    // a = 1 exactly where the max did not move (exp(0), which ex2.approx need not give
    // exactly; and no exp(-inf - -inf) = NaN for a row still at m = -inf), so that
    // acc * a can be skipped there (below); a row's first page it sees in a chunk gives
    // exp(-inf - m') = +0
    alpha[h] = m_new != st.m[h] ? softmax_exp(__fsub_rn(st.m[h], m_new)) : 1.0f;
    // NOTE: no select around the exponential: a masked key's x is -inf (above) and the
    // max it is taken from is finite (m_new for a row that sees the page; 0 for one that
    // sees none of it, whose every x is -inf), so its p is exp(-inf) = +0, the +0 a
    // select gave, and a seen key's p is the same exponential of the same difference. A
    // select there made the compiler branch around each expf (BSSY/BSYNC a key),
    // serializing the keys' exponentials, the longest chain of a page.
    const float m_sub = sees[h] ? m_new : 0.0f;
#pragma unroll
    for (int j = 0; j < C::kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[j][2 * h + e];
        const float d = kBase2 ? __fmaf_rn(x, units, -m_sub) : __fsub_rn(x, m_sub);
        if (REPRISE_ATTN_EXP_SELECT) {
          const int key = 8 * j + 2 * quad_lane + e;
          x = key >= begin && key < end ? softmax_exp(d) : 0.0f;
        } else {
          x = softmax_exp(d);
        }
      }
    }
    float p_sum = row_reduce<C::kKeyTiles>(s, h, [](float a, float b) { return __fadd_rn(a, b); });
    p_sum = __fadd_rn(p_sum, __shfl_xor_sync(kFullMask, p_sum, 1));
    p_sum = __fadd_rn(p_sum, __shfl_xor_sync(kFullMask, p_sum, 2));
    st.denom[h] = sees[h] ? __fadd_rn(__fmul_rn(st.denom[h], alpha[h]), p_sum) : st.denom[h];
    st.m[h] = m_new;
  }

  // --- P.V: bf16(p) as the A operand, from the S registers. Keys 16i .. 16i + 15 are
  // k slice i: A[g][2t, 2t+1] = s[2i][0, 1], A[g+8][2t, 2t+1] = s[2i][2, 3],
  // A[g][2t+8, 2t+9] = s[2i+1][0, 1], A[g+8][2t+8, 2t+9] = s[2i+1][2, 3] ---
  unsigned pa[C::kKeySlices][4];
#pragma unroll
  for (int i = 0; i < C::kKeySlices; ++i) {
    pa[i][0] = bf16_pair(s[2 * i][0], s[2 * i][1]);
    pa[i][1] = bf16_pair(s[2 * i][2], s[2 * i][3]);
    pa[i][2] = bf16_pair(s[2 * i + 1][0], s[2 * i + 1][1]);
    pa[i][3] = bf16_pair(s[2 * i + 1][2], s[2 * i + 1][3]);
  }
  scale_and_add_pv<HEAD_DIM, BLOCK_SIZE, C::kDimTiles / 2>(st.acc, pa, v_tile, alpha, REPRISE_ATTN_EXPF, 0, lane);
}

// What the warp's rows (positions `pos`, first visible keys `lo`: attend_page's) see of
// page t, by a vote of the warp (warp-uniform): whether some row sees a key of it (else
// the warp skips the page), and whether every real row sees it whole (attend_page's
// WHOLE: the page's first key at or after each row's first visible key, its last at or
// before each row's position; a padding row, at -1, aside). Voted a page rather than
// held: the bounds (the warp's last row's position and first key, its first row's) would
// take registers through the page loop, where there are none to spare.
template <int BLOCK_SIZE>
__device__ __forceinline__ bool warp_sees(const int (&pos)[2], const int (&lo)[2], int t) {
  bool some = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) some |= (pos[h] >= t * BLOCK_SIZE) & (lo[h] < (t + 1) * BLOCK_SIZE);
  return __any_sync(kFullMask, some);
}
template <int BLOCK_SIZE>
__device__ __forceinline__ bool warp_sees_whole(const int (&pos)[2], const int (&lo)[2], int t) {
  bool whole = true;
#pragma unroll
  for (int h = 0; h < 2; ++h)
    whole &= (pos[h] < 0) | ((lo[h] <= t * BLOCK_SIZE) & ((t + 1) * BLOCK_SIZE - 1 <= pos[h]));
  return !__any_sync(kFullMask, !whole);
}

// ---- The shared page (REPRISE_ATTN_COOP) -------------------------------------------------
// A decode's split launch gives each CTA one query token: its rows (the token's query heads
// of the CTA's head slot, sub_group <= 16 of them) fit one m16 tile, so in attend_page warp
// 0 runs every page alone, a chain of dependent steps, while the other three wait at the
// ring's barrier (2026-11-28's ncu: one active warp a CTA, 2 CTAs an SM, `wait` and
// `barrier` stalls at the top, about 2 us a page). Here all four warps hold the same rows
// (the same Q fragments, m and denom) and share each page:
//   - S: warp w scores key tile w (b16: tiles 0 and 1 on warps 0 and 1; b64: tiles 2w and
//     2w + 1), each n8 tile's accumulator the same mma per head_dim slice, ascending, from
//     +0, as attend_page's;
//   - the softmax step: each scoring warp's row maxima go through shared memory, and every
//     warp takes the maximum of them (exact in any order, as the tile max), then the same
//     m', a and m_sub from the same values; each warp's p of its keys, the same exponential
//     of the same difference; their pair sums (the leaves of row_reduce's tree) through
//     shared memory, and every warp sums the leaves by the same tree and quad butterfly;
//   - P.V: p in BF16 through shared memory (the pairs attend_page packs into pa), and warp
//     w keeps and updates the n8 tiles of head_dim w * kDimTiles / 4 ..: the same acc * a,
//     skipped by the same test (every warp sees the same a), and the same mma per 16-key
//     slice, ascending.
// So every value is computed by the same operations on the same operands as attend_page's,
// only by another warp: the same bits. Each page takes two more barriers (the maxima, then
// the sums and p); the exchange is written only after the ring's barrier that follows the
// previous page's last read of it.
template <int HEAD_DIM>
struct CoopState {  // a warp's share of the tile's online softmax state
  float m[2];
  float denom[2];
  float acc[HEAD_DIM / 32][4];  // n8 tiles warp * HEAD_DIM / 32 ... of head_dim
};

template <int BLOCK_SIZE>
struct CoopExchange {  // in shared memory, one a CTA
  float max[kNumWarps][kRowsPerWarp];  // a scoring warp's row maxima over its key tiles
  float sum[BLOCK_SIZE / 8][2][32];    // [key tile][row half][lane]: the pair sums of p
  unsigned p[BLOCK_SIZE / 8][2][32];   // [key tile][row half][lane]: p's pair in BF16
};

template <int HEAD_DIM, int BLOCK_SIZE, bool WHOLE, bool CAP = false>
__device__ __forceinline__ void attend_page_coop(CoopState<HEAD_DIM>& st,
                                                 const unsigned (&qf)[HEAD_DIM / 16][4],
                                                 const unsigned short* stage, const int (&pos)[2],
                                                 const int (&lo)[2], int tile_start, float units, int lane, int warp,
                                                 CoopExchange<BLOCK_SIZE>& x, const SoftCap& cap = SoftCap{}) {
  using C = Config<HEAD_DIM, BLOCK_SIZE>;
  constexpr int kMine = C::kKeyTiles > kNumWarps ? C::kKeyTiles / kNumWarps : 1;  // key tiles a warp scores
  constexpr int kScoring = C::kKeyTiles / kMine;                                  // warps that score
  constexpr int kMyDimTiles = C::kDimTiles / kNumWarps;                           // n8 tiles of acc a warp holds
  static_assert(kMine <= 2 && kMyDimTiles % 2 == 0, "an x4 ldmatrix covers a warp's key tiles; pairs of dim tiles");
  const unsigned short* k_tile = stage;
  const unsigned short* v_tile = stage + C::kPageHalves;
  const int quad_lane = lane % 4;
  const bool scoring = warp < kScoring;  // warp-uniform
  const int j0 = warp * kMine;           // the warp's first key tile

  // --- S for the warp's key tiles: s[jj] is the n8 tile of keys 8 (j0 + jj) .. ---
  float s[kMine][4];
#pragma unroll
  for (int jj = 0; jj < kMine; ++jj) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[jj][e] = 0.0f;
  }
  if (scoring) {
#pragma unroll
    for (int ds = 0; ds < C::kDimSlices; ++ds) {
      // attend_page's x4 of the pair of key tiles j0 / 2 covers: b[0], b[1] its first
      // tile, b[2], b[3] its second
      const int key = (j0 / 2) * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int dim = ds * 16 + ((lane >> 3) & 1) * 8;
      unsigned b[4];
      ldmatrix_x4(b, shared_addr(k_tile + key * C::kLds + dim));
      if constexpr (kMine == 2) {
        mma_bf16_16816(s[0], qf[ds], b[0], b[1]);
        mma_bf16_16816(s[1], qf[ds], b[2], b[3]);
      } else {
        const bool second = j0 % 2 != 0;
        mma_bf16_16816(s[0], qf[ds], second ? b[2] : b[0], second ? b[3] : b[1]);
      }
    }
  }

  // --- the softmax step: the row maxima through shared memory ---
  bool sees[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int begin = WHOLE ? 0 : max(lo[h] - tile_start, 0);  // the row's keys: attend_page's
    const int end = WHOLE ? BLOCK_SIZE : min(max(pos[h] - tile_start + 1, 0), BLOCK_SIZE);
    sees[h] = begin < end;
#pragma unroll
    for (int jj = 0; jj < kMine; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = 8 * (j0 + jj) + 2 * quad_lane + e;
        float& v = s[jj][2 * h + e];
        if constexpr (CAP) v = softcapped(v, cap);  // attend_page's cap
        v = key >= begin && key < end ? v : negative_infinity();
      }
    }
    // the warp's key tiles' maximum, as row_reduce takes it (exact in any order)
    float part = fmaxf(s[0][2 * h], s[0][2 * h + 1]);
    if constexpr (kMine == 2) part = fmaxf(part, fmaxf(s[1][2 * h], s[1][2 * h + 1]));
    part = fmaxf(part, __shfl_xor_sync(kFullMask, part, 1));
    part = fmaxf(part, __shfl_xor_sync(kFullMask, part, 2));
    if (scoring && quad_lane == 0) x.max[warp][lane / 4 + 8 * h] = part;
  }
  __syncthreads();  // every scoring warp's maxima are in

  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = x.max[0][lane / 4 + 8 * h];
#pragma unroll
    for (int w = 1; w < kScoring; ++w) tile_max = fmaxf(tile_max, x.max[w][lane / 4 + 8 * h]);
    tile_max = __fmul_rn(tile_max, units);
    const float m_new = sees[h] ? fmaxf(st.m[h], tile_max) : st.m[h];
    alpha[h] = m_new != st.m[h] ? softmax_exp(__fsub_rn(st.m[h], m_new)) : 1.0f;
    const float m_sub = sees[h] ? m_new : 0.0f;
#pragma unroll
    for (int jj = 0; jj < kMine; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) s[jj][2 * h + e] = softmax_exp(__fmaf_rn(s[jj][2 * h + e], units, -m_sub));
      if (scoring) {
        x.sum[j0 + jj][h][lane] = __fadd_rn(s[jj][2 * h], s[jj][2 * h + 1]);
        x.p[j0 + jj][h][lane] = bf16_pair(s[jj][2 * h], s[jj][2 * h + 1]);
      }
    }
    st.m[h] = m_new;
  }
  __syncthreads();  // every key tile's pair sums and p are in

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v[C::kKeyTiles];
#pragma unroll
    for (int j = 0; j < C::kKeyTiles; ++j) v[j] = x.sum[j][h][lane];
    float p_sum = tile_tree<C::kKeyTiles>(v, [](float a, float b) { return __fadd_rn(a, b); });
    p_sum = __fadd_rn(p_sum, __shfl_xor_sync(kFullMask, p_sum, 1));
    p_sum = __fadd_rn(p_sum, __shfl_xor_sync(kFullMask, p_sum, 2));
    st.denom[h] = sees[h] ? __fadd_rn(__fmul_rn(st.denom[h], alpha[h]), p_sum) : st.denom[h];
  }

  // --- P.V on the warp's n8 tiles of head_dim ---
  unsigned pa[C::kKeySlices][4];
#pragma unroll
  for (int i = 0; i < C::kKeySlices; ++i) {
    pa[i][0] = x.p[2 * i][0][lane];
    pa[i][1] = x.p[2 * i][1][lane];
    pa[i][2] = x.p[2 * i + 1][0][lane];
    pa[i][3] = x.p[2 * i + 1][1][lane];
  }
  scale_and_add_pv<HEAD_DIM, BLOCK_SIZE, kMyDimTiles / 2>(st.acc, pa, v_tile, alpha, false,
                                                        warp * (kMyDimTiles / 2), lane);
}

// The split's last step for the CTA's rows: common.cuh's merge_chunks, whose rows' chunks
// run from chunk 0 of their workspace slots to their position's, with a sliding window
// (window_start) whose chunks run from the one holding the row's first visible key. Each
// run of rows sharing that first chunk c (rows ascend, and so do their first keys) goes to
// merge_chunks with the workspace seen from chunk c on and positions counted from c's
// first key: the same states merged in the same order, chunk c taken as it is. (A CTA's
// rows span fewer positions than a chunk holds, so at most two runs; one without a
// window.) `first`, `stride`: merge_chunks'.
template <int HEAD_DIM>
__device__ __forceinline__ void merge_window_chunks(unsigned short* __restrict__ out, const float* __restrict__ ws_acc,
                                                    const float* __restrict__ ws_ml, const CtaWork& cta,
                                                    int num_heads, int max_chunks, int window, int first,
                                                    int stride) {
  const int num_tokens = cta.num_rows / cta.sub_group;
  for (int t0 = 0; t0 < num_tokens;) {
    const int c = window_start(max(cta.first_pos + t0, 0), window) / kKvChunk;
    // the run: tokens whose first visible key is before chunk c + 1's first
    const long long past = static_cast<long long>(c + 1) * kKvChunk + window - 1 - cta.first_pos;
    const int t1 = window > 0 ? static_cast<int>(min(past, static_cast<long long>(num_tokens))) : num_tokens;
    merge_chunks<HEAD_DIM, kKvChunk, kBase2>(out, ws_acc + c * HEAD_DIM, ws_ml + 2 * c, (t1 - t0) * cta.sub_group,
                                             cta.sub_group, cta.token0 + t0, cta.first_pos + t0 - c * kKvChunk,
                                             num_heads, cta.head0, max_chunks, /*zero_sign=*/true, first, stride);
    t0 = t1;
  }
}

template <int HEAD_DIM, int BLOCK_SIZE, int STAGES, bool SPLIT_ONLY, bool VIRTUAL = false>
__device__ __forceinline__ void paged_attention_tc(
    unsigned short* __restrict__ out,            // [T, num_heads, head_dim] BF16
    const unsigned short* __restrict__ q,        // [T, num_heads, head_dim] BF16
    const unsigned short* __restrict__ cache,    // [blocks, layers, 2, kv_heads, block_size, head_dim]
    const int* __restrict__ block_tables,        // [B, max_blocks]
    const int* __restrict__ seq_lens,            // [B]
    const int* __restrict__ query_start_loc,     // [B + 1]
    float* __restrict__ workspace,               // split: [T, heads, chunks, head_dim] + [T, heads, chunks, 2]
    unsigned* __restrict__ counters,             // split: one zero per (work item, head slot)
    int num_tokens, int num_seqs, int max_blocks, int num_heads, int num_kv_heads,
    int num_layers, int layer, int head_parts, int kv_lanes, float scale,
    int window,                                  // sliding window (window_start); 0: none
    float softcap,                               // the scores' soft cap (softcapped); 0: none
    const VirtualCta& v = VirtualCta{}) {  // VIRTUAL: decode_block.cu passes no cap (its AttnArgs)
  using C = Ring<HEAD_DIM, BLOCK_SIZE, STAGES, SPLIT_ONLY>;
  // [kStages][K, V page], then the merged acc of each thread (kTotalFloats a thread)
  extern __shared__ __align__(16) unsigned short attention_tc_smem[];
  // NOTE: the launcher mirrors kNumThreads and kSmemBytes; a mismatch must fail
  // loudly, not read past the shared buffer (VIRTUAL: the persistent launch checks its own).
  // A SPLIT_ONLY launch on one lane is the launcher's mistake (its plan would take the
  // one-lane kernel); VIRTUAL (decode_block.cu) runs one-lane plans through the workspace
  // too: each chunk's state stored, then merged by the lone lane, the same bits.
  if ((!VIRTUAL && (blockDim.x != kNumThreads || dynamic_smem_bytes() < static_cast<unsigned>(C::kSmemBytes))) ||
      (SPLIT_ONLY && !VIRTUAL && kv_lanes < 2))
    __trap();
  unsigned short* const ring = VIRTUAL ? v.smem : attention_tc_smem;
  float* acc_total = reinterpret_cast<float*>(ring + C::kStages * C::kStageHalves);
  const int tid = cta_tid<VIRTUAL>();
  const int bx = VIRTUAL ? v.bx : static_cast<int>(blockIdx.x), by = VIRTUAL ? v.by : static_cast<int>(blockIdx.y);
  const int gx = VIRTUAL ? v.gx : static_cast<int>(gridDim.x), gy = VIRTUAL ? v.gy : static_cast<int>(gridDim.y);

  const int warp = tid / 32, lane = tid % 32;
  // by = (kv_head * head_parts + part) * kv_lanes + kv_lane (split_grid)
  const int kv_lane = by % kv_lanes;
  const int head_slot = by / kv_lanes;
  const int kv_head = head_slot / head_parts;
  const int group = num_heads / num_kv_heads;
  const int sub_group = group / head_parts;  // the CTA's query heads of its KV head
  const int head0 = kv_head * group + (head_slot % head_parts) * sub_group;
  const int tokens_per_cta = kRowsPerCta / sub_group;

  // NOTE: work items are taken in reverse, so the CTAs of a sequence's last query tiles
  // (the longest key ranges, under the causal mask) start first and the short ones
  // fill the tail. Which CTA runs a tile never reaches its rows' bits.
  const int work = VIRTUAL ? gx - 1 - bx : static_cast<int>(gridDim.x - 1 - blockIdx.x);
  int seq = 0, q_tile = 0;
  // NOTE: every return before this grid's wait (pdl_enter, below) waits first, so every
  // thread of every CTA takes the wait, as the emulator checks of a dependent launch.
  if (!find_work(query_start_loc, num_seqs, tokens_per_cta, work, lane, seq, q_tile)) {
    if constexpr (!VIRTUAL) pdl_enter();
    return;  // the whole CTA: every warp found the same
  }
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int seq_len = seq_lens[seq];
  const int tok0 = q_tile * tokens_per_cta;  // the CTA's first query within the sequence
  // rows past T (an inconsistent query_start_loc) are neither read nor written
  const int num_cta_tokens =
      max(0, min(min(tokens_per_cta, q_len - tok0), num_tokens - (q_start + tok0)));
  const int num_rows = num_cta_tokens * sub_group;
  if (num_rows == 0) {
    if constexpr (!VIRTUAL) pdl_enter();
    return;
  }
  // NOTE: a sequence's q_len queries are its last q_len positions: query i sits at
  // seq_len - q_len + i and sees keys window_start(that position) .. that position.
  const int first_pos = seq_len - q_len + tok0;
  const int last_pos = first_pos + num_cta_tokens - 1;
  const int num_tiles = last_pos >= 0 ? min(last_pos / BLOCK_SIZE + 1, max_blocks) : 0;
  constexpr int kTpc = C::kTilesPerChunk;
  const int num_chunks = (num_tiles + kTpc - 1) / kTpc;
  // The CTA's chunks: from the one holding its first row's first visible key (the chunks
  // before it are wholly before every row's window) to its last row's last.
  const int first_key = window_start(max(first_pos, 0), window);
  const int first_chunk = first_key / kKvChunk;
  const int lane_chunk = first_chunk + kv_lane;  // the lane's first
  const bool split = SPLIT_ONLY || kv_lanes > 1;  // a SPLIT_ONLY kernel has no one-lane code
  if (split && lane_chunk >= num_chunks) {  // a lane past the CTA's last chunk: not counted
    if constexpr (!VIRTUAL) pdl_enter();
    return;
  }
  // The pages this CTA runs, in order: those of its chunks lane_chunk, lane_chunk +
  // kv_lanes, ... (page k is page k % kTpc of the lane's chunk k / kTpc; only the last
  // chunk is short), from k0: the first chunk's pages before its first row's first visible
  // key are seen by no row, and skipped.
  const int lane_chunks = num_chunks > lane_chunk ? (num_chunks - 1 - lane_chunk) / kv_lanes + 1 : 0;
  const int last_chunk = lane_chunk + (lane_chunks - 1) * kv_lanes;
  const int num_pages = lane_chunks > 0 ? (lane_chunks - 1) * kTpc + num_tiles - last_chunk * kTpc : 0;
  const int k0 = kv_lane == 0 ? first_key / BLOCK_SIZE - first_chunk * kTpc : 0;
  auto page_of = [&](int k) { return (lane_chunk + (k / kTpc) * kv_lanes) * kTpc + k % kTpc; };

  // The CTA's work item, for the steps that need it now and then (a chunk's end, the
  // output, the split's merge), from shared memory: what stays in registers through the
  // page loop is what every page uses (see "Resources" in the header).
  const CtaWork rows{static_cast<long long>(q_start) + tok0, first_pos, num_rows, sub_group, head0,
                     num_chunks - first_chunk,
                     work * (VIRTUAL ? gy / kv_lanes : static_cast<int>(gridDim.y / kv_lanes)) + head_slot};
  // NOTE: `static` changes nothing on the device (block-scope __shared__ is static); the
  // CPU emulator reads this file with __shared__ defined away, and there it makes cta
  // one object for all the CTA's threads, as on the device.
  CtaWork* cta_at;
  if constexpr (VIRTUAL) {
    cta_at = v.work;
  } else {
    static __shared__ CtaWork cta_shared;
    cta_at = &cta_shared;
  }
  CtaWork& cta = *cta_at;
  if (tid == 0) cta = rows;
  cta_sync<VIRTUAL>(v);  // cta is written before any thread reads it

  // The thread's fragment rows g and g + 8 of the warp's tile: their position (-1 for
  // padding, which sees nothing) and first visible key.
  // The shared page (kCoop): a deep kernel's CTA whose rows fit one m16 tile runs each page
  // on all four warps, every warp holding that tile's rows (CTA-uniform).
  const bool coop = kCoop && !VIRTUAL && SPLIT_ONLY && num_rows <= kRowsPerWarp;
  const int tile_warp = coop ? 0 : warp;  // the m16 tile of rows the warp holds
  const int row0 = tile_warp * kRowsPerWarp + lane / 4;
  int pos[2], lo[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + 8 * h;
    pos[h] = r < num_rows ? first_pos + r / sub_group : -1;
    lo[h] = window_start(pos[h], window);
  }

  // The ring: before page k is consumed, pages up to k + kStages - 2 are in flight.
  // One commit per page slot (empty past the end) keeps the group count uniform: at page
  // k, kStages - 1 + k - k0 groups are committed, group j holding page k0 + j, so waiting
  // for all but the kStages - 2 newest lands page k. Page k's stage is next written by page
  // k + kStages, issued after page k + 1's barrier, which every warp reaches only when
  // done with page k. Both hold for any depth; chunks only rename pages (page_of).
  const long long head_stride = static_cast<long long>(BLOCK_SIZE) * HEAD_DIM;  // one KV head of one page
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks;
  // the thread's first copy of a page (load_page): in the ring's first stage, and in
  // block 0's page of the layer's KV head; a block's pages are block_stride elements apart
  const int copy_key = tid / C::kChunks;
  const int copy_col = tid % C::kChunks * 8;
  const unsigned dst0 = shared_addr(ring + copy_key * C::kLds + copy_col);
  const long long head_page = (static_cast<long long>(layer) * 2 * num_kv_heads + kv_head) * head_stride;
  const unsigned short* src0 = cache + head_page + copy_key * HEAD_DIM + copy_col;
  const long long block_stride = static_cast<long long>(num_layers) * 2 * num_kv_heads * head_stride;
  // page k's copies, from its cache block `block` (table[page_of(k)])
  auto issue = [&](int k, long long block) {
    load_page<HEAD_DIM, BLOCK_SIZE>(dst0 + (k % C::kStages) * C::kStageHalves * 2, src0 + block * block_stride,
                                    num_kv_heads * head_stride, seq_len - page_of(k) * BLOCK_SIZE, tid);
  };
  // Before the wait: the ring's first pages that lie wholly before the sequence's first
  // query position (see "Before the wait" in the header), in their own commit groups, as
  // the rest of the prologue's after it. They, the metadata read above and the block
  // table are what this grid reads while the one before it finishes.
  const int first_query_pos = seq_len - q_len;
  int early = k0;
  for (; early < k0 + C::kStages - 1; ++early) {
    if (early >= num_pages || (page_of(early) + 1) * BLOCK_SIZE > first_query_pos) break;
    issue(early, table[page_of(early)]);
    cp_async_commit();
  }
  if constexpr (!VIRTUAL) pdl_enter();

  // Q as A fragments of each 16-wide head_dim slice (layout: see mma_bf16_16816), from
  // global memory once; padding rows are zero.
  unsigned qf[C::kDimSlices][4];
  const int col = 2 * (lane % 4);
#pragma unroll
  for (int ds = 0; ds < C::kDimSlices; ++ds) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e % 2, c = ds * 16 + col + (e / 2) * 8;
      const long long at = rows.row_at(row0 + 8 * h, num_heads) * HEAD_DIM + c;
      const unsigned* word = reinterpret_cast<const unsigned*>(q + at);
      // VIRTUAL: decode_layers' launch wrote the queries of a layer after its first
      qf[ds][e] = pos[h] >= 0 ? (VIRTUAL ? __ldcg(word) : __ldg(word)) : 0u;
    }
  }

  // The merged state over the chunks done so far (one lane), in shared memory,
  // thread-private (registers are spoken for): total(i) is element i of the thread's
  // [kDimTiles][4] acc fragment, then m of its rows g, g + 8, then their denom.
  auto total = [&](int i) -> float& { return acc_total[i * kNumThreads + tid]; };
  constexpr int kM = C::kTotalFloats - 4, kDenom = C::kTotalFloats - 2;
  // the workspace: [T, heads, max_chunks, head_dim] acc, then [T, heads, max_chunks, 2] m, denom
  const int max_chunks = (max_blocks * BLOCK_SIZE + kKvChunk - 1) / kKvChunk;
  auto ws_ml = [&]() { return workspace + static_cast<long long>(num_tokens) * num_heads * max_chunks * HEAD_DIM; };
  RowState<HEAD_DIM> st;
  const float units = kBase2 ? __fmul_rn(scale, kLog2e) : scale;  // attend_page's

  // the rest of the ring's first pages (at or past the first query position), after it
  for (int k = early; k < k0 + C::kStages - 1; ++k) {
    if (k < num_pages) issue(k, table[page_of(k)]);
    cp_async_commit();
  }
  // The deep ring's kernels (few CTAs an SM, little to hide latency with) read the block
  // of the next page to issue a page ahead, so that the load's latency passes during a
  // page's mmas rather than before the copies that need it. (The normal ring's would
  // spill: d128_b32 on sm_90 at its 168 registers.)
  int next_block = SPLIT_ONLY && k0 + C::kStages - 1 < num_pages ? table[page_of(k0 + C::kStages - 1)] : 0;
  if constexpr (kCoop && SPLIT_ONLY && !VIRTUAL) {
    // The shared page: the loop below with attend_page_coop for attend_page and each warp's
    // share of the state. (Split only: a chunk's end stores the state for the last lane.)
    static __shared__ CoopExchange<BLOCK_SIZE> xchg;  // `static`: as cta's
    constexpr int kMyDimTiles = C::kDimTiles / kNumWarps;
    CoopState<HEAD_DIM> cs;
    fresh_state(cs);  // the first chunk's, which may start at page k0
    for (int k = k0; coop && k < num_pages; ++k) {
      const int t = page_of(k);
      const int c = t / kTpc;
      if (k % kTpc == 0) {  // the chunk's first page: a fresh state
        __syncwarp();
        fresh_state(cs);
      }
      cp_async_wait<C::kStages - 2>();
      __syncthreads();  // page k landed; every warp is done with page k - 1 and the exchange
      const int next = k + C::kStages - 1;
      if (next < num_pages) issue(next, next_block);
      cp_async_commit();
      if (next + 1 < num_pages) next_block = table[page_of(next + 1)];
      if (warp_sees<BLOCK_SIZE>(pos, lo, t)) {  // CTA-uniform here: every warp holds the same rows
        const unsigned short* stage = attention_tc_smem + (k % C::kStages) * C::kStageHalves;
        if (softcap > 0.0f) {  // the grid's branch: a soft cap
          const SoftCap cap{scale, softcap, 1.0f / softcap};
          attend_page_coop<HEAD_DIM, BLOCK_SIZE, false, true>(cs, qf, stage, pos, lo, t * BLOCK_SIZE, kLog2e, lane,
                                                              warp, xchg, cap);
        } else if (warp_sees_whole<BLOCK_SIZE>(pos, lo, t)) {
          attend_page_coop<HEAD_DIM, BLOCK_SIZE, true>(cs, qf, stage, pos, lo, t * BLOCK_SIZE, units, lane, warp,
                                                       xchg);
        } else {
          attend_page_coop<HEAD_DIM, BLOCK_SIZE, false>(cs, qf, stage, pos, lo, t * BLOCK_SIZE, units, lane, warp,
                                                        xchg);
        }
      }
      if (k % kTpc != kTpc - 1 && k + 1 < num_pages) continue;
      // the chunk's end: its state to the workspace, for the last lane (m and denom from
      // warp 0, each warp its n8 tiles of acc)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // a row that sees no key of the chunk (in its future, padding: -1; or before its window)
        if (pos[h] < c * kKvChunk || lo[h] >= (c + 1) * kKvChunk) continue;
        const long long slot = cta.row_at(row0 + 8 * h, num_heads) * max_chunks + c;
        if (warp == 0 && lane % 4 == 0) {
          ws_ml()[slot * 2] = cs.m[h];
          ws_ml()[slot * 2 + 1] = cs.denom[h];
        }
#pragma unroll
        for (int n = 0; n < kMyDimTiles; ++n) {
          *reinterpret_cast<float2*>(workspace + slot * HEAD_DIM + 8 * (warp * kMyDimTiles + n) + col) =
              make_float2(cs.acc[n][2 * h], cs.acc[n][2 * h + 1]);
        }
      }
    }
  }
  fresh_state(st);  // the first chunk's, which may start at page k0
  for (int k = k0; !coop && k < num_pages; ++k) {
    const int t = page_of(k);
    const int c = t / kTpc;
    if (k % kTpc == 0) {  // the chunk's first page: a fresh state
      // NOTE: the __syncwarp (every lane is here: k is the CTA's) keeps this a branch.
      // Without it ptxas predicated the reset, 66 selects on every page, the chunk's
      // first or not; moved to a chunk's end instead, or into attend_page, it spilled.
      __syncwarp();
      fresh_state(st);
    }
    cp_async_wait<C::kStages - 2>();  // this thread's copies of page k have landed
    // Every thread's copies of page k are visible, and every warp has finished
    // reading page k - 1, whose buffer the next copy overwrites.
    cta_sync<VIRTUAL>(v);
    const int next = k + C::kStages - 1;
    if (next < num_pages) issue(next, SPLIT_ONLY ? next_block : table[page_of(next)]);
    cp_async_commit();
    if (SPLIT_ONLY && next + 1 < num_pages) next_block = table[page_of(next + 1)];
    // a page none of the warp's rows sees is skipped (and every page in the ablation 2 build)
    if (REPRISE_ATTN_ABLATE != 2 && warp_sees<BLOCK_SIZE>(pos, lo, t)) {
      const unsigned short* stage = ring + (k % C::kStages) * C::kStageHalves;
      if (softcap > 0.0f) {  // the grid's branch: a soft cap
        const SoftCap cap{scale, softcap, 1.0f / softcap};
        attend_page<HEAD_DIM, BLOCK_SIZE, false, true>(st, qf, stage, pos, lo, t * BLOCK_SIZE,
                                                       kBase2 ? kLog2e : 1.0f, lane, cap);
      } else if (!REPRISE_ATTN_EXPF && warp_sees_whole<BLOCK_SIZE>(pos, lo, t)) {
        attend_page<HEAD_DIM, BLOCK_SIZE, true>(st, qf, stage, pos, lo, t * BLOCK_SIZE, units, lane);
      } else {
        attend_page<HEAD_DIM, BLOCK_SIZE, false>(st, qf, stage, pos, lo, t * BLOCK_SIZE, units, lane);
      }
    }
    if (k % kTpc != kTpc - 1 && k + 1 < num_pages) continue;
    // --- the chunk's end: merge its state into the total, or store it for the last
    // lane. Rows before the chunk's first key (and padding) and rows whose window starts
    // past its last key do not see it; the chunk holding a row's first visible key is the
    // row's first. ---
    bool sees[2], first[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sees[h] = pos[h] >= c * kKvChunk && lo[h] < (c + 1) * kKvChunk;  // padding (-1) sees none
      first[h] = lo[h] >= c * kKvChunk;
    }
    if (split) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!sees[h]) continue;
        const long long slot = cta.row_at(row0 + 8 * h, num_heads) * max_chunks + c;
        if (lane % 4 == 0) {
          ws_ml()[slot * 2] = st.m[h];
          ws_ml()[slot * 2 + 1] = st.denom[h];
        }
#pragma unroll
        for (int n = 0; n < C::kDimTiles; ++n) {
          *reinterpret_cast<float2*>(workspace + slot * HEAD_DIM + 8 * n + col) =
              make_float2(st.acc[n][2 * h], st.acc[n][2 * h + 1]);
        }
      }
      continue;
    }
    if constexpr (!SPLIT_ONLY) {  // one lane: merged into the total in shared memory
      float a1[2], a2[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        a1[h] = 0.0f;
        a2[h] = 1.0f;
        if (!sees[h]) continue;
        if (first[h]) {  // the row's first chunk: taken as it is
          total(kM + h) = st.m[h];
          total(kDenom + h) = st.denom[h];
        } else {
          total(kM + h) = merge_factors<kBase2>(total(kM + h), st.m[h], a1[h], a2[h]);
          total(kDenom + h) = merged(total(kDenom + h), a1[h], st.denom[h], a2[h]);
        }
      }
#pragma unroll
      for (int n = 0; n < C::kDimTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2;
          // a select, not a branch an element: a row that does not see the chunk (padding)
          // keeps its total as it was
          float& x = total(n * 4 + e);
          const float next = first[h] ? st.acc[n][e] : merged(x, a1[h], st.acc[n][e], a2[h]);
          x = sees[h] ? next : x;
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups remain; leave none behind

  if (split) {
    if (REPRISE_ATTN_ABLATE == 1) return;  // the tail's ablation: states stored, nothing merged
    // --- the last lane of the (work item, head slot) to finish merges every chunk ---
    // NOTE: gemm.cu's last-block handoff: every thread's stores, __threadfence, one
    // atomicAdd per CTA; the CTA that counts last fences again and reads through L2.
    const int active = min(kv_lanes, cta.num_chunks);
    unsigned* counter = counters + cta.counter;
    unsigned* last = reinterpret_cast<unsigned*>(ring);  // the ring is drained: reuse it
    __threadfence();
    cta_sync<VIRTUAL>(v);  // every thread's stores are fenced; and no warp still reads the ring
    if (tid == 0) *last = atomicAdd(counter, 1u) == static_cast<unsigned>(active - 1) ? 1u : 0u;
    cta_sync<VIRTUAL>(v);
    if (*last == 0u) return;
    __threadfence();
    // VIRTUAL: the half's threads
    merge_window_chunks<HEAD_DIM>(out, workspace, ws_ml(), cta, num_heads, max_chunks, window, VIRTUAL ? tid : -1,
                                  VIRTUAL ? kNumThreads : 0);
    if (tid == 0) *counter = 0u;  // the next launch, after this one in stream order, sees 0
    return;
  }

  if constexpr (!SPLIT_ONLY) {  // a SPLIT_ONLY kernel has returned above
    // --- out = bf16(acc / denom); thread holds columns 8n + 2 * (lane % 4), +1 ---
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (pos[h] < 0) continue;  // padding
      unsigned short* dst = out + cta.row_at(row0 + 8 * h, num_heads) * HEAD_DIM;
#pragma unroll
      for (int n = 0; n < C::kDimTiles; ++n) {
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // NOTE: -0 -> +0: the sign of an exactly zero acc is the one thing a masked
          // key's zero P.V term could reach (see the header).
          const float a = total(n * 4 + 2 * h + e);
          v[e] = __fdiv_rn(a == 0.0f ? 0.0f : a, total(kDenom + h));
        }
        *reinterpret_cast<unsigned*>(dst + 8 * n + col) = bf16_pair(v[0], v[1]);
      }
    }
  }
}

}  // namespace
