// A decode layer in one persistent launch (issue 18; twin: decode_block.py): (with the
// decode_layer entry points) its attention, then o_proj, the residual add and the MLP's
// norm, gate_up, silu(gate) * up, down_proj, the residual add and the next norm, and
// (where it is bias-free) the next layer's qkv projection and rope_kv_write. Nine launches
// of the op-by-op path (or five, fused: attention, gemm_add_rmsnorm, swiglu,
// gemm_add_rmsnorm, gemm_rope_kv_write) become one, whose CTAs meet at grid barriers
// between the steps instead of at launch boundaries: the default model's decode step is
// its ~280 launches of about 8 us each (bench/results/2026-11-28-h200: 1.65 ms a step),
// not its 270 MB of weights (0.06 ms at the H200's bandwidth). Each phase's first round
// of weight words is loaded while the CTA still waits (first_batch).
//
// Rows: a decode's M <= DECODE_BLOCK_MAX_ROWS tokens. Every CTA is resident at once (a
// cooperative launch, sized by the occupancy calculator: decode_block_kernel.py),
// PERSIST_THREADS threads each. The steps, each CTA in turn:
//   0. (decode_layer) its halves' share of the attention's planned CTAs (attention_phase,
//      attention_tc.cuh's kernel body as virtual CTAs), into attn; grid barrier;
//   1. its share of o_proj's work items (gemv_phase below) over the attention rows, which
//      it copies into its shared memory; grid barrier;
//   2. every CTA: y_o folded, summed1 = residual + y_o, x1 = rmsnorm(summed1) for all M
//      rows, into its shared memory (every CTA the same bits: the same function on the same
//      values), then its share of gate_up's items; grid barrier;
//   3. h = silu(gate) * up of gate_up's product, into its shared memory, then its share of
//      down_proj's items; grid barrier;
//   4. CTA m % grid: row m's summed = summed1 + y_down and normed = rmsnorm(summed); or,
//      with the next layer's head (its qkv projection bias-free), every CTA all rows into
//      its shared memory, row m's summed written by CTA m % grid alone, then
//   5. its share of the next layer's qkv items, then the product's rope_kv_write (the
//      rotated queries out, the keys and values into their cache slots): at head_dim 64
//      (a head a work item's 64 columns) by the CTA that finishes each head's columns, at
//      once (the tiles gemv_phase says it finished); else after a grid barrier, its share
//      of every (row, head, pair).
// The decode_layer entry points run consecutive layers so (decode_layers): a grid barrier
// after each layer's step 5, the next one's from step 0, its weights from a table, so a
// step's layers after its first head are one launch (the default model: ~30 launches a
// step become one). Between layers the residual stream stays in each CTA's shared memory
// (step 4 writes every row there, every CTA the same bits) and the queries go to the
// launch's own buffer, which the next attention reads through L2.
//
// NOTE: the invariance argument (DESIGN §4): every value is one the op-by-op path
// computes, by the same operations in the same order.
//   - A projection's element: gemm.cu's (and gemm_sm90.cu's, which gives its bits)
//     sequence: one accumulator from +0.0f taking one mma.sync m16n8k16 per 16-wide K
//     slice in ascending order over its split's K range (the split fixed per weight:
//     gemm_kernel.split_k, the launcher passes its length), S = 1 stored as bf16 of the
//     accumulator, S > 1 the partials folded from +0.0f in ascending split order and
//     rounded once (common.cuh's fold_partials_of, the skinny and PARTIAL routes' own):
//     after the grid barrier, by every CTA that needs the element (o, gate_up, down:
//     product_at), or by the tile's last CTA (qkv: fold_split_partials). A work item is
//     (64-column tile, split); warp w takes the tile's columns 8w .. 8w + 7, so an
//     element's partial sits in one accumulator register of one thread, as there. Which
//     CTA takes an item, or folds, and the grid's size change who computes, never what.
//   - The norms: rmsnorm.cuh's add_rmsnorm_row with all PERSIST_THREADS (= RMSNORM_THREADS)
//     threads, the add_rmsnorm kernel's own function and tree.
//   - silu * up: common.cuh's silu_mul_value of the product's BF16 gate and up, rounded
//     once, as activation.cu's silu_mul (and the gated epilogue) compute it.
//   - Attention: attention_tc.cuh's paged_attention_tc itself on the standalone launch's
//     planned split grid, each planned CTA on half a CTA's threads (VIRTUAL: its own ring,
//     work item and named barrier): the same pages, chunk states and merge.
//   - Layers in one launch: each layer's values are the one-layer launch's; the residual
//     carried in shared memory is the fp32 summed it would write, the queries the BF16 it
//     would write (the same function on the same values).
// Reads of what other CTAs wrote in this launch go through L2 (__ldcg).
#include "common.cuh"
#include "rmsnorm.cuh"  // add_rmsnorm_row
#include "kvcache.cuh"  // rope_kv_write_pair
#include "attention_tc.cuh"  // paged_attention_tc, run as virtual CTAs (the decode_layer entry points)

#define PERSIST_THREADS 256
#define DECODE_BLOCK_MAX_ROWS 16  // one m16 fragment: decode_block_kernel.MAX_ROWS repeats it
#define DECODE_BLOCK_TILE_N 64    // a work item's columns: 8 warps of an n8 slice each
#ifndef REPRISE_WEIGHTS_EVICT_FIRST
#define REPRISE_WEIGHTS_EVICT_FIRST 1  // load_batch's weight words under L2 evict-first
#endif

