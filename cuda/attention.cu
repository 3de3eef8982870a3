// Paged attention, one kernel for prefill and decode queries (twin: attention.py,
// paged_attention_ref; launcher: attention_kernel.py).
//
// Work: one CTA per (query tile, head slot, KV lane); grid = attention_kernel.split_grid's
// (work items, num_kv_heads * head_parts * kv_lanes). A head slot is a KV head and a part
// of its query-head group: group / head_parts consecutive query heads (the whole group
// when head_parts = 1). A query tile is up to tokens_per_cta = kRowsPerCta / (group /
// head_parts) consecutive queries of one sequence; its rows are the (query token, query
// head of the slot) pairs, row r = token * (group / head_parts) + member, so every K/V
// page is read once for all the slot's heads. CTAs are numbered through the sequences in
// order, ceil(q_len / tokens_per_cta) per sequence; each CTA finds its (sequence, tile) by
// a prefix sum over query_start_loc (find_work), so the host plans the grid from T, B and
// the block table's width alone and nothing is read back to the host.
//
// Sliding window (`window`, the twin's): the query at position p sees keys lo..p, lo =
// window_start(p) = max(p - window + 1, 0); window 0: lo = 0. lo ascends with p, so a
// CTA's first row sees the earliest key any of its rows sees.
//
// Soft cap (`softcap`, the twin's; Gemma 2): c > 0 caps each scaled score before the mask,
// s = c * tanhf(s * r) with r = 1 / c (one IEEE division a CTA, kept in shared memory),
// every product rounded (softcapped). A branch on r > 0, the same for the whole grid: c = 0
// runs no arithmetic more. (The branch tests r read from shared memory, not c: a test of
// the argument, hoisted out of the page loop, held a predicate through it, and d64_b64
// spilled on sm_90.)
//
// KV chunks: the key range is cut at the absolute positions c * kKvChunk (256 keys,
// whole pages). A CTA's chunks are those from c0, the chunk holding its first row's lo,
// to its last row's position (the chunks before c0 are seen by none of its rows); it
// takes c = c0 + kv_lane, c0 + kv_lane + kv_lanes, ... of them and runs each from a fresh
// state (m = -inf, denom = 0, acc = 0) over the chunk's pages, in ascending order, as
// below. Then:
//   - one lane (kv_lanes = 1: prefills, large batches): the CTA merges each chunk's
//     state into its rows' totals in registers, in ascending chunk order (a row's first
//     chunk, the one holding its lo, taken as it is; merge_factors / merged), and writes
//     out = bf16(acc / denom);
//   - several lanes (small decode batches): each chunk's state goes to the fp32
//     workspace, the CTA counts itself in its (work item, head slot) counter (an integer
//     atomic; the lanes counted are those with a chunk, min(kv_lanes, chunks from c0)),
//     and the lane that counts last merges every row's chunk states from the workspace
//     in ascending order from the row's first, with the same formula (merge_chunks), and
//     writes out.
//
// CTA: 4 warps. Row r belongs to warp r % 4, as its slot r / 4 (8 slots a warp).
// For each page t of a chunk in ascending order, from the first page its first row sees
// to the last page its last row sees:
//   1. the page's K and V ([block_size, head_dim] each) are copied to shared memory
//      (head_dim 256: in parts of 128 dims, one part at a time in one buffer, K's two
//      before the scores and V's two before P.V, so that a 64-key page fits under
//      48 KB of static shared memory);
//   2. scores: the lanes of a warp own keys (lane % min(block_size, 32), and +32
//      when block_size = 64); with block_size 16 the two half-warps take two slots
//      at once. score(row, key) = one sequential fp32 FMA chain over d = 0..head_dim-1
//      in a single thread (across K's parts: the chain stays in that thread's
//      registers), times scale; with a soft cap c > 0 (`softcap`, the twin's), then
//      capped: c * tanhf(s * r), r = 1 / c (softcapped, the twin's softcap_scores);
//   3. softmax step per row that sees a key of the page (the others skip 3 and 4):
//      tile max by a shuffle butterfly over the row's lanes,
//      m' = max(m, tile max), a = exp(m - m'), p = exp(s - m') for visible keys;
//      tile sum of p by the same fixed butterfly; denom = denom * a + sum;
//      bf16(p) goes to shared memory;
//   4. P.V: lane owns head_dim / 32 output dims of every slot of its warp (of each
//      128-dim part of V, dims lane * 4 .. + 3; head_dim 64: lane * 2, + 1);
//      acc = acc * a, then acc = fma(bf16(p_j), v_j, acc) for the keys j up to the
//      row's position in ascending order (p_j = +0 for those before its window).
//
// NOTE (invariance): every value a row's result is built from is a function of the
// row's own query, position and keys, computed in an order fixed by head_dim,
// block_size and kKvChunk alone:
//   - a score is one thread's sequential FMA chain over d; which thread, warp or
//     slot computes it does not change it;
//   - the tile max is exact in any order (a +-0 tie changes nothing: s - m and
//     m - m' come out the same for either zero);
//   - the tile sum runs over key lanes in a butterfly whose shape depends only on
//     block_size (key j always sits in lane j % min(block_size, 32) of the row's
//     lane group, keys j and j + 32 are added in that lane first); masked keys (in
//     the row's future or before its window) enter it as +0, so they contribute
//     exactly nothing to a sum of p >= 0;
//   - P.V is one thread's sequential FMA chain over the page's keys up to the row's
//     position: a set fixed by the position (those before its window have p = +0);
//   - a page the row sees no key of (in its future, or wholly before its window) is
//     skipped by the row: its state stays exactly as it was. So a row whose window
//     starts past a chunk's first page keeps m = -inf, denom = acc = 0 up to its first
//     visible page, where a = exp(-inf - m') = 0 makes the state that page's own sums,
//     as for a chunk's first page: never -inf - -inf. Which pages the CTA runs (those
//     of any of its rows) does not reach a row;
//   - the KV length is split only at the fixed positions c * kKvChunk, never at a
//     place that depends on the batch, q_len, the grid or the device. Every chunk's
//     state starts fresh and sees exactly the chunk's keys the row sees; a chunk the
//     row sees no key of (wholly in its future or before its window) is neither merged
//     nor stored. The chunks a row sees are merged in ascending order, its first (the
//     one holding its lo) taken as it is, the rest with one formula, whether in
//     registers (one lane) or from the workspace (the last lane; fp32 stores and loads
//     are exact), so neither the lane count, nor the chunk a CTA starts at, nor the
//     head parts, nor which CTA counts last reaches a row's bits;
//   - every operation is an explicitly rounded intrinsic (__fmaf_rn, __fmul_rn,
//     __fadd_rn, __fsub_rn, __fdiv_rn) that the compiler cannot contract or
//     reorder, and expf and tanhf are libdevice's routines (no fast math), each the same
//     function of its argument wherever it runs (the cap's r = 1 / c is one IEEE
//     division of a launch argument);
//   - no float atomics: the counters are integers, and only say who merges.
// So the number of rows in the CTA, a row's slot, q_len, the chunking of a prompt, the
// launch geometry and the other sequences of the batch never reach a row's bits (nor,
// under a window, the keys outside the row's window):
// prefill rows (merged in registers) and decode rows (merged from the workspace) get
// the same bits, which is what makes a prompt's last token equal its decode step.
#include "common.cuh"

