// Paged attention on tensor cores, FlashAttention-2 style (twin: attention.py,
// paged_attention_ref; launcher: attention_tc_kernel.py). Same inputs, outputs and
// invariance promise as attention.cu, the CUDA-core kernel; Q.K^T and P.V run on
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, so a long prefill is bound by the
// tensor cores rather than by fp32 FMAs.
//
// Work: one CTA per (query tile, head slot, KV lane), on attention_kernel.split_grid's
// grid as attention.cu (its header describes head slots and lanes), found on the device
// from query_start_loc as attention.cu does (find_work), but taken in reverse: the
// longest key ranges first. A query tile is up to kRowsPerCta / (group / head_parts)
// consecutive queries of one sequence, its rows the (query token, query head of the
// slot) pairs, row r = token * (group / head_parts) + member, so every K/V page is read
// once for all the slot's heads.
//
// KV chunks, as attention.cu: the key range is cut at c * kKvChunk (256 keys); the CTA's
// chunks run from c0, the one holding its first row's first visible key (window_start:
// under a sliding window the query at p sees keys p - window + 1 .. p; c0 = 0 without
// one), to its last row's; the lane runs chunks c0 + kv_lane, c0 + kv_lane + kv_lanes,
// ... one after another through the same page ring (page k of the CTA is page k %
// kTilesPerChunk of its chunk k / kTilesPerChunk; lane 0 starts at the first page its
// first row sees), each from a fresh RowState. At a chunk's end, one lane merges the
// state of each row that sees the chunk into each thread's total, kept in shared memory
// after the ring (thread-private, so no barrier: registers are spoken for), in ascending
// chunk order (merge_factors / merged; a row's first chunk, the one holding its first
// visible key, taken as it is); several lanes store it to the fp32 workspace and the
// lane that counts last in its (work item, head slot) counter merges every row's chunks
// from there (merge_window_chunks: merge_chunks from the row's first chunk), with the
// same formula and order.
//
// CTA: 4 warps; warp w owns rows 16w .. 16w + 15, one m16 tile (rows past the
// CTA's last are padding: zero Q, never written). Its Q fragments are loaded
// once into registers. The pages of the sequence (the key tiles) go through a
// ring of kStages shared buffers (Ring: ring_stages, or deep_ring_stages for the
// deep ring below), K then V, [block_size, head_dim + 8] BF16 each,
// filled by 16-byte cp.async; key slots past seq_len are zero-filled instead of
// read. For each page t of a chunk in ascending order, up to the last page the CTA's
// last row sees, a warp some of whose rows see a key of page t (warp_sees, a vote):
//   1. S = Q.K^T: for each n8 tile of keys, one mma per 16-wide head_dim slice,
//      slices ascending, from +0 (K fragments by ldmatrix, rows = keys);
//   2. the softmax step per row, in the accumulator layout (thread t of a quad
//      holds keys 8j + 2t, +1 of rows g and g + 8), in log2 units (u = scale *
//      log2(e)): masked scores (past the row's position, or before its window) -> -inf,
//      tile max (exact), m' = max(m, tile max * u),
//      a = exp2(m - m') (1 where m' = m), p = exp2(s * u - m') (one fma) or +0,
//      the row sum of p (per thread over its values as a balanced tree, row_reduce:
//      each n8 tile's pair, then adjacent tiles; then the quad butterfly xor 1,
//      xor 2), denom = denom * a + sum. With a soft cap c > 0 (`softcap`, the twin's;
//      Gemma 2's; a branch every CTA takes alike: c = 0 runs none of it), each score is
//      first capped in natural units, y = c * tanhf(fp32(s * scale) * r), r = 1 / c
//      (softcapped, attention.py's softcap_scores), before the masks, and the step
//      above runs on y with u = log2(e) (the natural-expf build: on y itself);
//   3. acc = acc * a in place (skipped where every a of the warp's rows is 1), then
//      P.V: p rounded to BF16 is the A operand,
//      straight from the S registers (FA2 register reuse), one mma per 16-key
//      slice, slices ascending, per n8 tile of head_dim (V fragments by
//      ldmatrix.trans), accumulating into acc itself.
// Finally, after the chunks are merged, out = bf16(acc / denom).
//
// The deep ring (the _deep entry points): the same kernel with a deeper ring, at least
// 128 keys and 3 pages (b16: 8 stages, b32: 4, b64: 3), which the launcher takes exactly
// for split launches (kv_lanes > 1: fewer (query tile, head slot) CTAs than a wave).
// There each CTA walks a few pages one after another, and the normal ring (b32, b64: one
// page in flight while one is read) keeps few loads in flight: at decode batch 1, context
// 512, Llama-3.1-8B shapes, 26.1 us for 0.70 us of KV at copy bandwidth (H100,
// bench/results/2026-11-27-h100). Measured against the normal ring in one run (H200,
// bench/results/2026-11-27-h100/ab), the deep ring is 6-7 % faster where launches split:
// the page loads' latency is a small part of that time, whose main cause is still open.
// The deep ring keeps kStages - 1 pages in flight; its shared memory costs CTAs an SM (below),
// which split grids (about SPLIT_CTAS_PER_SM = 2 CTAs an SM) can spare and full grids
// could not. NOTE: the ring depth never reaches a row's bits: it changes only when
// copies are issued and waited for (a page is read once wholly landed, whatever stage
// holds it), not any arithmetic or its order.
//
// Resources (NVRTC, -ftz=true as CuPy compiles; registers and stack frame from the
// cubin, nvrtc.kernel_resources; test_attention_split prints them with the CTAs an SM
// holds, allows no stack frame, and holds d128_b32 to 168 registers). CTAs an SM holds,
// of 128 threads: by registers, 65,536 a SM at 256 a warp granule; by shared memory,
// Ring::kSmemBytes + 32 B static (CtaWork) + 1 KB reserved a CTA out of 164 KB (sm_80)
// or 228 KB (sm_90). Before: the CTA's work item (its first token, position, rows, query
// heads, chunks, the split counter) was held in registers through the page loop for the
// chunk ends and the output, about ten of them; now those read it from shared memory
// (CtaWork), and the loop keeps in registers only what each page uses. Earlier still
// (__launch_bounds__(128, 1) everywhere, a select holding the old acc through P.V, a
// per-copy address table for the page copies): 145-255 registers, d128_b64 spilling.
// Then (2026-11-27) the softmax step's expf without a select around it and the one-lane
// chunk end's merge as selects (see there): the page loop of d128_b32 on sm_90 went from
// 1,601 SASS instructions with 56 divergence regions (BSSY) to 1,428 with 9.
//
// Then (later on 2026-11-27) the softmax in base 2 (REPRISE_ATTN_EXPF above), acc * a
// skipped by a warp whose rows' maxima all stayed put, a chunk's fresh state reset in a branch,
// not by selects on every page, and a page's copies addressed from the thread's first
// copy in block 0 (one multiply-add a page, not the page's address found anew: 74
// instructions to 50), and the masks' selects skipped on a page each real row of the warp
// sees whole (the kernel takes attend_page twice, WHOLE or not), and a page's row max and
// row sum as balanced trees (row_reduce), not one chain through every key (see each
// there). The path a page takes through the loop (no chunk end, seen whole, the rescale
// skipped; counted in the SASS of d128_b32 on sm_90) went from about 715 instructions to
// about 310 (the deep kernel's from about 700 to 310): each key's p was about eleven
// instructions and is two; the registers are the "now" column. d64_b32 is bounded at
// (128, 4) since: 128 registers (160 at (128, 3)), 4 CTAs an SM on sm_90 instead of 3;
// d64_b64 spills at (128, 4).
//
//   kernel     smem B  | sm_80 regs (bounds)              CTAs     | sm_90 regs        CTAs
//                      | earlier -> 11-27 -> now          reg/smem | earlier->11-27->now reg/smem
//   d64_b16     36,864 | 122 -> 128 -> 128 (128, 4)         4/4    | 115 -> 127 -> 128   4/6
//   d64_b32     36,864 | 137 -> 127 -> 128 (128, 3 -> 4)    4/4    | 142 -> 160 -> 128   4/6
//   d64_b64     55,296 | 165 -> 160 -> 160 (128, 3)         3/2    | 167 -> 159 -> 162   3/4
//   d128_b16    69,632 | 168 -> 167 -> 168 (128, 3)         3/2    | 167 -> 168 -> 168   3/3
//   d128_b32    69,632 | 202 -> 168 -> 168 (128, 2 -> 3)    3/2    | 202 -> 168 -> 168   3/3
//   d128_b64   104,448 | 219 -> 220 -> 225 (128, 2)         2/1    | 225 -> 222 -> 230   2/2
//
// So registers hold no head_dim 128 kernel below what its shared memory allows, on either
// architecture; d128_b32 (Llama-3.1-8B's head and page) now runs 3 CTAs an SM on sm_90.
// d128_b64 keeps (128, 2): its shared memory holds it to 2 (sm_90) and 1 (sm_80) CTAs,
// and a cap would only take registers from the loads in flight (with __maxnreg__ it
// compiles without spills down to 192; at 184 sm_90 spills 12 B, at 168 both spill
// 80-88 B). On sm_90 the head_dim 64 kernels are still held by registers (4/6, 3/6,
// 3/4); 6 CTAs would take <= 80 registers, 4 CTAs <= 128.
//
// The deep ring, __launch_bounds__(128, 2) (split grids hold at most SPLIT_CTAS_PER_SM =
// 2 CTAs an SM of 132: split_grid), no stack frame, its shared memory the ring alone:
// split launches only (a one-lane launch traps), which merge their chunks from the
// workspace. (At (128, 3), 168 registers, d128_b32_deep spills 8 B on sm_90; so 2.)
//
// Since 2026-11-27 a deep kernel compiles none of the one-lane code (its chunk-end merge
// and output: `if constexpr`): d128_b32_deep's page loop is 877 SASS instructions, from
// 1,570, with 8 divergence regions, from 57. The "now" column: since base 2 (above);
// d128_b16_deep holds 2 CTAs an SM by registers on sm_80, not 3: the split's 2, and
// what its shared memory holds there.
//
//   kernel         stages  smem B  | sm_80 regs            CTAs reg/smem | sm_90 regs            CTAs reg/smem
//   d64_b16_deep      8     36,864 | 114 -> 111 -> 117         4/4       | 120 -> 117 -> 124         4/6
//   d64_b32_deep      4     36,864 | 133 -> 130 -> 145         3/4       | 142 -> 141 -> 148         3/6
//   d64_b64_deep      3     55,296 | 157 -> 158 -> 162         3/2       | 168 -> 168 -> 162         3/4
//   d128_b16_deep     8     69,632 | 165 -> 162 -> 179    3 -> 2/2       | 174 -> 174 -> 186         2/3
//   d128_b32_deep     4     69,632 | 198 -> 195 -> 208         2/2       | 201 -> 198 -> 214         2/3
//   d128_b64_deep     3    104,448 | 213 -> 213 -> 213         2/1       | 224 -> 216 -> 222         2/2
//
// Built with REPRISE_ATTN_COOP=1 (attention_tc_kernel.COOP), a deep kernel's CTA whose rows
// fit one m16 tile (a decode's) runs each page on all four warps ("The shared page", at
// attend_page_coop), with the same bits; registers within 3 of the "now" column, no spills,
// and 1.3-4.4 KB more static shared memory (the warps' exchange).
//
// The sliding window (2026-11-30) holds each row's first visible key beside its position
// through the page loop, and the warp's page bounds gave way to votes (warp_sees): the
// kernels at their bounds (d64_b16, d64_b32: 128; d128_b16, d128_b32: 168) keep their
// registers without spills; the others moved by -5 to +8 (d64_b16_deep on sm_90 120 ->
// 128, d128_b64_deep 218 -> 226; the shared page's build alike), no CTAs an SM lost.
//
// The soft cap (2026-11-30) is a third attend_page (CAP: capped, masked on every page),
// taken on a branch on the argument: the kernels at their bounds keep them, no spills,
// the others moved by -3 to +5 (d64_b64 on sm_80 159 -> 164, d128_b64 222 -> 225;
// d128_b64_deep 220 -> 217; the shared page's build alike), no CTAs an SM lost. Capping
// every score of the page ahead of the per-row masks instead held 32 tanhf in flight:
// d64_b64_deep 161 -> 191 (sm_80), 166 -> 198 (sm_90), a CTA an SM less on sm_90.
//
// Registers never hold a deep kernel below 2 CTAs an SM, or below its shared memory's
// count (test_attention_split). Every deep kernel fits sm_80's 163 KB opt-in. A batch-1
// Llama-3.1-8B decode's split grid is 256 CTAs (8 lanes of 32 head slots): one round on
// an H100's 132 SMs at 2 CTAs an SM.
//
// NOTE (invariance, DESIGN §4): a query row's bits depend only on its query, its
// position, the window, its sequence's keys and values, head_dim and block_size:
//   - The KV length is split only at the fixed positions c * kKvChunk. Each chunk's
//     state starts fresh and takes the chunk's pages in ascending order (the key tiles);
//     the chunks' states are merged in ascending order with one formula of explicitly
//     rounded ops, in shared memory or from the workspace (exact fp32 copies either
//     way), so neither the lane count, nor the head parts, nor which CTA counts last
//     reaches a row. A chunk a row sees no key of (wholly in its future, or wholly before
//     its window) is neither merged nor stored; the chunk holding its first visible key
//     is its first, taken as it is (not merged with an empty state, which could turn a
//     -0 into +0), whichever lane runs it: the one-lane merge tests each row's first
//     chunk, the split's last lane starts each row's merge there (merge_window_chunks).
//     The chunks before the CTA's first row's window are seen by no row, and no lane runs
//     them: the lanes start at the first chunk seen, every chunk from there to the last
//     row's is seen by some row (consecutive queries' key ranges leave no gap), and the
//     counter counts the lanes that have one (min(kv_lanes, the CTA's chunks)). No float
//     atomics.
//   - S[r][j] is one accumulator register taking one mma per head_dim slice,
//     ascending, from +0; its row of A is q_r (BF16, as stored), its column of B
//     k_j. The fragment's other rows (companion or padding queries) do not enter
//     it: an mma has no cross-row interaction. As for gemm.cu (its point 3), an
//     element's arithmetic is the same at every row position of the fragment, so
//     the row's slot in the CTA does not matter; key j always sits at the same
//     column (n8 tile j / 8, column j % 8).
//   - Masking is by select, never arithmetic on what S held (a page every real row
//     of the warp sees whole skips the selects: they would keep every score): a key
//     past the row's position (causal), before its first visible key (the window) or
//     past seq_len gets s = -inf (a select), so p = exp2(-inf - a finite max) = +0,
//     whatever S held (not even a NaN there gets in). Every
//     other step of the softmax is elementwise on the row's own values with
//     explicitly rounded intrinsics (__fmul_rn, __fmaf_rn, __fsub_rn, __fadd_rn,
//     __fdiv_rn) and one exponential, ex2.approx (a function of its input alone on
//     a device, if not correctly rounded; the REPRISE_ATTN_EXPF build: the accurate
//     expf): nothing is contracted or reordered. A soft cap adds libdevice's tanhf (a
//     function of its input alone too) of each score, every page and path alike, and
//     r = 1 / c, one IEEE division of the argument.
//     The tile max is exact in any order (a +-0 tie changes nothing: s - m and
//     m - m' come out the same for either zero). The row sum has a shape fixed
//     by block_size: key j is always summed by thread (j % 8) / 2 of the quad, at
//     the same leaf of its tree (row_reduce); masked keys add +0 to a sum of p >= 0,
//     which changes nothing.
//   - The first page a row sees in a chunk has a finite tile max (the row sees some key
//     of it), so m' is finite and a = exp2(-inf - m') = +0: denom and acc become that
//     page's own sums. The denominator ends about 1 or above (the largest score's p is
//     2^e, e the rounding error of its s * u, which the fma keeps: 1 within a few
//     millionths).
//   - A page the row sees no key of (wholly in its future, or wholly before its window)
//     leaves the row's state (m, denom, acc) exactly as it was, whatever the other rows
//     of its m16 tile do, and so a row whose window starts past a chunk's first page
//     keeps m = -inf, denom = acc = 0 until the first page it sees: the warp skips a
//     page none of its rows sees (warp-uniform), and when the page is run for the
//     row's neighbours, the row's m and denom are kept by select, its a is 1 (m' = m,
//     so no exp2(-inf - -inf)) and its p are exp2(-inf - 0) = +0 (its s are -inf; the
//     max subtracted is 0 for a row that sees none of the page, so no NaN either in
//     the natural-expf build or with a select around the exponential), so its acc
//     takes acc * 1 (exact, or skipped: the same) and then
//     only exact zero terms in the P.V mmas: by the property the next point
//     relies on, a nonzero acc comes out exactly as it went in, and a zero acc
//     at most changes its sign, which never reaches an output (see there). So a
//     row runs exactly the pages from its own first visible key to its last, as it
//     would alone. (No copy of the old acc is kept for a select: that would hold
//     another acc tile's registers live through the mmas.)
//   - P.V for a page the row sees: acc[r][d] takes acc * a, then one mma per
//     16-key slice, ascending; key j sits at k index j % 16 of slice j / 16.
//     Its terms are the row's bf16(p_j) * v_j[d]. A key masked for the row has
//     p = +0, so its term is an exact zero; the key's V is real data (a later
//     query's, within seq_len) in one call and zero (past seq_len) in another,
//     which can change only the sign of that zero term. What this relies on from
//     the tensor cores, beyond gemm.cu's point 3: an exact zero term, of either
//     sign, does not change a nonzero result (the sum is of exact products). So
//     such a sign can reach at most the sign of an exactly zero acc; a zero's sign
//     reaches only zeros through the chunk merge (x1 * a1 + x2 * a2), and the
//     output maps -0 to +0 (the PTX ISA does not say which zero an mma returns).
//   - V and K slots past seq_len may hold stale data, even NaN (a page's earlier
//     use, or a chunked prefill's unwritten future): they are never read, the
//     copy writes zeros there instead (cp.async with src-size 0, a select made
//     by the copy), so the P.V mma never forms 0 * NaN.
// So the number of rows in the CTA, a row's slot, q_len, the chunking of a prompt, the
// launch geometry and the other sequences of the batch never reach a row's bits:
// prefill rows (one lane) and decode rows (split) run this same code and merge alike,
// so a prompt's last token equals its decode step.
//
// Before the wait (programmatic dependent launch, cuda/pdl.py): as kvcache.cu's
// rope_kv_write, this kernel reads before its pdl_enter() what no grid still running can be
// writing: query_start_loc, seq_lens and the block table (uploaded by copies before
// the step's first kernel), and the ring's first pages when they lie wholly before the
// sequence's first query position, seq_len - q_len (keys an earlier step or an earlier
// chunk wrote, never a shared block that anything writes: new keys go into a
// sequence's own last blocks). A dependent grid starts only once the grid before it
// has passed its own wait, so every grid but the one just before has completed; the
// one just before (rope_kv_write, or the qkv launch's rope epilogue) writes the queries
// and the keys at or past seq_len - q_len, which are read after the wait, as the
// output, workspace and counters are written after it. Every thread takes the wait,
// an early return too. The pages' copies and bits are the same: only when they start
// moves (a decode's first pages while the qkv projection still runs).
#include "common.cuh"
#include "attention_tc.cuh"  // the kernel body: paged_attention_tc