namespace {

static_assert(PERSIST_THREADS == RMSNORM_THREADS, "add_rmsnorm's tree takes its own thread count");
static_assert(PERSIST_THREADS == 32 * DECODE_BLOCK_TILE_N / 8, "a warp a column slice");

#ifndef REPRISE_EMULATE_PTX
// The launch's dynamic shared memory (the emulator's driver gives each CTA its own).
__device__ __forceinline__ unsigned char* block_smem() {
  extern __shared__ __align__(16) unsigned char decode_block_smem[];
  return decode_block_smem;
}
#endif

// Where row n of a weight starts, and where the word of W[n][k], W[n][k + 1] (k = 64 kt +
// 16 s + 8 h + 2 t: k-tile kt, slice s of its 4, half h, the lane's t) sits from there:
// in the plain [N, K] row-major weight, or (PACKED) in gemm_sm90_kernel.prepare_weight's
// swizzled layout (64-row panels of 64 x 64 tiles, tile (panel, k-tile) at 8,192 bytes
// each, row r's 16-byte chunk c at chunk c ^ (r % 8) of its 128 bytes).
template <bool PACKED>
__device__ __forceinline__ const unsigned short* weight_row(const unsigned short* __restrict__ w, int n, int K) {
  if constexpr (PACKED) return w + static_cast<long long>(n >> 6) * (K >> 6) * 4096 + (n & 63) * 64;
  return w + static_cast<long long>(n) * K;
}

template <bool PACKED>
__device__ __forceinline__ int weight_offset(int n, int kt, int s, int h, int t) {
  if constexpr (PACKED) return kt * 4096 + (((2 * s + h) ^ (n & 7)) << 3) + 2 * t;
  return kt * 64 + 16 * s + 8 * h + 2 * t;
}

// Two BF16 of a shared row as one word (k even).
__device__ __forceinline__ unsigned shared_pair(const unsigned short* row, int k) {
  return *reinterpret_cast<const unsigned*>(row + k);
}

// One projection y [M, N] = x @ W^T as the launcher describes it.
struct Projection {
  const unsigned short* w;  // [N, K]: plain or packed (the kernel's PACKED)
  unsigned short* y;        // [M, N] BF16
  int N, K, split_len;      // split_len: gemm_kernel.split_length(K, split_k(N, K))
};

// A round of one lane's weight words: kTiles k-tiles of its column, 4 slices of 16 each,
// both halves of a slice (b0, b1 of mma.sync's B fragment), loaded before their mma.
constexpr int kTiles = 4;
struct Batch {
  unsigned b[kTiles][4][2];
};

// Item `item` of `p`: its tile's columns, its split's k-tiles [kt_begin, kt_end).
struct Item {
  int tile, split, kt_begin, kt_end;
};

// S: how many splits cut the projection's K (gemm_kernel.split_k's count for its N, K).
__device__ __forceinline__ int num_splits(const Projection& p) { return (p.K + p.split_len - 1) / p.split_len; }

__device__ __forceinline__ Item item_of(const Projection& p, int item) {
  const int splits = num_splits(p);
  const int tile = item / splits, split = item % splits;
  // K is a multiple of 64 and split_len of 128 (the launcher's checks): whole k-tiles
  return {tile, split, split * p.split_len / 64, min(p.K, (split + 1) * p.split_len) / 64};
}

__device__ __forceinline__ int num_items(const Projection& p) {
  return (p.N + DECODE_BLOCK_TILE_N - 1) / DECODE_BLOCK_TILE_N * num_splits(p);
}

// This lane's words of k-tiles kt0 .. kt0 + kTiles - 1 (those before kt_end) of column n
// (zeros past N or kt_end). Each weight word is read once a launch; with EVICT_FIRST
// under L2's evict-first policy (common.cuh's ldg_evict_first; REPRISE_WEIGHTS_EVICT_FIRST
// =0 turns it off, a benchmark's comparison), so the weights streaming past leave L2 to
// what the step reads again: the next step's KV pages above all.
template <bool PACKED, bool EVICT_FIRST>
__device__ __forceinline__ void load_batch(const Projection& p, int n, int kt0, int kt_end, Batch& w) {
  const int t = static_cast<int>(threadIdx.x) % 4;
  const unsigned short* w_row = weight_row<PACKED>(p.w, min(n, p.N - 1), p.K);
  constexpr bool kEvictFirst = EVICT_FIRST && REPRISE_WEIGHTS_EVICT_FIRST;
  const unsigned long long policy = kEvictFirst ? l2_evict_first_policy() : 0ull;
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool ok = n < p.N && kt0 + i < kt_end;
        const unsigned* word = reinterpret_cast<const unsigned*>(w_row + weight_offset<PACKED>(n, kt0 + i, s, h, t));
        if constexpr (kEvictFirst) w.b[i][s][h] = ok ? ldg_evict_first(word, policy) : 0u;
        else w.b[i][s][h] = ok ? __ldg(word) : 0u;
      }
}

// The lane's column of B in a tile: warp w takes columns 8w .. 8w + 7, lane l column l / 4.
__device__ __forceinline__ int lane_column(int tile) {
  return tile * DECODE_BLOCK_TILE_N + static_cast<int>(threadIdx.x) / 32 * 8 + static_cast<int>(threadIdx.x) % 32 / 4;
}

