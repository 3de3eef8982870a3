// Linear layers: y[M, N] = x[M, K] @ w[N, K]^T on tensor cores (twin: gemm.py).
//
// x and w are BF16 (uint16 bit patterns), row-major, w in the Hugging Face
// [out_features, in_features] layout; y is BF16 (round to nearest even of the fp32
// accumulator) or fp32 (lm_head logits). Products run on
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 with fp32 accumulation.
//
// One templated kernel, instantiated for a few tile shapes the launcher picks by M
// (gemm_kernel.py's CONFIGS mirror the instantiations at the end of this file):
//   CTA tile BM x BN, warps WARPS_M x WARPS_N each owning a WM x WN sub-tile, K
//   walked in tiles of BK through a STAGES-deep ring of shared-memory buffers
//   filled by 16-byte cp.async (zero-filled past N and K; x rows past M zeroed once), fragments read with
//   ldmatrix. Shared rows are BK + 8 halves long, so the eight 16-byte rows an
//   ldmatrix phase reads fall in eight different bank groups.
//
// NOTE: the invariance argument (DESIGN §4). Output element y[m, n] lives in one
// accumulator register of one thread of one CTA; nothing else ever adds into it.
//   1. That accumulator starts at +0.0f and takes exactly one mma per 16-wide K
//      slice s = 0, 1, ..., K/16 - 1, in ascending order: k-tiles ascend in the
//      main loop, slices ascend inside a k-tile, and slices at or past K are
//      skipped, never padded. BK only regroups this one sequence; there is no
//      split-K and no reduction across threads, warps or CTAs.
//   2. In the mma of slice s, the element's row of A is x[m, 16s : 16s+16] and its
//      column of B is w[n, 16s : 16s+16], copied bit for bit from global memory
//      (by cp.async or, for unaligned pointers, by plain loads: only the route
//      differs). The fragment's other rows and columns, companion rows or zero
//      padding, do not enter this element's dot product.
//   3. The mma's arithmetic for one element (its 16 products and their sum with
//      the accumulator) is fixed hardware behaviour, the same at every row and
//      column position of the fragment (tests/test_gpu_gemm.py checks it: rows
//      land at every fragment position across its calls).
//   Zero padding past M or N only fills other rows and columns of a fragment.
//   4. The epilogue rounds once, with __float2bfloat16_rn, or stores fp32 as is.
// So y[m, n] is a function of x[m, :], w[n, :] and K alone: the same bits for
// every M, row offset, companion rows, tile configuration and pointer alignment.
//
// Split-K (gemm_kernel.split_k picks S per weight shape (N, K), never per M). With
// S > 1 the K slices are cut into S contiguous splits of `split_len` elements (a
// multiple of every tile's BK, so no k-tile straddles two), and the sequence of 1.
// becomes: partial P_s = its own accumulator from +0.0f over split s's slices in
// ascending order (as 1.-3. above), then y = (((0.0f + P_0) + P_1) + ...) + P_{S-1},
// fp32 adds in ascending s, then 4. Two routes compute exactly that sequence:
//   PARTIAL (the skinny tile, small M): CTA (m tile, split s) writes P_s as fp32 to a
//     workspace slab s and counts itself in its tile's counter (an integer atomic); the
//     CTA that counts last folds the tile's S slabs in ascending s per element, writes
//     y and zeroes the counter for the next launch (`skinny_split`).
//   FOLD (mid and big tiles): one CTA walks all of K; at each split boundary it adds
//     its accumulator into a running total (total += acc; acc = 0) and stores the total.
// Both run the same mma sequence per partial and the same fp32 adds in the same order,
// so a row's bits still do not depend on M or on the route. S = 1 runs neither: the
// WHOLE kernels (1.-4. as stated), on every route. No float atomics anywhere.
//
// Grouped (mixture-of-experts) GEMM, moe_gemm_bf16_*: for E experts' weights w [E, N, K]
// (contiguous) and grouped rows x [R, K] whose rows offsets[e] .. offsets[e + 1] are
// expert e's (moe.cu's routing; offsets [E + 1] int32, read on the device), y [R, N] BF16,
// rows of expert e = x rows times w[e]^T. The routing also numbered the experts' m tiles
// of BM rows (tile_starts [E + 1]: expert e's tiles are tile_starts[e] ..
// tile_starts[e + 1], ceil(rows / BM) of them), so only CTAs with rows to compute run:
// grid (a bound on the tiles, ceil(N / BN)), the bound floor((R + min(E, R) (BM - 1)) /
// BM) a function of R, E and BM. CTA (c, n tile) exits at once past tile_starts[E], else
// finds by binary search the expert whose tiles hold c and runs the WHOLE tile above, m
// tile c - tile_starts[e], on the
// expert's slice as a GEMM of its own (x + offsets[e] * K, w + e * N * K, y + offsets[e] *
// N, M = its row count). So 1.-4. hold for every grouped row as stated: y[r, n] is a
// function of x[r, :], w[e, n, :] and K alone, whatever rows share the expert, where the
// slice starts (the row offset and the pointer alignment, neither of which reaches a bit)
// and the tile the launcher picks. Never split-K: the grouped rows are only comparable
// with each other and the M = 1 grouped call, not with gemm_kernel.gemm of a weight whose
// shape splits K. The grid depends on R, N, E and the tile alone, never on the routing,
// so a captured CUDA graph replays it for any routing.
#include "common.cuh"  // the PTX wrappers (cp.async, ldmatrix, mma.sync), bf16_bits, store_pair