namespace {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * 32;
constexpr int kRowsPerWarp = 8;  // slots; the P.V loop reads a key's 8 bf16 p as one uint4
constexpr int kRowsPerCta = kNumWarps * kRowsPerWarp;  // ROWS_PER_CTA in attention_kernel.py
constexpr int kSlotBlock = 4;  // slots whose scores a lane computes together (register tile)
constexpr unsigned int kFullMask = 0xffffffffu;
// Keys of a KV chunk (KV_CHUNK in attention.py): the key range is cut at multiples of it.
constexpr int kKvChunk = 256;

template <int BLOCK_SIZE>
__device__ __forceinline__ constexpr int kTilesPerChunk() {
  static_assert(kKvChunk % BLOCK_SIZE == 0, "a KV chunk is whole pages");
  return kKvChunk / BLOCK_SIZE;
}

// The first key the query at `pos` sees (attention.py's row_lo): its sliding window's
// start, or 0 with no window (window 0).
__device__ __forceinline__ int window_start(int pos, int window) {
  return window > 0 && pos >= window ? pos - window + 1 : 0;  // no overflow at any window
}

// A scaled score soft-capped at c (attention.py's softcap_scores): c * tanh(s * r), r = 1 / c.
__device__ __forceinline__ float softcapped(float s, float c, float r) {
  return __fmul_rn(c, tanhf(__fmul_rn(s, r)));
}

// The two BF16 halves of a 32-bit word (the lower address holds the low half).
__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void unpack8(const uint4 w, float (&f)[8]) {
  f[0] = bf16_lo(w.x);
  f[1] = bf16_hi(w.x);
  f[2] = bf16_lo(w.y);
  f[3] = bf16_hi(w.y);
  f[4] = bf16_lo(w.z);
  f[5] = bf16_hi(w.z);
  f[6] = bf16_lo(w.w);
  f[7] = bf16_hi(w.w);
}

template <int HEAD_DIM, int BLOCK_SIZE>
struct Config {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim must be 64, 128 or 256");
  static_assert(BLOCK_SIZE == 16 || BLOCK_SIZE == 32 || BLOCK_SIZE == 64,
                "block_size must be 16, 32 or 64");
  static constexpr int kLanesPerRow = BLOCK_SIZE < 32 ? BLOCK_SIZE : 32;  // score lanes of a row
  static constexpr int kKeysPerLane = BLOCK_SIZE / kLanesPerRow;
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;  // slots a warp scores at once
  static constexpr int kSlotsPerLane = kRowsPerWarp / kRowsPerPass;
  static constexpr int kDimsPerLane = HEAD_DIM / 32;  // output dims a lane owns in P.V
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks in a row
  // Q rows are padded by 16 bytes, as K rows (kStagePadded)
  static constexpr int kPaddedDim = HEAD_DIM + 8;
  // The dims of a page staged in shared memory at once: the whole row up to 128; head_dim
  // 256 in two parts of 128 (a whole K and V page of 64 keys would take 66 KB), K's then
  // V's, one after another in one buffer.
  static constexpr int kStageDims = HEAD_DIM < 128 ? HEAD_DIM : 128;
  static constexpr int kDimParts = HEAD_DIM / kStageDims;
  static constexpr int kStageChunks = kStageDims / 8;
  static constexpr int kLaneDims = kStageDims / 32;  // output dims a lane owns in a part
  // K rows are padded by 16 bytes: the 8 lanes of a quarter-warp reading chunk c of 8
  // consecutive keys hit 8 different bank groups.
  static constexpr int kStagePadded = kStageDims + 8;
  // the staging buffer: the K page then the V page, or (by parts) one part of either
  static constexpr int kStageElems =
      kDimParts == 1 ? BLOCK_SIZE * (kStagePadded + HEAD_DIM) : BLOCK_SIZE * kStagePadded;
  static constexpr int kVOffset = kDimParts == 1 ? BLOCK_SIZE * kStagePadded : 0;  // V's rows in it
  static constexpr int kVStride = kDimParts == 1 ? HEAD_DIM : kStagePadded;
};

template <int HEAD_DIM, int BLOCK_SIZE>
struct __align__(16) SharedStorage {
  // K [block_size, head_dim + 8] then V [block_size, head_dim] BF16 (V from kVOffset on);
  // staged by parts: one part of K or V, [block_size, 128 + 8] BF16
  unsigned short kv[Config<HEAD_DIM, BLOCK_SIZE>::kStageElems];
  unsigned short q[kRowsPerCta * (HEAD_DIM + 8)];  // [rows, head_dim + 8] BF16
  unsigned short p[kNumWarps][BLOCK_SIZE][kRowsPerWarp];  // bf16(p) of each warp's slots
  float alpha[kNumWarps][kRowsPerWarp];  // a = exp(m - m') of the tile
  float denom[kNumWarps][kRowsPerWarp];  // the final denominators
  int num_visible[kNumWarps][kRowsPerWarp];  // keys of the tile up to the row's last; 0: it sees none
  float merge_a1[kNumWarps][kRowsPerWarp];  // a chunk's merge factors (merge_factors)
  float merge_a2[kNumWarps][kRowsPerWarp];
  int merge_sees[kNumWarps][kRowsPerWarp];  // 1: the row sees the chunk, 2: as its first; 0: not
  int last;  // 1: this CTA counted last (the split)
  float cap_r;  // the soft cap's r = 1 / c (softcapped); 0: no cap
};

// Part `part` (dims part * kStageDims ..) of a page's rows ([block_size, head_dim] BF16
// at `page`, K's or V's) into the staging buffer, [block_size, kStageDims + 8], once every
// thread is done with what it held; visible to every thread on return.
template <int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ void stage_part(unsigned short* __restrict__ stage,
                                           const unsigned short* __restrict__ page, int part) {
  using C = Config<HEAD_DIM, BLOCK_SIZE>;
  __syncthreads();
  for (int idx = threadIdx.x; idx < BLOCK_SIZE * C::kStageChunks; idx += kNumThreads) {
    const int j = idx / C::kStageChunks, c = idx % C::kStageChunks;
    *reinterpret_cast<uint4*>(&stage[j * C::kStagePadded + c * 8]) =
        __ldg(reinterpret_cast<const uint4*>(page) + j * C::kChunks + part * C::kStageChunks + c);
  }
  __syncthreads();
}

template <int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ void paged_attention(
    unsigned short* __restrict__ out,            // [T, num_heads, head_dim] BF16
    const unsigned short* __restrict__ q,        // [T, num_heads, head_dim] BF16
    const unsigned short* __restrict__ cache,    // [blocks, layers, 2, kv_heads, block_size, head_dim]
    const int* __restrict__ block_tables,        // [B, max_blocks]
    const int* __restrict__ seq_lens,            // [B]
    const int* __restrict__ query_start_loc,     // [B + 1]
    float* __restrict__ workspace,               // split: [T, heads, chunks, head_dim] + [T, heads, chunks, 2]
    unsigned* __restrict__ counters,             // split: one zero per (work item, head slot)
    int num_tokens, int num_seqs, int max_blocks, int num_heads, int num_kv_heads,
    int num_layers, int layer, int head_parts, int kv_lanes, float scale, int window,
    float softcap) {  // c > 0: each scaled score capped (softcapped); 0: none
  using C = Config<HEAD_DIM, BLOCK_SIZE>;
  __shared__ SharedStorage<HEAD_DIM, BLOCK_SIZE> sm;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // blockIdx.y = (kv_head * head_parts + part) * kv_lanes + kv_lane (split_grid)
  const int kv_lane = static_cast<int>(blockIdx.y) % kv_lanes;
  const int head_slot = static_cast<int>(blockIdx.y) / kv_lanes;
  const int kv_head = head_slot / head_parts;
  const int group = num_heads / num_kv_heads;
  const int sub_group = group / head_parts;  // the CTA's query heads of its KV head
  const int head0 = kv_head * group + (head_slot % head_parts) * sub_group;
  const int tokens_per_cta = kRowsPerCta / sub_group;

  int seq = 0, q_tile = 0;
  if (!find_work(query_start_loc, num_seqs, tokens_per_cta, (int)blockIdx.x, lane, seq, q_tile)) {
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
  if (num_rows == 0) return;
  // NOTE: a sequence's q_len queries are its last q_len positions: query i sits at
  // seq_len - q_len + i and sees keys window_start(that position)..that position.
  const int first_pos = seq_len - q_len + tok0;
  const int last_pos = first_pos + num_cta_tokens - 1;
  const int num_tiles = last_pos >= 0 ? min(last_pos / BLOCK_SIZE + 1, max_blocks) : 0;
  const int num_chunks = (num_tiles + kTilesPerChunk<BLOCK_SIZE>() - 1) / kTilesPerChunk<BLOCK_SIZE>();
  // the earliest key any row sees (the first row's lo), and the chunk holding it: the
  // chunks and pages before are seen by no row
  const int first_key = window_start(first_pos, window);
  const int first_chunk = first_key / kKvChunk;
  const bool split = kv_lanes > 1;
  if (split && first_chunk + kv_lane >= num_chunks) return;  // a lane with no chunk: not counted

  // the soft cap's r, read after the page loop's first barrier
  if (threadIdx.x == 0) sm.cap_r = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  // the CTA's query rows, zero past num_rows
  for (int idx = threadIdx.x; idx < kRowsPerCta * C::kChunks; idx += kNumThreads) {
    const int r = idx / C::kChunks, c = idx % C::kChunks;
    uint4 chunk = make_uint4(0u, 0u, 0u, 0u);
    if (r < num_rows) {
      const long long token = q_start + tok0 + r / sub_group;
      const int head = head0 + r % sub_group;
      chunk = __ldg(reinterpret_cast<const uint4*>(q + (token * num_heads + head) * HEAD_DIM) + c);
    }
    *reinterpret_cast<uint4*>(&sm.q[r * C::kPaddedDim + c * 8]) = chunk;
  }

  // slots of this warp holding a row; score passes (warp-uniform) that cover them
  const int warp_rows = num_rows > warp ? (num_rows - 1 - warp) / kNumWarps + 1 : 0;
  const int num_passes = (warp_rows + C::kRowsPerPass - 1) / C::kRowsPerPass;
  const int sub = lane / C::kLanesPerRow;  // the slot within a pass this lane scores
  const int key_lane = lane % C::kLanesPerRow;
  const int group_rows = sub_group;  // rows per query token

  // The merged state over the chunks done so far (one lane: this CTA walks them all),
  // in the same layouts as the chunk's: m, denom per score slot, acc per P.V slot.
  float m_total[C::kSlotsPerLane], denom_total[C::kSlotsPerLane];
  float acc_total[kRowsPerWarp][C::kDimsPerLane];
#pragma unroll
  for (int i = 0; i < C::kSlotsPerLane; ++i) {
    m_total[i] = negative_infinity();
    denom_total[i] = 0.0f;
  }
#pragma unroll
  for (int s = 0; s < kRowsPerWarp; ++s) {
#pragma unroll
    for (int e = 0; e < C::kDimsPerLane; ++e) acc_total[s][e] = 0.0f;
  }
  const int max_chunks = (max_blocks * BLOCK_SIZE + kKvChunk - 1) / kKvChunk;
  const long long ws_slots = static_cast<long long>(num_tokens) * num_heads * max_chunks;
  float* __restrict__ ws_ml = workspace + ws_slots * HEAD_DIM;  // (m, denom) of each slot
  const long long head_stride = (long long)BLOCK_SIZE * HEAD_DIM;  // one KV head of one page

  int t = first_key / BLOCK_SIZE;  // the next page to run (no row sees those before)
  for (int c = first_chunk + kv_lane; c < num_chunks; c += kv_lanes) {
    // softmax state of the chunk, from a fresh start: score slots sub + kRowsPerPass * i
    // (the same in all their lanes)
    float m[C::kSlotsPerLane], denom[C::kSlotsPerLane];
#pragma unroll
    for (int i = 0; i < C::kSlotsPerLane; ++i) {
      m[i] = negative_infinity();
      denom[i] = 0.0f;
    }
    // P.V accumulators of every slot of the warp: acc[s][part * kLaneDims + e] holds dim
    // part * kStageDims + lane * kLaneDims + e (lane * kDimsPerLane + e up to head_dim 128)
    float acc[kRowsPerWarp][C::kDimsPerLane];
#pragma unroll
    for (int s = 0; s < kRowsPerWarp; ++s) {
#pragma unroll
      for (int e = 0; e < C::kDimsPerLane; ++e) acc[s][e] = 0.0f;
    }
    const int chunk_tiles_end = min(num_tiles, (c + 1) * kTilesPerChunk<BLOCK_SIZE>());
    for (t = max(t, c * kTilesPerChunk<BLOCK_SIZE>()); t < chunk_tiles_end; ++t) {
      // the previous page's K, V and P are consumed (and Q is written); by parts, stage_part
      if constexpr (C::kDimParts == 1) __syncthreads();
      const long long block = block_tables[(long long)seq * max_blocks + t];
      const unsigned short* k_page =
          cache + ((block * num_layers + layer) * 2 * num_kv_heads + kv_head) * head_stride;
      const unsigned short* v_page = k_page + num_kv_heads * head_stride;
      // NOTE: slots past seq_len (and, in a chunked prefill, future slots) may hold stale
      // data, even NaN. They are copied here but no row ever uses them: their scores are
      // replaced by -inf (a select, never arithmetic), and the P.V loop stops at each
      // row's last visible key, so no 0 * NaN is ever formed.
      if constexpr (C::kDimParts == 1) {
        for (int idx = threadIdx.x; idx < BLOCK_SIZE * C::kChunks; idx += kNumThreads) {
          const int j = idx / C::kChunks, c = idx % C::kChunks;
          *reinterpret_cast<uint4*>(&sm.kv[j * C::kStagePadded + c * 8]) =
              __ldg(reinterpret_cast<const uint4*>(k_page) + idx);
          reinterpret_cast<uint4*>(sm.kv + C::kVOffset)[idx] =
              __ldg(reinterpret_cast<const uint4*>(v_page) + idx);
        }
        __syncthreads();
      }
      const int tile_start = t * BLOCK_SIZE;

      // --- scores and the softmax step, kSlotBlock score slots at a time ---
      // Score slot i's keys of this tile: begin .. visible - 1 (from its row's window's
      // start to its position); visible = 0 when none (or no row).
      const auto keys_of = [&](int i, int& begin, int& visible) {
        const int row = (sub + C::kRowsPerPass * i) * kNumWarps + warp;
        begin = 0;
        visible = 0;
        if (row < num_rows) {
          const int pos = first_pos + row / group_rows;
          const int end = min(max(pos - tile_start + 1, 0), BLOCK_SIZE);
          const int start = min(max(window_start(pos, window) - tile_start, 0), BLOCK_SIZE);
          if (start < end) {
            begin = start;
            visible = end;
          }
        }
      };
      // The slots' keys and scores. By parts, every slot's scores stay live over K's parts,
      // so only whether a slot sees a key is kept (`seen`) and the softmax step finds its
      // keys again (d256_b32 on sm_80: 245 registers; 255 when every slot keeps its keys).
      int begin[C::kSlotsPerLane], visible[C::kSlotsPerLane];
      unsigned seen = 0;  // by parts: bit i, slot i sees a key of the tile
      float score[C::kSlotsPerLane][C::kKeysPerLane];
      const auto start_block = [&](int i0) {  // slots i0 .. : their keys, and zero scores
#pragma unroll
        for (int ii = 0; ii < kSlotBlock; ++ii) {
          const int i = i0 + ii;
          if (i >= C::kSlotsPerLane) break;  // compile-time
          keys_of(i, begin[i], visible[i]);
          if constexpr (C::kDimParts > 1) seen |= visible[i] > 0 ? 1u << i : 0u;
#pragma unroll
          for (int kk = 0; kk < C::kKeysPerLane; ++kk) score[i][kk] = 0.0f;
        }
      };
      // slots i0 .. take the staged dims (part `part`) of their FMA chains over d
      const auto add_scores = [&](int i0, int part) {
#pragma unroll 2
        for (int c = 0; c < C::kStageChunks; ++c) {
          float k[C::kKeysPerLane][8];
#pragma unroll
          for (int kk = 0; kk < C::kKeysPerLane; ++kk) {
            const int j = key_lane + C::kLanesPerRow * kk;
            unpack8(*reinterpret_cast<const uint4*>(&sm.kv[j * C::kStagePadded + c * 8]), k[kk]);
          }
#pragma unroll
          for (int ii = 0; ii < kSlotBlock; ++ii) {
            const int i = i0 + ii;
            if (i >= C::kSlotsPerLane) break;  // compile-time
            if (C::kDimParts == 1 ? visible[i] == 0 : (seen >> i & 1u) == 0) continue;
            const int row = (sub + C::kRowsPerPass * i) * kNumWarps + warp;
            float qf[8];
            const int q_chunk = part * C::kStageChunks + c;
            unpack8(*reinterpret_cast<const uint4*>(&sm.q[row * C::kPaddedDim + q_chunk * 8]), qf);
#pragma unroll
            for (int kk = 0; kk < C::kKeysPerLane; ++kk) {
#pragma unroll
              for (int e = 0; e < 8; ++e) score[i][kk] = __fmaf_rn(qf[e], k[kk][e], score[i][kk]);
            }
          }
        }
      };
      if constexpr (C::kDimParts > 1) {  // every slot's chains over each part of K in turn
#pragma unroll
        for (int i0 = 0; i0 < C::kSlotsPerLane; i0 += kSlotBlock) start_block(i0);
#pragma unroll
        for (int part = 0; part < C::kDimParts; ++part) {
          stage_part<HEAD_DIM, BLOCK_SIZE>(sm.kv, k_page, part);
#pragma unroll
          for (int i0 = 0; i0 < C::kSlotsPerLane; i0 += kSlotBlock) {
            if (i0 >= num_passes) break;  // warp-uniform
            add_scores(i0, part);
          }
        }
      }
#pragma unroll
      for (int i0 = 0; i0 < C::kSlotsPerLane; i0 += kSlotBlock) {
        if (i0 >= num_passes) break;  // warp-uniform
        if constexpr (C::kDimParts == 1) {
          start_block(i0);
          add_scores(i0, 0);
        }
#pragma unroll
        for (int ii = 0; ii < kSlotBlock; ++ii) {
          const int i = i0 + ii;
          if (i >= C::kSlotsPerLane) break;  // compile-time
          const int slot = sub + C::kRowsPerPass * i;
          if constexpr (C::kDimParts > 1) keys_of(i, begin[i], visible[i]);
          // NOTE: a masked key's score is replaced by -inf by a select, so its p is
          // expf(-inf) = +0: whatever its K held (stale data, NaN) never enters a row's state.
          float s[C::kKeysPerLane];
#pragma unroll
          for (int kk = 0; kk < C::kKeysPerLane; ++kk) s[kk] = __fmul_rn(score[i][kk], scale);
          const float cap_r = sm.cap_r;
          if (cap_r > 0.0f) {  // the grid's branch (a soft cap): before the mask, which a NaN meets too
#pragma unroll
            for (int kk = 0; kk < C::kKeysPerLane; ++kk) s[kk] = softcapped(s[kk], softcap, cap_r);
          }
          float tile_max = negative_infinity();
#pragma unroll
          for (int kk = 0; kk < C::kKeysPerLane; ++kk) {
            const int j = key_lane + C::kLanesPerRow * kk;
            s[kk] = j >= begin[i] && j < visible[i] ? s[kk] : negative_infinity();
            tile_max = fmaxf(tile_max, s[kk]);
          }
#pragma unroll
          for (int offset = C::kLanesPerRow / 2; offset > 0; offset /= 2) {
            tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, offset));
          }
          // NOTE: a row that sees the tile sees some key of it, so tile_max and m' are
          // finite, and the row's first tile's a = exp(-inf - m') = 0 needs no -inf - -inf.
          // A row that sees none of it (a tile in its future, or before its window) skips
          // the update below: its state stays exactly as it was (m = -inf still, before
          // its window's first tile).
          const bool sees = visible[i] > 0;
          const float m_new = sees ? fmaxf(m[i], tile_max) : m[i];
          const float alpha = sees ? expf(__fsub_rn(m[i], m_new)) : 1.0f;
          // NOTE: no select around expf (attention_tc.cu's softmax step says why): a
          // masked key's s is -inf against a finite max, so its p is expf(-inf) = +0.
          const float m_sub = sees ? m_new : 0.0f;  // a row that sees none: every s is -inf
          float p[C::kKeysPerLane];
#pragma unroll
          for (int kk = 0; kk < C::kKeysPerLane; ++kk) p[kk] = expf(__fsub_rn(s[kk], m_sub));
          float p_sum = p[0];
#pragma unroll
          for (int kk = 1; kk < C::kKeysPerLane; ++kk) p_sum = __fadd_rn(p_sum, p[kk]);
#pragma unroll
          for (int offset = C::kLanesPerRow / 2; offset > 0; offset /= 2) {
            p_sum = __fadd_rn(p_sum, __shfl_xor_sync(kFullMask, p_sum, offset));
          }
          if (sees) {
            denom[i] = __fadd_rn(__fmul_rn(denom[i], alpha), p_sum);
            m[i] = m_new;
          }
          if (i < num_passes) {
#pragma unroll
            for (int kk = 0; kk < C::kKeysPerLane; ++kk) {
              const int j = key_lane + C::kLanesPerRow * kk;
              sm.p[warp][j][slot] = (unsigned short)bf16_bits(p[kk]);
            }
            if (key_lane == 0) {
              sm.alpha[warp][slot] = alpha;
              sm.num_visible[warp][slot] = visible[i];
            }
          }
        }
      }
      __syncwarp();

      // --- P.V over the warp's slots ---
      // NOTE: a row runs keys 0 .. num_visible - 1 of a page it sees, in order. In the
      // page its window starts in, the keys before the window have p = +0 (a select made
      // their s -inf) and add exactly +0, as in the twin, whose P.V sums run over the
      // whole page; they are written keys (finite), unlike the slots past the row's
      // position, which the loop never reads. Starting each slot at its window instead
      // puts a second bound a slot in this loop, for every page: measured, a spill
      // (d64_b64, sm_90) or 3 more integer ops a slot and key.
      int slot_visible[kRowsPerWarp];
      int keys = 0;  // the most keys any slot of the warp sees
#pragma unroll
      for (int s = 0; s < kRowsPerWarp; ++s) {
        slot_visible[s] = s < warp_rows ? sm.num_visible[warp][s] : 0;
        keys = max(keys, slot_visible[s]);
        if (slot_visible[s] > 0) {
          const float alpha = sm.alpha[warp][s];
#pragma unroll
          for (int e = 0; e < C::kDimsPerLane; ++e) acc[s][e] = __fmul_rn(acc[s][e], alpha);
        }
      }
      // by parts: each part of V in turn, its dims' chains (acc[.][part * kLaneDims ..])
      // over the same keys in the same order
#pragma unroll
      for (int part = 0; part < C::kDimParts; ++part) {
        if constexpr (C::kDimParts > 1) stage_part<HEAD_DIM, BLOCK_SIZE>(sm.kv, v_page, part);
#pragma unroll 2
        for (int j = 0; j < keys; ++j) {
          const unsigned short* v_row = sm.kv + C::kVOffset + j * C::kVStride + lane * C::kLaneDims;
          float v[C::kLaneDims];
          if constexpr (C::kLaneDims == 2) {
            const unsigned int w = *reinterpret_cast<const unsigned int*>(v_row);
            v[0] = bf16_lo(w);
            v[1] = bf16_hi(w);
          } else {
            const uint2 w = *reinterpret_cast<const uint2*>(v_row);
            v[0] = bf16_lo(w.x);
            v[1] = bf16_hi(w.x);
            v[2] = bf16_lo(w.y);
            v[3] = bf16_hi(w.y);
          }
          float p[kRowsPerWarp];
          unpack8(*reinterpret_cast<const uint4*>(&sm.p[warp][j][0]), p);
#pragma unroll
          for (int s = 0; s < kRowsPerWarp; ++s) {
            if (j < slot_visible[s]) {  // warp-uniform; never reads a key past the row's position
#pragma unroll
              for (int e = 0; e < C::kLaneDims; ++e) {
                float& a = acc[s][part * C::kLaneDims + e];
                a = __fmaf_rn(p[s], v[e], a);
              }
            }
          }
        }
      }
    }

    // --- the chunk's end: merge its state into the total, or store it for the last lane ---
    // NOTE: a row saw a key of the chunk exactly when its max is finite (a visible key's
    // score is; the pages it skips leave m = -inf): rows the chunk is in the future of,
    // or wholly before the window of, are neither merged nor stored. The chunks run in
    // ascending order and a row sees a run of consecutive ones, so its first (the one
    // holding its lo: taken as it is) finds its total still empty, m_total = -inf.
    // (Read off the state: recomputed from the positions, it cost up to 33 registers.)
#pragma unroll
    for (int i = 0; i < C::kSlotsPerLane; ++i) {
      const int slot = sub + C::kRowsPerPass * i;
      const int row = slot * kNumWarps + warp;
      const bool sees = i < num_passes && row < num_rows && m[i] != negative_infinity();
      const bool first = m_total[i] == negative_infinity();
      if (!sees) {
        if (i < num_passes && key_lane == 0) sm.merge_sees[warp][slot] = 0;
        continue;
      }
      if (split) {
        if (key_lane == 0) {
          const long long at = (q_start + tok0 + row / group_rows) * num_heads + head0 + row % group_rows;
          ws_ml[(at * max_chunks + c) * 2] = m[i];
          ws_ml[(at * max_chunks + c) * 2 + 1] = denom[i];
        }
      } else if (first) {  // the row's first chunk: taken as it is
        m_total[i] = m[i];
        denom_total[i] = denom[i];
      } else {
        float a1, a2;
        m_total[i] = merge_factors(m_total[i], m[i], a1, a2);
        denom_total[i] = merged(denom_total[i], a1, denom[i], a2);
        if (key_lane == 0) {
          sm.merge_a1[warp][slot] = a1;
          sm.merge_a2[warp][slot] = a2;
        }
      }
      if (key_lane == 0) sm.merge_sees[warp][slot] = first ? 2 : 1;
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < kRowsPerWarp; ++s) {
      if (s >= warp_rows) break;  // warp-uniform
      if (sm.merge_sees[warp][s] == 0) continue;
      const int row = s * kNumWarps + warp;
      if (split) {
        const long long at = (q_start + tok0 + row / group_rows) * num_heads + head0 + row % group_rows;
        float* dst = workspace + (at * max_chunks + c) * HEAD_DIM + lane * C::kLaneDims;
#pragma unroll
        for (int e = 0; e < C::kDimsPerLane; ++e) {
          dst[e / C::kLaneDims * C::kStageDims + e % C::kLaneDims] = acc[s][e];
        }
      } else if (sm.merge_sees[warp][s] == 2) {
#pragma unroll
        for (int e = 0; e < C::kDimsPerLane; ++e) acc_total[s][e] = acc[s][e];
      } else {
        const float a1 = sm.merge_a1[warp][s], a2 = sm.merge_a2[warp][s];
#pragma unroll
        for (int e = 0; e < C::kDimsPerLane; ++e) acc_total[s][e] = merged(acc_total[s][e], a1, acc[s][e], a2);
      }
    }
    __syncwarp();  // merge_* are read before the next chunk's end rewrites them
  }