// The first round of this CTA's first item of `p` (none: zeros), loaded ahead of the
// phase, while the CTA still waits: before the launch's PDL wait for the first projection
// (a weight never changes, so the kernel before may still run), before the grid barrier
// ahead of each other one. So a phase's first weight round trip overlaps the wait.
template <bool PACKED, bool EVICT_FIRST>
__device__ __forceinline__ Batch first_batch(const Projection& p) {
  Batch w;
  const int item = static_cast<int>(blockIdx.x);
  if (p.w == nullptr || item >= num_items(p)) {  // no item: nothing to load
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int s = 0; s < 4; ++s) w.b[i][s][0] = w.b[i][s][1] = 0u;
    return w;
  }
  const Item it = item_of(p, item);
  load_batch<PACKED, EVICT_FIRST>(p, lane_column(it.tile), it.kt_begin, it.kt_end, w);
  return w;
}

// This CTA's items of one projection: item i = (tile i / S, split i % S), items
// blockIdx.x, blockIdx.x + gridDim.x, ... . x: the CTA's shared copy of the M rows, `lda`
// halves apart. first: first_batch(p), the first round of its first item. ws: [S, M, N]
// fp32 partials; counters: a zero per tile, left zero; flag: a shared word.
// Returns (LAST_FOLDS) a mask of the CTA's items whose tile's product it finished: bit j
// for its j-th item (blockIdx.x + j gridDim.x; the first 32), set where S = 1 or where it
// folded the tile, so the caller can run what needs a whole tile at once (step 5's rope).
template <bool PACKED, bool EVICT_FIRST, bool LAST_FOLDS>
__device__ __forceinline__ unsigned gemv_phase(const unsigned short* x, int lda, int M, const Projection& p,
                                               const Batch& first, float* __restrict__ ws,
                                               unsigned* __restrict__ counters, unsigned* flag) {
  const int splits = num_splits(p);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const unsigned short* row_lo = x + g * lda;  // A rows g and g + 8 (zero past M)
  const unsigned short* row_hi = x + (g + 8) * lda;
  bool preloaded = true;
  unsigned finished = 0u, bit = 1u;
  for (int item = static_cast<int>(blockIdx.x); item < num_items(p); item += static_cast<int>(gridDim.x), bit <<= 1) {
    const Item it = item_of(p, item);
    const int col0 = it.tile * DECODE_BLOCK_TILE_N + warp * 8;  // the warp's slice
    const int n = lane_column(it.tile);                           // the lane's column of B
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int kt0 = it.kt_begin; kt0 < it.kt_end; kt0 += kTiles) {
      Batch w;
      if (preloaded) w = first;
      else load_batch<PACKED, EVICT_FIRST>(p, n, kt0, it.kt_end, w);
      preloaded = false;
      if (col0 >= p.N) continue;  // warp-uniform: a slice wholly past N computes nothing
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        if (kt0 + i >= it.kt_end) break;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int k = (kt0 + i) * 64 + 16 * s;
          unsigned a[4];
          a[0] = g < M ? shared_pair(row_lo, k + 2 * t) : 0u;
          a[1] = g + 8 < M ? shared_pair(row_hi, k + 2 * t) : 0u;
          a[2] = g < M ? shared_pair(row_lo, k + 8 + 2 * t) : 0u;
          a[3] = g + 8 < M ? shared_pair(row_hi, k + 8 + 2 * t) : 0u;
          mma_bf16_16816(d, a, w.b[i][s][0], w.b[i][s][1]);
        }
      }
    }
    // d[0], d[1]: row g, columns col0 + 2t, +1; d[2], d[3]: row g + 8.
    const int col = col0 + 2 * t;
    if (splits == 1) {
      const bool vec = p.N % 2 == 0;
      if (col < p.N) {
        if (g < M) store_pair(p.y, static_cast<long long>(g) * p.N + col, d[0], d[1], col + 1 < p.N, vec);
        if (g + 8 < M) store_pair(p.y, static_cast<long long>(g + 8) * p.N + col, d[2], d[3], col + 1 < p.N, vec);
      }
    } else {
      float* slab = ws + static_cast<long long>(it.split) * M * p.N;
      if (col < p.N) {
        if (g < M) store_pair(slab, static_cast<long long>(g) * p.N + col, d[0], d[1], col + 1 < p.N, false);
        if (g + 8 < M) store_pair(slab, static_cast<long long>(g + 8) * p.N + col, d[2], d[3], col + 1 < p.N, false);
      }
      if constexpr (LAST_FOLDS)
        fold_split_partials<DECODE_BLOCK_MAX_ROWS, DECODE_BLOCK_TILE_N, PERSIST_THREADS>(
            ws, p.y, counters, M, p.N, p.K, p.split_len, 0, it.tile, flag);
    }
    // the tile's product is final here if S = 1, or if this CTA folded it (the flag
    // fold_split_partials left: no thread writes it again before the next item's fold has
    // met every thread at its barrier)
    if constexpr (LAST_FOLDS)
      if (splits == 1 || *flag != 0u) finished |= bit;
  }
  return finished;
}

// Element (m, c) of a projection's product as its BF16 bits, after the grid barrier that
// follows the projection: the value its item stored (S = 1), or its S partials from ws
// folded here (fold_partials_of, the split routes' own arithmetic: from +0 in ascending
// split order) and rounded once, as store_folded rounds. Every CTA that needs an element
// folds it itself, so no CTA waits for a tile's last one to fold it.
__device__ __forceinline__ unsigned short product_at(const Projection& p, const float* ws, int M, int m, int c) {
  const int splits = num_splits(p);
  const long long at = static_cast<long long>(m) * p.N + c, slab = static_cast<long long>(M) * p.N;
  if (splits == 1) return __ldcg(p.y + at);
  const Folded<1> f = fold_partials_of<1>(splits, [&](int s, int) { return __ldcg(ws + s * slab + at); });
  return static_cast<unsigned short>(bf16_bits(f.sums[0]));
}