// x rows past M: 1, the default, zeros written once (zero_rows_past_m); 0 zero-filled by
// every k-tile's copies, as before 2026-11-27 (built by the launcher for bench_gemm_sm90's
// same-run baseline only, gemm_kernel.PAD_ONCE). The same bits either way.
#ifndef REPRISE_GEMM_PAD_ONCE
#define REPRISE_GEMM_PAD_ONCE 1
#endif

namespace {

constexpr int SMEM_PAD = 8;  // halves added to each shared row: 16 bytes

// ---- the kernel ---------------------------------------------------------------------

template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_;
  static constexpr int WARPS_M = BM / WM, WARPS_N = BN / WN;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int M_FRAGS = WM / 16;  // m16 fragments per warp
  static constexpr int N_FRAGS = WN / 8;   // n8 fragments per warp
  static constexpr int LDS = BK + SMEM_PAD;  // shared row stride, halves
  static constexpr int CHUNKS_PER_ROW = BK / 8;  // 16-byte chunks per tile row
  static constexpr int A_CHUNKS = BM * CHUNKS_PER_ROW, B_CHUNKS = BN * CHUNKS_PER_ROW;
  static constexpr int STAGE_HALVES = (BM + BN) * LDS;  // x tile, then w tile
  static constexpr int SMEM_BYTES = STAGES * STAGE_HALVES * 2;

  static_assert(BM % WM == 0 && BN % WN == 0, "warp tiles must cover the CTA tile");
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile: m16 fragments, n16 pairs for ldmatrix.x4");
  static_assert(BK % 16 == 0, "BK must be a whole number of k16 slices");
  static_assert(A_CHUNKS % THREADS == 0 && B_CHUNKS % THREADS == 0, "every thread copies alike");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert((LDS * 2) % 16 == 0 && ((LDS * 2 / 16) & 1) == 1,
                "16-byte aligned rows an odd number of 16-byte units apart: conflict-free ldmatrix");
};