  if (split) {
    // --- the last lane of the (work item, head slot) to finish merges every chunk ---
    // NOTE: gemm.cu's last-block handoff: every thread's stores, __threadfence, one
    // atomicAdd per CTA; the CTA that counts last fences again and reads through L2.
    const int active = min(kv_lanes, num_chunks - first_chunk);
    unsigned* counter = counters + static_cast<long long>(blockIdx.x) * (gridDim.y / kv_lanes) + head_slot;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) sm.last = atomicAdd(counter, 1u) == static_cast<unsigned>(active - 1) ? 1 : 0;
    __syncthreads();
    if (sm.last == 0) return;
    __threadfence();
    // NOTE: merge_chunks merges a row's chunks 0 .. pos / kKvChunk; a row's first is c0,
    // the chunk holding its lo. Handed the workspace seen from chunk c0 (its pointers c0
    // chunks on, the positions c0 * kKvChunk back), it merges exactly chunks c0 .. pos /
    // kKvChunk, c0 taken as it is. One call for each run of queries with the same c0: at
    // most two, as a CTA's queries span fewer than kKvChunk positions.
    for (int tok = 0; tok < num_cta_tokens;) {
      const int c0 = window_start(first_pos + tok, window) / kKvChunk;
      int end = tok + 1;
      while (end < num_cta_tokens && window_start(first_pos + end, window) / kKvChunk == c0) ++end;
      merge_chunks<HEAD_DIM, kKvChunk>(out, workspace + static_cast<long long>(c0) * HEAD_DIM, ws_ml + 2LL * c0,
                                       (end - tok) * group_rows, group_rows, q_start + tok0 + tok,
                                       first_pos + tok - c0 * kKvChunk, num_heads, head0, max_chunks,
                                       /*zero_sign=*/false);
      tok = end;
    }
    if (threadIdx.x == 0) *counter = 0u;  // the next launch, after this one in stream order, sees 0
    return;
  }

  // --- out = bf16(acc / denom) ---