// The partials' room in ws that gemv_phase writes: [S, M, N] fp32 (none for S = 1).
__device__ __forceinline__ long long partial_floats(const Projection& p, int M) {
  const int splits = num_splits(p);
  return splits == 1 ? 0LL : static_cast<long long>(splits) * M * p.N;
}

// The next layer's head, run in the same launch where it is bias-free (its w_qkv
// non-null): its qkv projection of the next norm's rows, then rope_kv_write of the product
// (`qkv`, [M, (heads + 2 kv_heads) head_dim] BF16, the launch's own). In decode_layers'
// launch, layer l's head writes the cache's layer rope.layer + l, and its queries to
// q_work before the last layer.
struct NextHead {
  unsigned short* qkv;
  int split_qkv;
  RopeKvArgs rope;
  __nv_bfloat16* q_work;
};

// A layer's weights: decode_tail's, its launch's arguments; decode_layers', row l of a
// table in global memory (decode_block_kernel.layer_table: six device addresses a row,
// in the order of `Weight`), each read where its phase needs it, so no register holds
// them across the layer. w_qkv is the next layer's (null: no head in this launch).
enum Weight { kO, kGateUp, kDown, kQkv, kMlpNorm, kNextNorm };

struct ParamWeights {
  const void* w[6];
};
__device__ __forceinline__ const void* weight_of(const ParamWeights& w, Weight i) { return w.w[i]; }

struct TableWeights {
  const long long* table;
  int layer;
};
__device__ __forceinline__ const void* weight_of(const TableWeights& w, Weight i) {
  return reinterpret_cast<const void*>(__ldg(w.table + 6 * w.layer + i));
}

template <class W>
__device__ __forceinline__ const unsigned short* matrix(const W& w, Weight i) {
  return static_cast<const unsigned short*>(weight_of(w, i));
}
template <class W>
__device__ __forceinline__ const __nv_bfloat16* norm_weight(const W& w, Weight i) {
  return static_cast<const __nv_bfloat16*>(weight_of(w, i));
}

// The layer's attention, for the decode_layer entry points: attention_tc.cu's launch on its
// planned split grid (attention_kernel.split_grid: gx x gy CTAs, head_parts, kv_lanes; the
// deep ring), its CTAs run here as virtual CTAs of 128 threads, two a CTA: half h of CTA b
// takes planned CTAs 2b + h, 2b + h + 2 gridDim.x, ... with its own ring and work item in
// shared memory (`attention_half_bytes` apart). The same kernel body on the same pages
// and the same split, so the same bits as the standalone launch (its chunk states and
// merge, its counters: "attention splits", left zero).
struct AttnArgs {
  unsigned short* out;  // [T, heads, head_dim] BF16: the tail's attn
  const unsigned short *q, *cache;
  const unsigned short* q_later;  // decode_layers: the queries of the launch's later layers
  const int *block_tables, *seq_lens, *query_start_loc;
  float* workspace;
  unsigned* counters;
  int num_tokens, num_seqs, max_blocks, num_heads, num_kv_heads, num_layers, layer, head_parts, kv_lanes, gx, gy;
  float scale;
  int window;  // the layers' sliding window (attention_tc.cuh's; 0: none)
  // NOTE: no soft cap (Gemma 2's): decode_block_kernel.layer_plan refuses a capped
  // attention, whose layer runs op by op; attention_phase passes the kernel a cap of 0.
};

template <int HEAD_DIM, int BLOCK_SIZE>
constexpr int attention_half_bytes() {
  return (Ring<HEAD_DIM, BLOCK_SIZE, deep_ring_stages(BLOCK_SIZE), true>::kSmemBytes + 15) / 16 * 16 +
         (static_cast<int>(sizeof(CtaWork)) + 15) / 16 * 16;
}

template <int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ void attention_phase(const AttnArgs& a, unsigned char* smem, int l) {
  using C = Ring<HEAD_DIM, BLOCK_SIZE, deep_ring_stages(BLOCK_SIZE), true>;
  static_assert(2 * kNumThreads == PERSIST_THREADS, "two virtual CTAs a persistent one");
  const int half = static_cast<int>(threadIdx.x) / kNumThreads;
  unsigned char* mine = smem + half * attention_half_bytes<HEAD_DIM, BLOCK_SIZE>();
  CtaWork* work = reinterpret_cast<CtaWork*>(mine + (C::kSmemBytes + 15) / 16 * 16);
  for (int c = 2 * static_cast<int>(blockIdx.x) + half; c < a.gx * a.gy; c += 2 * static_cast<int>(gridDim.x)) {
    const VirtualCta v{c % a.gx, c / a.gx, a.gx, a.gy, half, reinterpret_cast<unsigned short*>(mine), work};
    paged_attention_tc<HEAD_DIM, BLOCK_SIZE, deep_ring_stages(BLOCK_SIZE), true, true>(
        a.out, l ? a.q_later : a.q, a.cache, a.block_tables, a.seq_lens, a.query_start_loc, a.workspace,
        a.counters, a.num_tokens, a.num_seqs, a.max_blocks, a.num_heads, a.num_kv_heads, a.num_layers, a.layer + l,
        a.head_parts, a.kv_lanes,
        a.scale, a.window, /*softcap=*/0.0f, v);  // no cap (AttnArgs)
    // the half's threads are done with this virtual CTA (its work item, read up to its
    // merge's last call, and its ring) before thread 0 writes the next one's
    cta_sync<true>(v);
  }
}