// One operand's rows of k-tile `k0` (x: rows [m0, m0 + BM) into the stage's first BM rows;
// w: rows [n0, n0 + BN) after them), `ROWS` of them, of the operand's `num_rows`. Chunks
// past num_rows or K are zero-filled; with skip_past (x), rows past num_rows are not
// touched: they hold the zeros zero_rows_past_m wrote once (at a decode's M = 1, 15 of the
// skinny tile's 16). Thread t copies the 16-byte column t % CHUNKS_PER_ROW of rows
// t / CHUNKS_PER_ROW + i * (THREADS / CHUNKS_PER_ROW): the chunks t + i * THREADS of the
// row-major chunk order, as before 2026-11-27, each found now by one add, in unsigned
// arithmetic, on a route (`VEC`: cp.async, or plain loads and a 16-byte store for operands
// off 16-byte alignment) taken once for all the tile's copies, not per copy.
template <class T, int ROWS, bool VEC>
__device__ __forceinline__ void load_rows(unsigned short* dst0, const unsigned short* __restrict__ src0,
                                          int num_rows, int K, int r0, int k0, bool skip_past) {
  constexpr int kRowStep = T::THREADS / T::CHUNKS_PER_ROW;  // rows a round of copies covers
  static_assert(T::THREADS % T::CHUNKS_PER_ROW == 0 && ROWS % kRowStep == 0, "whole rounds");
  const unsigned tid = threadIdx.x;
  const int col = static_cast<int>(tid % T::CHUNKS_PER_ROW) * 8;
  const int row0 = static_cast<int>(tid / T::CHUNKS_PER_ROW);
  const int k = k0 + col;
  const bool k_ok = k < K;
#pragma unroll
  for (int i = 0; i < ROWS / kRowStep; ++i) {
    const int row = row0 + i * kRowStep;
    const int g_row = r0 + row;
    if (skip_past && g_row >= num_rows) continue;
    const bool valid = g_row < num_rows && k_ok;
    // NOTE: an invalid chunk still gets an in-bounds address (the operand's first
    // element); cp.async with src-size 0 reads none of it.
    const unsigned short* src = src0 + (valid ? static_cast<long long>(g_row) * K + k : 0LL);
    unsigned short* dst = dst0 + row * T::LDS + col;
    if (VEC) {
      cp_async_16(shared_addr(dst), src, valid);
    } else {
      unsigned v[4] = {0u, 0u, 0u, 0u};
      if (valid) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          v[j] = static_cast<unsigned>(src[2 * j]) | (static_cast<unsigned>(src[2 * j + 1]) << 16);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

// Copy k-tile `kt` of x rows [m0, m0 + BM) and w rows [n0, n0 + BN) into one stage
// (load_rows: x rows past M are the zeros written once, unless REPRISE_GEMM_PAD_ONCE is 0).
template <class T>
__device__ __forceinline__ void load_tile(unsigned short* stage, const unsigned short* __restrict__ x,
                                          const unsigned short* __restrict__ w, int M, int N, int K,
                                          int m0, int n0, int kt, bool vec) {
  const int k0 = kt * T::BK;
  const bool skip_past = REPRISE_GEMM_PAD_ONCE;
  if (vec) {
    load_rows<T, T::BM, true>(stage, x, M, K, m0, k0, skip_past);
    load_rows<T, T::BN, true>(stage + T::BM * T::LDS, w, N, K, n0, k0, false);
  } else {
    load_rows<T, T::BM, false>(stage, x, M, K, m0, k0, skip_past);
    load_rows<T, T::BN, false>(stage + T::BM * T::LDS, w, N, K, n0, k0, false);
  }
}

// The x rows of the tile at m0 past M, zeros in every stage, written once before the
// pipeline starts (load_tile never copies them; the main loop's first barrier orders
// these stores before any fragment read). A padding row enters no other row's sum and
// is never stored, so this changes no bit; it saves the per-k-tile zero-fills.
template <class T>
__device__ __forceinline__ void zero_rows_past_m(unsigned short* smem, int M, int m0) {
  const int rows_here = min(T::BM, M - m0);
  const int per_stage = (T::BM - rows_here) * T::CHUNKS_PER_ROW;
  for (int c = static_cast<int>(threadIdx.x); c < T::STAGES * per_stage; c += T::THREADS) {
    const int stage = c / per_stage, rest = c % per_stage;
    const int row = rows_here + rest / T::CHUNKS_PER_ROW, chunk = rest % T::CHUNKS_PER_ROW;
    *reinterpret_cast<uint4*>(smem + stage * T::STAGE_HALVES + row * T::LDS + chunk * 8) =
        make_uint4(0u, 0u, 0u, 0u);
  }
}

enum class Split { WHOLE, PARTIAL, FOLD };  // see the split-K note at the top

// x: [M, K], w: [N, K] BF16 bits; y: [M, N] (OutT = unsigned short for BF16 bits, or
// float). block = THREADS, dynamic shared memory = SMEM_BYTES, K % 16 == 0 (the
// launcher checks). WHOLE and FOLD: grid = (ceil(M / BM), ceil(N / BN)). PARTIAL:
// grid = (ceil(M / BM) * S, ceil(N / BN)), blockIdx.x = s * ceil(M / BM) + m tile, and
// y is the fp32 workspace [S, M, N]. `split_len` (PARTIAL, FOLD) is a positive multiple
// of BK; WHOLE ignores it.
// Accumulator elements a thread holds: FOLD's running total has one slot for each.
template <class T>
constexpr int kFoldSlots = T::M_FRAGS * T::N_FRAGS * 4;

template <class T, Split MODE, class OutT>
__device__ __forceinline__ void gemm_tile(const unsigned short* __restrict__ x,
                                          const unsigned short* __restrict__ w, OutT* __restrict__ y,
                                          int M, int N, int K, int split_len, int m_tile_given = -1) {
  extern __shared__ __align__(16) unsigned short gemm_smem[];
  // NOTE: the launcher mirrors THREADS and SMEM_BYTES (and split_len's granule); a
  // mismatch must fail loudly, not read past the shared buffer or mis-split K.
  if (blockDim.x != T::THREADS || dynamic_smem_bytes() < static_cast<unsigned>(T::SMEM_BYTES))
    __trap();
  if (MODE != Split::WHOLE && (split_len <= 0 || split_len % T::BK != 0)) __trap();

  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int warp_m = warp / T::WARPS_N, warp_n = warp % T::WARPS_N;
  const int num_m_tiles = (M + T::BM - 1) / T::BM;
  // (the grouped GEMM gives its CTA's m tile within its expert's rows)
  const int m_tile = m_tile_given >= 0               ? m_tile_given
                     : MODE == Split::PARTIAL ? static_cast<int>(blockIdx.x) % num_m_tiles
                                              : static_cast<int>(blockIdx.x);
  const int m0 = m_tile * T::BM, n0 = static_cast<int>(blockIdx.y) * T::BN;
  // This CTA's k-tiles [kt_begin, kt_end) and its K end (the split's, or K itself).
  int kt_begin = 0, k_end = K;
  if (MODE == Split::PARTIAL) {
    const int split = static_cast<int>(blockIdx.x) / num_m_tiles;
    kt_begin = split * (split_len / T::BK);
    k_end = min(K, (split + 1) * split_len);
    y += static_cast<long long>(split) * M * N;  // this split's slab of the workspace
  }
  const int kt_end = (k_end + T::BK - 1) / T::BK;
  const int num_k_tiles = kt_end - kt_begin;
  // Row strides are K * 2 bytes, a multiple of 32 (K % 16 == 0): aligned bases keep
  // every 16-byte chunk aligned.
  const unsigned long long in_bits =
      reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w);
  const bool vec_in = (in_bits & 15ull) == 0;

  float acc[T::M_FRAGS][T::N_FRAGS][4];
#pragma unroll
  for (int i = 0; i < T::M_FRAGS; ++i)
#pragma unroll
    for (int j = 0; j < T::N_FRAGS; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;
  // FOLD's running total over finished splits (unused otherwise: the compiler drops it).
  // NOTE: it lives in this thread's local memory (L1), not in registers: touched only
  // at the S - 1 split boundaries and once at the end, while a second register set for
  // it cost the big tile 165 registers instead of 113, one CTA per SM instead of two,
  // and 1.8x the time on the H100 (bench/results/2026-11-26-h100-run1). `volatile`
  // keeps it out of registers (every access a local load or store); the arithmetic
  // (fp32 adds in ascending split order) is the same wherever the total is held.
  volatile float total[kFoldSlots<T>];
  if (MODE == Split::FOLD) {
#pragma unroll
    for (int e = 0; e < kFoldSlots<T>; ++e) total[e] = 0.0f;
  }

  if (REPRISE_GEMM_PAD_ONCE) zero_rows_past_m<T>(gemm_smem, M, m0);

  // Pipeline: before consuming the t-th k-tile, tiles up to t + STAGES - 2 are in flight.
  // One commit per tile slot (empty past the end) keeps the group count uniform.
#pragma unroll
  for (int s = 0; s < T::STAGES - 1; ++s) {
    if (s < num_k_tiles)
      load_tile<T>(gemm_smem + s * T::STAGE_HALVES, x, w, M, N, K, m0, n0, kt_begin + s, vec_in);
    cp_async_commit();
  }

  // FOLD walks K one split at a time (kt_begin is 0: splits end at multiples of
  // split_len / BK tiles), with the fold between splits, so the k-tile loop itself has
  // no split test: per k-tile, FOLD runs exactly the WHOLE kernel's code. WHOLE and
  // PARTIAL make one pass over their tiles.
  const int pass_tiles = MODE == Split::FOLD ? split_len / T::BK : num_k_tiles;
  for (int t = 0; t < num_k_tiles;) {
    const int pass_end = min(num_k_tiles, t + pass_tiles);
    for (; t < pass_end; ++t) {
      const int kt = kt_begin + t;
      cp_async_wait<T::STAGES - 2>();  // this thread's copies of tile t have landed
      // Every thread's copies of tile t are visible, and every warp has finished
      // reading tile t - 1, whose buffer the next load overwrites.
      __syncthreads();
      const int next = t + T::STAGES - 1;
      if (next < num_k_tiles)
        load_tile<T>(gemm_smem + (next % T::STAGES) * T::STAGE_HALVES, x, w, M, N, K, m0, n0,
                     kt_begin + next, vec_in);
      cp_async_commit();

      const unsigned short* sa = gemm_smem + (t % T::STAGES) * T::STAGE_HALVES;
      const unsigned short* sb = sa + T::BM * T::LDS;
      // k16 slice ks of the tile: its fragments, then its mmas
      auto slice = [&](int ks) {
        // A fragment (see mma_bf16_16816): a[0] rows 0-7 / k 0-7,
        // a[1] rows 8-15 / k 0-7, a[2] rows 0-7 / k 8-15, a[3] rows 8-15 / k 8-15;
        // lane l points at row l % 16, k (l / 16) * 8 of the m16 x k16 block.
        unsigned a[T::M_FRAGS][4];
#pragma unroll
        for (int i = 0; i < T::M_FRAGS; ++i) {
          const int row = warp_m * T::WM + i * 16 + (lane & 15);
          ldmatrix_x4(a[i], shared_addr(sa + row * T::LDS + ks * 16 + (lane >> 4) * 8));
        }
        // B fragment (col layout, B[k][n] = w[n][k]): b0 = k 0-7, b1 = k 8-15 of column
        // n = lane / 4, i.e. 8x8 blocks of the [n][k] tile read without transposing.
        // One x4 covers two n8 fragments: matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
        // (n 8-15, k 0-7), (n 8-15, k 8-15); lane l points at n (l % 8) + (l / 16) * 8,
        // k ((l / 8) % 2) * 8.
        unsigned b[T::N_FRAGS][2];
#pragma unroll
        for (int p = 0; p < T::N_FRAGS / 2; ++p) {
          const int row = warp_n * T::WN + p * 16 + (lane & 7) + ((lane >> 4) << 3);
          unsigned r[4];
          ldmatrix_x4(r, shared_addr(sb + row * T::LDS + ks * 16 + ((lane >> 3) & 1) * 8));
          b[2 * p][0] = r[0];
          b[2 * p][1] = r[1];
          b[2 * p + 1][0] = r[2];
          b[2 * p + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < T::M_FRAGS; ++i)
#pragma unroll
          for (int j = 0; j < T::N_FRAGS; ++j) mma_bf16_16816(acc[i][j], a[i], b[j][0], b[j][1]);
      };
      // NOTE: the K tail is skipped, not zero-padded, so every tile shape runs the same
      // K/16 mmas per element (K % 16 == 0: slices are whole). A whole tile runs its
      // slices with no test between them, so one slice's fragment loads can be issued
      // ahead of the previous one's mmas; the same mmas in the same order either way.
      if (kt * T::BK + T::BK <= k_end) {
#pragma unroll
        for (int ks = 0; ks < T::BK / 16; ++ks) slice(ks);
      } else {
        for (int ks = 0; ks < T::BK / 16 && kt * T::BK + ks * 16 < k_end; ++ks) slice(ks);
      }
    }
    if (MODE == Split::FOLD) {
      // A split ends here: its partial joins the total, the next one starts from +0.
#pragma unroll
      for (int i = 0; i < T::M_FRAGS; ++i)
#pragma unroll
        for (int j = 0; j < T::N_FRAGS; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int e = (i * T::N_FRAGS + j) * 4 + r;
            total[e] = total[e] + acc[i][j][r];
            acc[i][j][r] = 0.0f;
          }
    }
  }
  cp_async_wait<0>();  // only empty groups remain; leave none behind
  if (MODE == Split::FOLD) {  // every split has joined the total, which is stored
#pragma unroll
    for (int i = 0; i < T::M_FRAGS; ++i)
#pragma unroll
      for (int j = 0; j < T::N_FRAGS; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][j][r] = total[(i * T::N_FRAGS + j) * 4 + r];
  }

  // C fragment: c[0], c[1] at row lane / 4, columns 2 * (lane % 4) and +1; c[2], c[3]
  // eight rows below. Rows >= M and columns >= N are never written.
  const bool vec_out =
      N % 2 == 0 && reinterpret_cast<unsigned long long>(y) % (2 * sizeof(OutT)) == 0;
  const int group = lane >> 2, pair = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < T::M_FRAGS; ++i) {
#pragma unroll
    for (int j = 0; j < T::N_FRAGS; ++j) {
      const int col = n0 + warp_n * T::WN + j * 8 + pair;
      if (col >= N) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + warp_m * T::WM + i * 16 + group + 8 * h;
        if (row < M)
          store_pair(y, static_cast<long long>(row) * N + col, acc[i][j][2 * h],
                     acc[i][j][2 * h + 1], col + 1 < N, vec_out);
      }
    }
  }
}

// Tile shapes; gemm_kernel.py's CONFIGS repeat these numbers (BM, BN, BK, stages, warps).
// Skinny streams the weight: 4 warps side by side along N, 128-wide k-tiles, 3 of its
// 4 stages (48 KiB of w) in flight per CTA, 2 CTAs an SM on sm_90 (shared memory).
using Skinny = Tile<16, 64, 128, 16, 16, 4>;  // M <= 16 (decode): 4 warps, 87,040 B shared (opt-in)
using Mid = Tile<64, 64, 32, 32, 32, 4>;      // M <= 64: 4 warps, 40,960 B shared
using Big = Tile<128, 128, 32, 64, 32, 4>;    // prefill: 8 warps, 81,920 B shared (opt-in)
static_assert(Skinny::THREADS == 128 && Mid::THREADS == 128 && Big::THREADS == 256, "launch bounds below");

// The skinny split route: this CTA's partial into the workspace, then, in the CTA that
// finishes its tile last, the fold of the tile's S partials in ascending split order
// (fold_split_partials in common.cuh, shared with gemm_sm90.cu). `counters` holds one
// zero per (n tile, m tile), blockIdx.y * ceil(M / BM) + m tile, and is left zero.
// S = ceil(K / split_len) (the launcher cuts K exactly so).
template <class OutT>
__device__ __forceinline__ void skinny_split(const unsigned short* __restrict__ x,
                                             const unsigned short* __restrict__ w, float* __restrict__ ws,
                                             OutT* __restrict__ y, unsigned* __restrict__ counters, int M,
                                             int N, int K, int split_len) {
  using T = Skinny;
  gemm_tile<T, Split::PARTIAL>(x, w, ws, M, N, K, split_len);
  extern __shared__ __align__(16) unsigned short gemm_smem[];
  const int m_tile = static_cast<int>(blockIdx.x) % ((M + T::BM - 1) / T::BM);
  // the flag word: the ring is drained (fold_split_partials syncs before writing it)
  fold_split_partials<T::BM, T::BN, T::THREADS>(ws, y, counters, M, N, K, split_len, m_tile,
                                                static_cast<int>(blockIdx.y), reinterpret_cast<unsigned*>(gemm_smem));
}

}  // namespace

// Entry points: x: [M, K], w: [N, K] BF16 bits, y: [M, N] (see gemm_tile). WHOLE (S = 1)
// writes y; FOLD (S > 1; mid and big) walks every split and writes y; *_skinny_split
// (S > 1; skinny) goes through the fp32 workspace ws [S, M, N] (skinny_split).

extern "C" __global__ void __launch_bounds__(128)
gemm_bf16_skinny(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, unsigned short* __restrict__ y,
                 int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Skinny, Split::WHOLE>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_f32_skinny(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, float* __restrict__ y,
                int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Skinny, Split::WHOLE>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_bf16_skinny_split(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                       float* __restrict__ ws, unsigned short* __restrict__ y, unsigned* __restrict__ counters,
                       int M, int N, int K, int split_len) {
  pdl_enter();
  skinny_split(x, w, ws, y, counters, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_f32_skinny_split(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                      float* __restrict__ ws, float* __restrict__ y, unsigned* __restrict__ counters, int M,
                      int N, int K, int split_len) {
  pdl_enter();
  skinny_split(x, w, ws, y, counters, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_bf16_mid(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, unsigned short* __restrict__ y,
              int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Mid, Split::WHOLE>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_f32_mid(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, float* __restrict__ y,
             int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Mid, Split::WHOLE>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_bf16_mid_fold(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, unsigned short* __restrict__ y,
                   int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Mid, Split::FOLD>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_f32_mid_fold(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, float* __restrict__ y,
                  int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Mid, Split::FOLD>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(256)
gemm_bf16_big(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, unsigned short* __restrict__ y,
              int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Big, Split::WHOLE>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(256)
gemm_f32_big(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, float* __restrict__ y,
             int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Big, Split::WHOLE>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(256)
gemm_bf16_big_fold(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, unsigned short* __restrict__ y,
                   int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Big, Split::FOLD>(x, w, y, M, N, K, split_len);
}

extern "C" __global__ void __launch_bounds__(256)
gemm_f32_big_fold(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, float* __restrict__ y,
                  int M, int N, int K, int split_len) {
  pdl_enter();
  gemm_tile<Big, Split::FOLD>(x, w, y, M, N, K, split_len);
}

// The grouped GEMM (the header's last paragraph).
namespace {
template <class T>
__device__ __forceinline__ void grouped_tile(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                             unsigned short* __restrict__ y, const int* __restrict__ offsets,
                                             const int* __restrict__ tile_starts, int num_experts, int tile_rows, int N,
                                             int K) {
  if (tile_rows != T::BM) __trap();  // the routing numbered tiles of another size
  const int cta = static_cast<int>(blockIdx.x);
  if (cta >= tile_starts[num_experts]) return;  // the whole CTA: no barrier passed yet
  // the expert whose tiles hold cta: tile_starts[lo] <= cta < tile_starts[hi] throughout
  // (tile_starts ascends from 0; an expert without rows has no tiles, start = next start)
  int lo = 0, hi = num_experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_starts[mid] <= cta) lo = mid;
    else hi = mid;
  }
  const int first_row = offsets[lo];
  gemm_tile<T, Split::WHOLE>(x + static_cast<long long>(first_row) * K, w + static_cast<long long>(lo) * N * K,
                             y + static_cast<long long>(first_row) * N, offsets[lo + 1] - first_row, N, K, 0,
                             cta - tile_starts[lo]);
}
}  // namespace

// Entry points: x: [R, K] grouped rows, w: [E, N, K], y: [R, N] BF16 bits, offsets and
// tile_starts: [E + 1] int32 (tiles of tile_rows = BM rows); grid (the tiles' bound,
// ceil(N / BN)).
extern "C" __global__ void __launch_bounds__(128)
moe_gemm_bf16_skinny(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                     unsigned short* __restrict__ y, const int* __restrict__ offsets,
                     const int* __restrict__ tile_starts, int num_experts, int tile_rows, int N, int K) {
  pdl_enter();
  grouped_tile<Skinny>(x, w, y, offsets, tile_starts, num_experts, tile_rows, N, K);
}

extern "C" __global__ void __launch_bounds__(128)
moe_gemm_bf16_mid(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                  unsigned short* __restrict__ y, const int* __restrict__ offsets,
                  const int* __restrict__ tile_starts, int num_experts, int tile_rows, int N, int K) {
  pdl_enter();
  grouped_tile<Mid>(x, w, y, offsets, tile_starts, num_experts, tile_rows, N, K);
}

extern "C" __global__ void __launch_bounds__(256)
moe_gemm_bf16_big(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                  unsigned short* __restrict__ y, const int* __restrict__ offsets,
                  const int* __restrict__ tile_starts, int num_experts, int tile_rows, int N, int K) {
  pdl_enter();
  grouped_tile<Big>(x, w, y, offsets, tile_starts, num_experts, tile_rows, N, K);
}