#pragma unroll
  for (int i = 0; i < C::kSlotsPerLane; ++i) {
    if (i < num_passes && key_lane == 0) sm.denom[warp][sub + C::kRowsPerPass * i] = denom_total[i];
  }
  __syncwarp();
#pragma unroll
  for (int s = 0; s < kRowsPerWarp; ++s) {
    if (s >= warp_rows) break;  // warp-uniform
    const int row = s * kNumWarps + warp;
    const long long token = q_start + tok0 + row / group_rows;
    const int head = head0 + row % group_rows;
    unsigned short* dst = out + (token * num_heads + head) * HEAD_DIM + lane * C::kLaneDims;
    const float d = sm.denom[warp][s];
    unsigned int bits[C::kDimsPerLane];
#pragma unroll
    for (int e = 0; e < C::kDimsPerLane; ++e) bits[e] = bf16_bits(__fdiv_rn(acc_total[s][e], d));
#pragma unroll
    for (int part = 0; part < C::kDimParts; ++part) {
      const unsigned int* b = bits + part * C::kLaneDims;
      if constexpr (C::kLaneDims == 2) {
        *reinterpret_cast<unsigned int*>(dst + part * C::kStageDims) = b[0] | (b[1] << 16);
      } else {
        *reinterpret_cast<uint2*>(dst + part * C::kStageDims) =
            make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
      }
    }
  }
}

}  // namespace