// The tail's shared memory (decode_block_kernel.smem_bytes' first part): decode_layers
// keeps its carried rows past it and the attention's halves.
__device__ __forceinline__ int tail_smem_bytes(int M, int q_size, int hidden, int inter) {
  const int lda = max(max(q_size, hidden), inter) + 8;
  return 64 + 4 * ((hidden + 3) / 4 * 4) * (M + 1) + 2 * ((hidden + 7) / 8 * 8) * M + M * lda * 2;
}

// What the tail's launches pass alike: the products, outputs and scratch, the shapes.
// y_o, y_down [M, hidden] BF16 and gate_up [M, 2 inter] BF16: the launch's own products;
// summed [M, hidden] fp32 and normed [M, hidden] BF16 the outputs (normed not written with
// the next layer's head: its rows go straight into the qkv projection). gate_interleaved:
// gate_up's rows are (gate j, up j) pairs (the gated packing), else the gate rows, then
// the up rows. ws and counters: as gemv_phase's, for every projection; bar: grid_sync's
// two words (zero, left zero).
struct Tail {
  unsigned short *y_o, *gate_up, *y_down;
  float* summed;
  __nv_bfloat16* normed;
  float* ws;
  unsigned *counters, *bar;
  int M, q_size, hidden, inter, split_o, split_gate_up, split_down, gate_interleaved;
  float eps;
};

template <class W>
__device__ __forceinline__ Projection o_proj(const Tail& t, const W& w) {
  return {matrix(w, kO), t.y_o, t.hidden, t.q_size, t.split_o};
}

