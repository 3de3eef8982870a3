// Token selection on the device (twin: sampling.py).
//
// argmax: greedy choice per logits row, ties to the lowest id, as np.argmax.
// philox_uniform: the uniform draw keyed by (request seed, token position), with
// the same Philox4x32-10 integer arithmetic as the twin, so both backends draw
// bit-identical uniforms.
#include "common.cuh"

#define ARGMAX_THREADS 1024

// (value, id) pairs: the larger value wins, equal values go to the lower id.
__device__ __forceinline__ bool beats(float v, int i, float best_v, int best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

// The (value, id) pairs of a full warp combined by `beats` in a butterfly over lane
// distances 16, 8, 4, 2, 1 (the tree of common.cuh's warp_sum); lane 0 ends with the best.
__device__ __forceinline__ void warp_argmax(float& best_v, int& best_i) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best_v, offset);
    const int i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (beats(v, i, best_v, best_i)) { best_v = v; best_i = i; }
  }
}

// The best (value, id) of row[begin, end) by a block of THREADS threads: each thread
// walks its ids, then the warps' bests and the warps' meet in warp_argmax's butterfly.
// Thread 0 returns with the block's best (the others with their warp's or less).
// `no_id`: the id of no element, which loses to any real one.
template <int THREADS>
__device__ __forceinline__ void block_argmax(const float* __restrict__ row, int begin, int end, int no_id,
                                             float& best_v, int& best_i) {
  __shared__ float values[THREADS / 32];
  __shared__ int ids[THREADS / 32];
  best_v = negative_infinity();
  best_i = no_id;
  for (int i = begin + threadIdx.x; i < end; i += THREADS) {
    if (beats(row[i], i, best_v, best_i)) { best_v = row[i]; best_i = i; }
  }
  warp_argmax(best_v, best_i);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { values[warp] = best_v; ids[warp] = best_i; }
  __syncthreads();
  if (warp == 0) {
    best_v = lane < THREADS / 32 ? values[lane] : negative_infinity();
    best_i = lane < THREADS / 32 ? ids[lane] : no_id;
    warp_argmax(best_v, best_i);
  }
}

// logits: [rows, vocab] fp32 with `row_stride` elements between rows; out: [rows] int32.
// grid = rows, block = ARGMAX_THREADS.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax(const float* __restrict__ logits, long long row_stride, int vocab, int* __restrict__ out) {
  pdl_enter();
  float best_v;
  int best_i;
  block_argmax<ARGMAX_THREADS>(logits + blockIdx.x * row_stride, 0, vocab, vocab, best_v, best_i);
  // NOTE: a row of only NaN leaves best_i == vocab; fall back to id 0 as np.argmax would
  // not, but such a row means the model already failed.
  if (threadIdx.x == 0) out[blockIdx.x] = best_i < vocab ? best_i : 0;
}

#define ARGMAX_SPLIT_THREADS 256

// argmax of a decode step's few rows, each spread over gridDim.y CTAs (a row's one CTA
// reads the whole vocabulary alone: 10 µs at 49,152 ids inside an H200 decode graph).
// CTA (r, s) finds the best of ids [s * slice, (s + 1) * slice) as argmax finds a row's,
// leaves it in part_v / part_i[r * gridDim.y + s], and the CTA that counts last for row
// r (counters[r], left zero) takes the gridDim.y bests in ascending s by `beats`.
// The same id as argmax, by construction: `beats` orders (value, id) pairs strictly (the
// larger value, then the lower id) and a NaN never beats anything, so the best of the
// slices' bests is the row's best however the ids are cut, ties to the lowest id.
// grid = (rows, ceil(vocab / slice)), block = ARGMAX_SPLIT_THREADS.
extern "C" __global__ void __launch_bounds__(ARGMAX_SPLIT_THREADS)
argmax_split(const float* __restrict__ logits, long long row_stride, int vocab, int slice,
             float* __restrict__ part_v, int* __restrict__ part_i, unsigned* __restrict__ counters,
             int* __restrict__ out) {
  pdl_enter();
  __shared__ unsigned last;
  const int begin = blockIdx.y * slice, end = min(vocab, begin + slice);
  float best_v;
  int best_i;
  block_argmax<ARGMAX_SPLIT_THREADS>(logits + blockIdx.x * row_stride, begin, end, vocab, best_v, best_i);
  const long long at = static_cast<long long>(blockIdx.x) * gridDim.y;
  if (threadIdx.x == 0) {
    part_v[at + blockIdx.y] = best_v;
    part_i[at + blockIdx.y] = best_i;
    __threadfence();  // the best is visible device-wide before it is counted
    last = atomicAdd(counters + blockIdx.x, 1u) == gridDim.y - 1 ? 1u : 0u;
  }
  __syncthreads();
  if (last == 0u || threadIdx.x != 0) return;
  __threadfence();
  best_v = negative_infinity();
  best_i = vocab;
  for (unsigned s = 0; s < gridDim.y; ++s) {
    const float v = __ldcg(part_v + at + s);  // through L2: other CTAs wrote them
    const int i = __ldcg(part_i + at + s);
    if (beats(v, i, best_v, best_i)) { best_v = v; best_i = i; }
  }
  out[blockIdx.x] = best_i < vocab ? best_i : 0;
  counters[blockIdx.x] = 0u;  // the next launch, after this one in stream order, sees 0
}