// One entry point per (head_dim, block_size). grid = attention_kernel.split_grid's, block = 128;
// `window`: the sliding window (0: none), `softcap`: the scores' soft cap (0: none).
#define PAGED_ATTENTION_ARGS                                                                  \
  unsigned short *__restrict__ out, const unsigned short *__restrict__ q,                     \
      const unsigned short *__restrict__ cache, const int *__restrict__ block_tables,          \
      const int *__restrict__ seq_lens, const int *__restrict__ query_start_loc,               \
      float *__restrict__ workspace, unsigned *__restrict__ counters, int num_tokens,          \
      int num_seqs, int max_blocks, int num_heads, int num_kv_heads, int num_layers, int layer, \
      int head_parts, int kv_lanes, float scale, int window, float softcap
#define PAGED_ATTENTION_PASS                                                                  \
  out, q, cache, block_tables, seq_lens, query_start_loc, workspace, counters, num_tokens,    \
      num_seqs, max_blocks, num_heads, num_kv_heads, num_layers, layer, head_parts, kv_lanes, scale, \
      window, softcap

extern "C" __global__ void __launch_bounds__(128) paged_attention_d64_b16(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<64, 16>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d64_b32(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<64, 32>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d64_b64(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<64, 64>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d128_b16(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<128, 16>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d128_b32(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<128, 32>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d128_b64(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<128, 64>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d256_b16(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<256, 16>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d256_b32(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<256, 32>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128) paged_attention_d256_b64(PAGED_ATTENTION_ARGS) {
  pdl_enter();
  paged_attention<256, 64>(PAGED_ATTENTION_PASS);
}