// The layer's tail (the file's head says how), after the attention: steps 1-5 of layer l
// of the launch (decode_layers'; decode_tail's: 0 of 1), the CTA's first round of o_proj's
// weight words already in `next`, `round` grid_round's. attn [M, q_size] BF16
// (ATTENTION_HERE: this launch's attention wrote it, so it is read through L2); residual
// [M, hidden] fp32 in global memory (l = 0), else the CTA's own shared copy, `carry`.
// Before the launch's last layer (l + 1 < layers), every CTA keeps all M rows of summed in
// carry for the next layer (the same function on the same values in every CTA: the same
// bits), summed is not written, and the head's queries go to head.q_work.
// ROOMY: the entry point's registers have room for the head's rope by tile (step 5, where
// its head_dim allows) and the evict-first weight loads (load_batch); the head_dim 128
// entry points, at 254 registers, spill with either.
// Dynamic shared memory (tail_smem_bytes): the flag and block_sum's scratch, a row of fp32
// sums no one reads, the M rows of summed1 (fp32), then the M rows of the step's input
// (BF16, lda halves apart).
template <bool PACKED, bool ATTENTION_HERE, bool ROOMY, class W>
__device__ __forceinline__ void tail_phases(const unsigned short* attn, const float* residual, const W& w,
                                            const Tail& t, const NextHead& head, Batch next, unsigned& round,
                                            int l, int layers, float* carry) {
  const int M = t.M, q_size = t.q_size, hidden = t.hidden, inter = t.inter;
  const Projection o = o_proj(t, w);
  unsigned char* const smem = block_smem();
  unsigned* const flag = reinterpret_cast<unsigned*>(smem);
  float* const scratch = reinterpret_cast<float*>(smem + 16);  // block_sum's, 8 floats
  const int row_floats = (hidden + 3) / 4 * 4;                 // 16-byte rows
  float* const unread = reinterpret_cast<float*>(smem + 64);   // sums no one reads
  float* const sums = unread + row_floats;                     // summed1's M rows
  const int lda = max(max(q_size, hidden), inter) + 8;         // halves: rows 16 bytes apart more
  const int row_halves = (hidden + 7) / 8 * 8;                  // 16-byte rows
  unsigned short* const deltas = reinterpret_cast<unsigned short*>(sums + M * row_floats);  // y rows
  unsigned short* const x = deltas + M * row_halves;
  // The partials of the projections whose consumers fold them (o, gate_up, down) take two
  // rooms of ws in turn, so a phase never writes the partials the phase before left:
  // o and down the first, gate_up (and qkv, which its tiles' last CTAs fold) the second.
  const Projection down_shape{nullptr, t.y_down, hidden, inter, t.split_down};
  float* const ws_a = t.ws;
  float* const ws_b = t.ws + max(partial_floats(o, M), partial_floats(down_shape, M));
  const int tid = static_cast<int>(threadIdx.x), me = static_cast<int>(blockIdx.x);
  const int G = static_cast<int>(gridDim.x);
  const bool carried = l + 1 < layers;

  // 1. o_proj over the attention rows (written by this launch's attention: through L2).
  for (int i = tid; i < M * (q_size / 2); i += PERSIST_THREADS) {
    const int m = i / (q_size / 2), k = 2 * (i % (q_size / 2));
    const unsigned short* from = attn + static_cast<long long>(m) * q_size + k;
    if constexpr (ATTENTION_HERE) {
      x[m * lda + k] = __ldcg(from);
      x[m * lda + k + 1] = __ldcg(from + 1);
    } else {
      *reinterpret_cast<unsigned*>(x + m * lda + k) = *reinterpret_cast<const unsigned*>(from);
    }
  }
  __syncthreads();
  gemv_phase<PACKED, ROOMY, false>(x, lda, M, o, next, ws_a, t.counters, flag);
  const Projection up{matrix(w, kGateUp), t.gate_up, 2 * inter, hidden, t.split_gate_up};
  next = first_batch<PACKED, ROOMY>(up);
  grid_sync(t.bar, round);

  // 2. o_proj's rows folded into shared memory, the residual add and the MLP's norm, every
  // CTA all rows (summed1 kept in its shared memory for 4.); then gate_up.
  for (int i = tid; i < M * hidden; i += PERSIST_THREADS)
    deltas[i / hidden * row_halves + i % hidden] = product_at(o, ws_a, M, i / hidden, i % hidden);
  __syncthreads();
  const int residual_stride = l ? row_floats : hidden;
  for (int m = 0; m < M; ++m) {
    add_rmsnorm_row(residual + static_cast<long long>(m) * residual_stride, SharedBf16{deltas + m * row_halves},
                    norm_weight(w, kMlpNorm), sums + m * row_floats, reinterpret_cast<__nv_bfloat16*>(x + m * lda),
                    hidden, t.eps, scratch);
    __syncthreads();  // every thread has read the row's sum before the next row's writes scratch
  }
  gemv_phase<PACKED, ROOMY, false>(x, lda, M, up, next, ws_b, t.counters, flag);
  const Projection down{matrix(w, kDown), t.y_down, hidden, inter, t.split_down};
  next = first_batch<PACKED, ROOMY>(down);
  grid_sync(t.bar, round);

  // 3. h = silu(gate) * up of gate_up's folded product, then down_proj.
  for (int i = tid; i < M * inter; i += PERSIST_THREADS) {
    const int m = i / inter, j = i % inter;
    const int gate_col = t.gate_interleaved ? 2 * j : j, up_col = t.gate_interleaved ? 2 * j + 1 : inter + j;
    const float gate = __uint_as_float(static_cast<unsigned>(product_at(up, ws_b, M, m, gate_col)) << 16);
    const float up_value = __uint_as_float(static_cast<unsigned>(product_at(up, ws_b, M, m, up_col)) << 16);
    x[m * lda + j] = static_cast<unsigned short>(bf16_bits(silu_mul_value(gate, up_value)));
  }
  __syncthreads();
  gemv_phase<PACKED, ROOMY, false>(x, lda, M, down, next, ws_a, t.counters, flag);
  const Projection qkv_proj{matrix(w, kQkv), head.qkv,
                            (head.rope.heads + 2 * head.rope.kv_heads) * head.rope.head_dim, hidden, head.split_qkv};
  next = first_batch<PACKED, ROOMY>(qkv_proj);  // zeros without the head
  grid_sync(t.bar, round);

  // 4. down_proj's rows folded into shared memory, the residual add and the next norm: row
  // m's outputs by CTA m % grid; with the next layer's head, every CTA all rows into its
  // shared memory, as in 2 (and before the launch's last layer, summed's rows too).
  for (int i = tid; i < M * hidden; i += PERSIST_THREADS)
    deltas[i / hidden * row_halves + i % hidden] = product_at(down, ws_a, M, i / hidden, i % hidden);
  __syncthreads();
  const __nv_bfloat16* const next_norm = norm_weight(w, kNextNorm);
  if (!qkv_proj.w) {
    for (int m = me; m < M; m += G) {
      const long long at = static_cast<long long>(m) * hidden;
      add_rmsnorm_row(sums + m * row_floats, SharedBf16{deltas + m * row_halves}, next_norm, t.summed + at,
                      t.normed + at, hidden, t.eps, scratch);
      __syncthreads();
    }
    return;
  }
  for (int m = 0; m < M; ++m) {
    const long long at = static_cast<long long>(m) * hidden;
    float* const to = carried ? carry + m * row_floats : m % G == me ? t.summed + at : unread;
    add_rmsnorm_row(sums + m * row_floats, SharedBf16{deltas + m * row_halves}, next_norm, to,
                    reinterpret_cast<__nv_bfloat16*>(x + m * lda), hidden, t.eps, scratch);
    __syncthreads();
  }

  // 5. the next layer's qkv projection (bias-free; its tiles' last CTAs fold them, since
  // each rope item needs only its own few elements), then its rope_kv_write, kvcache.cuh's
  // work item (the rope_kv_write kernel's own) reading the product through L2: a head a
  // tile, by the tile's finishing CTA; else every (row, head, pair) over the grid's
  // threads after a grid barrier.
  RopeKvArgs rope = head.rope;
  rope.layer += l;
  if (carried) rope.q_out = head.q_work;
  const unsigned finished = gemv_phase<PACKED, ROOMY, true>(x, lda, M, qkv_proj, next, ws_b, t.counters, flag);
  // A head a tile (head_dim 64, every item of the CTA's in finished's 32 bits): the CTA
  // that finished a tile's product writes its head (the rows it stored or folded, read
  // through L2), with no grid barrier before.
  const int half = rope.head_dim >> 1;
  const __nv_bfloat16* qkv = reinterpret_cast<const __nv_bfloat16*>(head.qkv);
  if (ROOMY && rope.head_dim == DECODE_BLOCK_TILE_N && num_items(qkv_proj) <= 32 * G) {
    const int splits = num_splits(qkv_proj);
    __syncthreads();  // every thread's stores of the CTA's tiles are done
    for (unsigned f = finished; f != 0u; f &= f - 1u) {
      const int tile = (me + (__ffs(f) - 1) * G) / splits;
      for (int e = tid; e < M * half; e += PERSIST_THREADS)
        rope_kv_write_head_pair<true>(qkv, qkv_proj.N, rope, e / half, tile, e % half);
    }
    return;
  }
  grid_sync(t.bar, round);
  const int per_row = (rope.heads + rope.kv_heads) * half;
  for (int item = me * PERSIST_THREADS + tid; item < M * per_row; item += G * PERSIST_THREADS) {
    const int r = item / per_row, pair = item % per_row;
    rope_kv_write_pair<true>(qkv, qkv_proj.N, rope, r, pair / half, pair % half);
  }
}