// Two entry points per (head_dim, block_size): the normal ring, and the deep one (_deep)
// for split launches. grid = attention_kernel.split_grid's, block = 128, dynamic shared
// memory = Ring::kSmemBytes (attention_tc_kernel.smem_bytes); `window`: the sliding
// window (window_start), 0 for none; `softcap`: the scores' soft cap (softcapped), 0 for none.
#define PAGED_ATTENTION_ARGS                                                                  \
  unsigned short *__restrict__ out, const unsigned short *__restrict__ q,                     \
      const unsigned short *__restrict__ cache, const int *__restrict__ block_tables,          \
      const int *__restrict__ seq_lens, const int *__restrict__ query_start_loc,               \
      float *__restrict__ workspace, unsigned *__restrict__ counters, int num_tokens,          \
      int num_seqs, int max_blocks, int num_heads, int num_kv_heads, int num_layers, int layer, \
      int head_parts, int kv_lanes, float scale, int window, float softcap
#define PAGED_ATTENTION_PASS                                                                  \
  out, q, cache, block_tables, seq_lens, query_start_loc, workspace, counters, num_tokens,    \
      num_seqs, max_blocks, num_heads, num_kv_heads, num_layers, layer, head_parts, kv_lanes, scale, window, \
      softcap

extern "C" __global__ void __launch_bounds__(128, 4) paged_attention_tc_d64_b16(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<64, 16, ring_stages(16), false>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 4) paged_attention_tc_d64_b32(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<64, 32, ring_stages(32), false>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 3) paged_attention_tc_d64_b64(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<64, 64, ring_stages(64), false>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 3) paged_attention_tc_d128_b16(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<128, 16, ring_stages(16), false>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 3) paged_attention_tc_d128_b32(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<128, 32, ring_stages(32), false>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_tc_d128_b64(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<128, 64, ring_stages(64), false>(PAGED_ATTENTION_PASS);
}

// head_dim 256 (Gemma's; attention_tc_kernel.D256_BY_DEFAULT, off until a GPU has run it):
// the normal ring only, at one CTA an SM. A warp's acc (16 rows x 256, 128 registers a
// thread) and Q fragments (64) leave the page loop no room for a second CTA's share:
// 255 registers on sm_80 and sm_90 with no spills; its deep ring spilled 8 B on sm_90
// (so split launches take the normal ring, which has the split's code too). Shared
// memory 135,168 B (two 32-key or four 16-key stages of K and V rows of 264 halves, then
// 132 floats a thread of merged state): under sm_80's opt-in. No 64-key pages (202,752 B,
// over sm_80's): the CUDA-core kernel runs those.
extern "C" __global__ void __launch_bounds__(128, 1) paged_attention_tc_d256_b16(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<256, 16, ring_stages(16), false>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 1) paged_attention_tc_d256_b32(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<256, 32, ring_stages(32), false>(PAGED_ATTENTION_PASS);
}

// The deep ring: split launches only (they trap on one lane), with the normal kernels'
// launch bounds, so that the split grid's CTAs (about SPLIT_CTAS_PER_SM = 2 an SM,
// rounded up) fit in one round.
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_tc_d64_b16_deep(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<64, 16, deep_ring_stages(16), true>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_tc_d64_b32_deep(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<64, 32, deep_ring_stages(32), true>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_tc_d64_b64_deep(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<64, 64, deep_ring_stages(64), true>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_tc_d128_b16_deep(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<128, 16, deep_ring_stages(16), true>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_tc_d128_b32_deep(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<128, 32, deep_ring_stages(32), true>(PAGED_ATTENTION_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_tc_d128_b64_deep(PAGED_ATTENTION_ARGS) {
  paged_attention_tc<128, 64, deep_ring_stages(64), true>(PAGED_ATTENTION_PASS);
}