// seeds: [n] uint64, positions: [n] int64 -> out: [n] fp32 uniforms in [0, 1) with 24 bits.
extern "C" __global__ void philox_uniform(const unsigned long long* __restrict__ seeds,
                                          const long long* __restrict__ positions,
                                          float* __restrict__ out, int n) {
  pdl_enter();
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const unsigned long long seed = seeds[idx];
  const unsigned long long pos = (unsigned long long)positions[idx];
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
  unsigned int c0 = (unsigned int)pos, c1 = (unsigned int)(pos >> 32), c2 = 0u, c3 = 0u;
  for (int round = 0; round < 10; ++round) {
    if (round) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
  }
  out[idx] = (float)(c0 >> 8) * (1.0f / 16777216.0f);
}

// Seeded sampling over rows already ranked (twin: sampling.sample_ref, from its sort on):
// sorted: [rows, vocab] fp32 scaled logits in rank order (descending, ties by id),
// ids: [rows, vocab] int32 the token of each rank; top_k: [rows] int32, the ranks kept
// (vocab for all); top_p, min_p: [rows] fp32 (min_p 0: no cut); uniforms: [rows] fp32,
// the Philox draw of the row; cum: [rows, vocab] fp32 scratch; out: [rows] int32.
// grid = rows, block = any.
//
// The threads write p_i = expf(s_i - s_0) in parallel; then one thread runs the twin's
// sequential steps in its order: the min_p cut (the ranks before the first whose p_i is
// below min_p; p_0 is 1), the running fp32 sum over the kept ranks, the top_p
// cut (the first rank whose sum reaches top_p * total), and the first rank whose sum
// exceeds u * (the sum at the cut). Each op is explicitly rounded, so the row's token
// depends on its own inputs alone; against NumPy only expf may differ, in the last bit.
extern "C" __global__ void sample_sorted(const float* __restrict__ sorted, const int* __restrict__ ids,
                                         const int* __restrict__ top_k, const float* __restrict__ top_p,
                                         const float* __restrict__ min_p, const float* __restrict__ uniforms,
                                         float* __restrict__ cum, int vocab, int* __restrict__ out) {
  pdl_enter();
  const long long base = (long long)blockIdx.x * vocab;
  int kept = top_k[blockIdx.x] < vocab ? top_k[blockIdx.x] : vocab;
  const float top = sorted[base];
  for (int i = threadIdx.x; i < kept; i += blockDim.x) {
    cum[base + i] = expf(__fsub_rn(sorted[base + i], top));
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  // one pass: the min_p cut (p_0 is 1, never cut) and the running sum of what it keeps
  const float floor_p = min_p[blockIdx.x];
  float sum = 0.0f;
  for (int i = 0; i < kept; ++i) {
    const float p = cum[base + i];
    if (p < floor_p) { kept = i; break; }
    sum = __fadd_rn(sum, p);
    cum[base + i] = sum;
  }
  int keep = kept;
  if (top_p[blockIdx.x] < 1.0f) {
    const float threshold = __fmul_rn(top_p[blockIdx.x], sum);
    int first = 0;
    while (first < kept && cum[base + first] < threshold) ++first;  // searchsorted, side left
    keep = first + 1 < kept ? first + 1 : kept;
  }
  const float target = __fmul_rn(uniforms[blockIdx.x], cum[base + keep - 1]);
  int choice = 0;
  while (choice < keep && cum[base + choice] <= target) ++choice;  // searchsorted, side right
  out[blockIdx.x] = ids[base + (choice < keep ? choice : keep - 1)];
}