// The tail alone (decode_tail's entry points), after the attention's own launch: o_proj's
// first weight round loaded before the PDL wait (a weight never changes, so the kernel
// before may still run), then the steps.
template <bool PACKED>
__device__ __forceinline__ void decode_tail(const unsigned short* attn, const float* residual,
                                            const ParamWeights& w, const Tail& t, const NextHead& head) {
  const Batch next = first_batch<PACKED, true>(o_proj(t, w));
  pdl_enter();
  if (t.M < 1 || t.M > DECODE_BLOCK_MAX_ROWS) __trap();
  unsigned round = grid_round(t.bar);  // no CTA passes the first barrier before this one arrives
  tail_phases<PACKED, false, true>(attn, residual, w, t, head, next, round, 0, 1, nullptr);
}

// `layers` consecutive decode layers in one launch (decode_layer's entry points): layer l
// (the cache's layer attention.layer + l) runs its attention as virtual CTAs (step 0), a
// grid barrier, then its tail with its weights from table row l (TableWeights), the next
// layer's head included where the row has one (writing the cache's layer head.rope.layer
// + l). Before the last layer, the head's queries go to q_work (the next attention reads
// them through L2: VIRTUAL's query load), the residual stream stays in each CTA's shared
// memory (carry, past the attention's and the tail's regions, which the next layer
// overwrites), and a grid barrier ends the layer (the queries, keys and values written
// before the next attention reads them). The last layer writes what one layer's launch
// writes: summed, and normed or the queries (head.rope.q_out). So `layers` layers give the
// bits of `layers` one-layer launches in turn.
template <bool PACKED, int HEAD_DIM, int BLOCK_SIZE, bool LOOP>
__device__ __forceinline__ void decode_layers(const long long* __restrict__ table, int layers,
                                              const unsigned short* attn, const float* residual, const Tail& t,
                                              const NextHead& head, const AttnArgs& attention) {
  pdl_enter();
  if (t.M < 1 || t.M > DECODE_BLOCK_MAX_ROWS || (!LOOP && layers != 1)) __trap();
  unsigned round = grid_round(t.bar);  // no CTA passes the first barrier before this one arrives
  unsigned char* const smem = block_smem();
  for (int l = 0; l < (LOOP ? layers : 1); ++l) {
    const TableWeights w{table, l};
    attention_phase<HEAD_DIM, BLOCK_SIZE>(attention, smem, l);  // 0. the layer's attention, into attn
    constexpr bool kRoomy = HEAD_DIM == DECODE_BLOCK_TILE_N;
    const Batch next = first_batch<PACKED, kRoomy>(o_proj(t, w));
    grid_sync(t.bar, round);
    const int carry_at = (max(tail_smem_bytes(t.M, t.q_size, t.hidden, t.inter),
                              2 * attention_half_bytes<HEAD_DIM, BLOCK_SIZE>()) + 15) / 16 * 16;
    float* const carry = reinterpret_cast<float*>(smem + carry_at);
    tail_phases<PACKED, true, kRoomy>(attn, l ? carry : residual, w, t, head, next, round, l, layers, carry);
    if (l + 1 < layers) grid_sync(t.bar, round);  // the next layer's queries, keys and values are written
  }
}

}  // namespace

// The weights in the plain [N, K] layout (sm_80's) and in the Hopper GEMM's packed one.
// with_head = 0: the head's arguments are unused (any arrays). grid: the CTAs the device
// holds at once (a cooperative launch: decode_block_kernel.py), block = PERSIST_THREADS.
#define DECODE_TAIL_ARGS                                                                                          \
  const unsigned short *attn, const unsigned short *__restrict__ w_o,                                          \
      const unsigned short *__restrict__ w_gate_up, const unsigned short *__restrict__ w_down,                   \
      const float *__restrict__ residual, const __nv_bfloat16 *__restrict__ mlp_norm,                            \
      const __nv_bfloat16 *__restrict__ next_norm, unsigned short *__restrict__ y_o,                             \
      unsigned short *__restrict__ gate_up, unsigned short *__restrict__ y_down, float *__restrict__ summed,      \
      __nv_bfloat16 *__restrict__ normed, float *__restrict__ ws, unsigned *__restrict__ counters,               \
      unsigned *__restrict__ bar, int M, int q_size, int hidden, int inter, int split_o, int split_gate_up,      \
      int split_down, int gate_interleaved, float eps, int with_head, const unsigned short *__restrict__ w_qkv,   \
      unsigned short *__restrict__ qkv, int split_qkv, const int *__restrict__ positions,                        \
      const float *__restrict__ cos_table, const float *__restrict__ sin_table, __nv_bfloat16 *__restrict__ q_out, \
      const long long *__restrict__ slots, __nv_bfloat16 *__restrict__ cache, int layer, int num_layers,         \
      int heads, int kv_heads, int block_size, int head_dim
#define DECODE_TAIL_TAIL                                                                                        \
  {y_o, gate_up, y_down, summed, normed, ws, counters, bar, M, q_size, hidden, inter, split_o, split_gate_up,   \
   split_down, gate_interleaved, eps}
#define DECODE_TAIL_HEAD                                                                                        \
  {qkv, split_qkv,                                                                                              \
   {positions, cos_table, sin_table, q_out, slots, cache, layer, num_layers, heads, kv_heads, block_size,        \
    head_dim},                                                                                                  \
   nullptr}
#define DECODE_TAIL_WEIGHTS {{w_o, w_gate_up, w_down, with_head ? w_qkv : nullptr, mlp_norm, next_norm}}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_tail_plain(DECODE_TAIL_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_TAIL_HEAD;
  decode_tail<false>(attn, residual, ParamWeights DECODE_TAIL_WEIGHTS, tail, head);
}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_tail_packed(DECODE_TAIL_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_TAIL_HEAD;
  decode_tail<true>(attn, residual, ParamWeights DECODE_TAIL_WEIGHTS, tail, head);
}

// Layers: each one's attention (AttnArgs: attention_tc.cu's launch arguments, its planned
// split grid gx x gy), then its tail, `layers` of them in one launch (decode_layers; one:
// decode_block_kernel.decode_layer, more: decode_layers). table: their weights (six
// device addresses a row, Weight's order). A (head_dim, block size) of the models served:
// SmolLM2's 64 with 16- and 32-key blocks, Llama-3.1-8B's 128 with 32.
#define DECODE_LAYER_ARGS                                                                                        \
  const long long *__restrict__ table, int layers, const unsigned short *attn, const float *__restrict__ residual, \
      unsigned short *__restrict__ y_o, unsigned short *__restrict__ gate_up, unsigned short *__restrict__ y_down, \
      float *__restrict__ summed, __nv_bfloat16 *__restrict__ normed, float *__restrict__ ws,                    \
      unsigned *__restrict__ counters, unsigned *__restrict__ bar, int M, int q_size, int hidden, int inter,     \
      int split_o, int split_gate_up, int split_down, int gate_interleaved, float eps,                           \
      unsigned short *__restrict__ qkv, int split_qkv, const int *__restrict__ positions,                        \
      const float *__restrict__ cos_table, const float *__restrict__ sin_table, __nv_bfloat16 *q_out,             \
      __nv_bfloat16 *q_work, const long long *__restrict__ slots, __nv_bfloat16 *cache, int head_layer,           \
      int num_layers, int heads, int kv_heads, int block_size, int head_dim, const unsigned short *q,             \
      const int *__restrict__ block_tables, const int *__restrict__ seq_lens,                                     \
      const int *__restrict__ query_start_loc, float *__restrict__ attn_ws, unsigned *__restrict__ attn_counters, \
      int num_seqs, int max_blocks, int attn_layer, int head_parts, int kv_lanes, int attn_gx, int attn_gy,      \
      float scale, int window
#define DECODE_LAYER_HEAD                                                                                       \
  {qkv, split_qkv,                                                                                              \
   {positions, cos_table, sin_table, q_out, slots, cache, head_layer, num_layers, heads, kv_heads, block_size,   \
    head_dim},                                                                                                  \
   q_work}
#define DECODE_LAYER_ATTENTION                                                                                  \
  {const_cast<unsigned short*>(attn), q, reinterpret_cast<const unsigned short*>(cache),                       \
   reinterpret_cast<const unsigned short*>(q_work), block_tables, seq_lens, query_start_loc, attn_ws,           \
   attn_counters, M, num_seqs, max_blocks, heads, kv_heads, num_layers, attn_layer, head_parts, kv_lanes,       \
   attn_gx, attn_gy, scale, window}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_layer_plain_d64_b16(DECODE_LAYER_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_LAYER_HEAD;
  const AttnArgs attention DECODE_LAYER_ATTENTION;
  decode_layers<false, 64, 16, true>(table, layers, attn, residual, tail, head, attention);
}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_layer_plain_d64_b32(DECODE_LAYER_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_LAYER_HEAD;
  const AttnArgs attention DECODE_LAYER_ATTENTION;
  decode_layers<false, 64, 32, true>(table, layers, attn, residual, tail, head, attention);
}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_layer_plain_d128_b32(DECODE_LAYER_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_LAYER_HEAD;
  const AttnArgs attention DECODE_LAYER_ATTENTION;
  decode_layers<false, 128, 32, false>(table, layers, attn, residual, tail, head, attention);
}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_layer_packed_d64_b16(DECODE_LAYER_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_LAYER_HEAD;
  const AttnArgs attention DECODE_LAYER_ATTENTION;
  decode_layers<true, 64, 16, true>(table, layers, attn, residual, tail, head, attention);
}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_layer_packed_d64_b32(DECODE_LAYER_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_LAYER_HEAD;
  const AttnArgs attention DECODE_LAYER_ATTENTION;
  decode_layers<true, 64, 32, true>(table, layers, attn, residual, tail, head, attention);
}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS) decode_layer_packed_d128_b32(DECODE_LAYER_ARGS) {
  const Tail tail DECODE_TAIL_TAIL;
  const NextHead head DECODE_LAYER_HEAD;
  const AttnArgs attention DECODE_LAYER_ATTENTION;
  decode_layers<true, 128, 32, false>(table, layers, attn, residual, tail, head, attention);
}
