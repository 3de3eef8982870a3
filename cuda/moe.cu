// Mixture-of-experts MLPs: the routing, the gather of each token's rows into expert
// groups and the weighted sum of the experts' outputs (twins: moe.py, whose docstring is
// the contract; the grouped expert GEMM between them is gemm.cu's moe_gemm_*).
//
// For T tokens, E experts (E <= kMaxExperts), k of them a token (k <= kMaxTopK):
//   moe_route_topk  grid ceil(T / kRouteWarps), kRouteWarps warps: a warp a token, its
//                   k experts (expert_ids [T, k] int32) and their weights ([T, k] fp32).
//   moe_route_rows  grid E, kRowsThreads: CTA e writes offsets[e] and tile_starts[e] (and
//                   the last CTA offsets[E] = T * k and tile_starts[E]: every expert's
//                   tiles), and expert e's grouped rows: token_of_row and row_of_slot of
//                   its pairs, in pair order.
//   moe_gather      grid T * k: xs[r] = x[token_of_row[r]].
//   moe_combine     grid T: out[t] = the slots' weighted sum (and the gated shared expert).
// Every grid is a function of T, E, k and the widths alone (never of the routing), so a
// step's launches are the same whatever it routes: a CUDA graph replays them.
//
// NOTE: bit for bit the twins (DESIGN §4), and each token's results a function of its own
// logits and rows:
//   - the experts are ordered by an integer key of the BF16 bits (logit_key): descending
//     value, -0 equal to +0, NaN below every number, ties (equal keys) to the lower id: the
//     twin's stable argsort of -value. Integer keys, not fp32 compares: under -ftz=true
//     (CuPy's option) an fp32 compare sees every subnormal logit as 0. The warp's argmax
//     is over a total order, (key, id), so every lane of the butterfly gets one winner.
//   - the weights are taken in double, as routing_weights: exp(l - max) (max over all E;
//     NaN if any logit is NaN), summed in ascending expert order (normalize = 0) or in
//     slot order over the k chosen (normalize = 1), picked / total rounded once to fp32
//     (f32_bits_rn: as __double2float_rn, but an fp32 subnormal result kept, which
//     -ftz=true's cvt would flush to zero). CUDA's double exp is within an ulp of the
//     twin's (moe.py's docstring: the rare weight next to an fp32 rounding boundary).
//   - the rows: moe_route_rows counts, with integers, the pairs p = t * k + j of experts
//     below e (offsets[e]), and numbers expert e's own pairs in ascending p by a prefix
//     count over the CTA, chunk by chunk: the twin's stable sort by expert. No atomics.
//   - the combine: acc = +0, then acc = acc + w_j * y_j for j = 0..k-1, each product and
//     sum one fp32 rounding (__fmul_rn, __fadd_rn: never contracted into an FMA), then
//     acc = acc + sigmoid(g) * shared (sigmoid in double, rounded to fp32), then BF16.
//     Under -ftz=true an fp32 subnormal operand or result of those products and sums is
//     flushed to zero, where the twin keeps it (as in every fp32 kernel of ours).
#include "common.cuh"

namespace {

constexpr int kMaxExperts = 256;
constexpr int kExpertsPerLane = kMaxExperts / 32;
constexpr int kMaxTopK = 32;  // slot j is lane j's
constexpr int kRouteWarps = 4;
constexpr int kRowsThreads = 256;
constexpr int kRowsWarps = kRowsThreads / 32;
constexpr int kRowsItems = 4;  // consecutive pairs a thread takes in a chunk
constexpr int kRowsChunk = kRowsThreads * kRowsItems;
static_assert(kRowsThreads >= kMaxExperts, "moe_route_rows: a thread an expert's counts");
constexpr int kCopyThreads = 128;  // moe_gather's and moe_combine's blocks
constexpr int kNanKey = -0x10000;  // below every number's key
constexpr int kNoKey = -0x7fffffff - 1;  // no candidate: below every key, NaN's too
constexpr int kNoId = 0x7fffffff;

// The order key of a BF16 logit: larger for a larger value, equal for -0 and +0 (and for
// every NaN), a NaN's below -inf's.
__device__ __forceinline__ int logit_key(unsigned bits) {
  const int mag = static_cast<int>(bits & 0x7fffu);
  if (mag > 0x7f80) return kNanKey;
  return (bits & 0x8000u) != 0u ? -mag : mag;
}

// Whether candidate (key a, id a) comes before (key b, id b): the larger key, then the
// lower id.
__device__ __forceinline__ bool before(int key_a, int id_a, int key_b, int id_b) {
  return key_a > key_b || (key_a == key_b && id_a < id_b);
}

// The BF16 bits of a key's value (a NaN's for kNanKey; -0 comes back as +0, which no
// difference l - max below tells apart from it).
__device__ __forceinline__ unsigned key_bits(int key) {
  if (key == kNanKey) return 0x7fc0u;
  return key < 0 ? 0x8000u | static_cast<unsigned>(-key) : static_cast<unsigned>(key);
}

// A BF16 value in double, exactly, with no fp32 step (under -ftz=true a subnormal would be
// flushed): a subnormal BF16 is its 7-bit mantissa times 2^-133.
__device__ __forceinline__ double bf16_double(unsigned bits) {
  const unsigned mag = bits & 0x7fffu;
  const double v = mag < 0x80u ? __dmul_rn(static_cast<double>(mag), 0x1p-133)
                               : static_cast<double>(__uint_as_float(mag << 16));
  return (bits & 0x8000u) != 0u ? -v : v;
}

// The fp32 bits of v rounded to nearest even: __double2float_rn's, but a subnormal result
// kept (v * 2^149 rounded to an integer is the subnormal's mantissa; 2^23 carries into
// the least normal), where -ftz=true's cvt.rn.ftz.f32.f64 would give 0.
__device__ __forceinline__ unsigned f32_bits_rn(double v) {
  const double mag = fabs(v);
  if (mag < 0x1p-126) {
    const unsigned sign = v < 0.0 ? 0x80000000u : 0u;
    return sign | __double2uint_rn(__dmul_rn(mag, 0x1p149));
  }
  return __float_as_uint(__double2float_rn(v));
}

// exp(l - peak) in double (peak: the row's max), the one formula of every weight's terms.
__device__ __forceinline__ double exp_term(int key, double peak) {
  return exp(__dsub_rn(bf16_double(key_bits(key)), peak));
}

// The sum of an integer over the CTA's kRowsThreads threads, in every thread (integers:
// the order of the adds cannot matter). `scratch`: kRowsWarps ints of shared memory.
__device__ __forceinline__ int block_count(int v, int* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int sum = 0;
  for (int w = 0; w < kRowsWarps; ++w) sum += scratch[w];
  __syncthreads();  // every thread has read scratch before anyone writes it again
  return sum;
}

// BF16 bits to fp32 (exact), the lower or upper half of a word.
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// acc = acc + w * y, two fp32 roundings (the contract's; no FMA).
__device__ __forceinline__ float add_product(float acc, float w, float y) { return __fadd_rn(acc, __fmul_rn(w, y)); }

}  // namespace

// logits [T, E] BF16 bits -> expert_ids [T, k] int32 (best first), weights [T, k] fp32.
// grid = ceil(T / kRouteWarps), block = 32 * kRouteWarps; E <= kMaxExperts, 1 <= k <=
// min(E, kMaxTopK) (the launcher checks). `normalize`: 1 the softmax over the k chosen,
// 0 over all E.
extern "C" __global__ void __launch_bounds__(32 * kRouteWarps)
moe_route_topk(const unsigned short* __restrict__ logits, int* __restrict__ expert_ids, float* __restrict__ weights,
               int num_tokens, int num_experts, int top_k, int normalize) {
  pdl_enter();
  __shared__ double terms[kRouteWarps][kMaxExperts];  // a warp's exp(l - max), by expert
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int token = static_cast<int>(blockIdx.x) * kRouteWarps + warp;
  if (token >= num_tokens) return;  // the whole warp: nothing below waits for another warp
  const unsigned short* row = logits + static_cast<long long>(token) * num_experts;

  // lane holds experts lane + 32 i
  int keys[kExpertsPerLane];
  bool has_nan = false;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    keys[i] = e < num_experts ? logit_key(row[e]) : kNoKey;
    has_nan |= keys[i] == kNanKey;
  }
  // k rounds of the warp's best not yet chosen; lane j keeps round j's winner
  unsigned chosen = 0u;  // bit i: expert lane + 32 i taken
  int my_key = kNoKey, my_id = kNoId;
  for (int j = 0; j < top_k; ++j) {
    int best_key = kNoKey, best_id = kNoId;
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      const int e = lane + 32 * i;
      if (((chosen >> i) & 1u) == 0u && before(keys[i], e, best_key, best_id)) best_key = keys[i], best_id = e;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const int other_key = __shfl_xor_sync(0xffffffffu, best_key, offset);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (before(other_key, other_id, best_key, best_id)) best_key = other_key, best_id = other_id;
    }
    if ((best_id & 31) == lane) chosen |= 1u << (best_id >> 5);
    if (lane == j) my_key = best_key, my_id = best_id;
  }

  // the weights: max over all E (NaN if any logit is NaN), the terms, their total
  const bool row_has_nan = __any_sync(0xffffffffu, has_nan);
  const double peak = bf16_double(key_bits(row_has_nan ? kNanKey : __shfl_sync(0xffffffffu, my_key, 0)));
  double* warp_terms = terms[warp];
  if (normalize != 0) {
    if (lane < top_k) warp_terms[lane] = exp_term(my_key, peak);
  } else {
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < num_experts) warp_terms[e] = exp_term(keys[i], peak);
    }
  }
  __syncwarp();
  const int num_terms = normalize != 0 ? top_k : num_experts;
  double total = 0.0;  // every lane sums the same terms in the same (ascending) order
  for (int i = 0; i < num_terms; ++i) total = __dadd_rn(total, warp_terms[i]);
  if (lane < top_k) {
    const double picked = normalize != 0 ? warp_terms[lane] : warp_terms[my_id];
    const long long at = static_cast<long long>(token) * top_k + lane;
    expert_ids[at] = my_id;
    reinterpret_cast<unsigned*>(weights)[at] = f32_bits_rn(__ddiv_rn(picked, total));
  }
}

// expert_ids [T * k] (pair p = t * k + j) -> offsets [E + 1], token_of_row [T * k],
// row_of_slot [T * k]: rows sorted by expert, then by pair; tile_starts [E + 1]: the
// grouped GEMM's m tiles of tile_rows rows numbered expert by expert (ceil(rows /
// tile_rows) each; gemm.cu's moe_gemm_*). grid = E, block = kRowsThreads; num_pairs =
// T * k > 0. CTA e reads every pair twice: once to count every expert's (its first row
// and first tile: those of the experts below it), once to number its own.
extern "C" __global__ void __launch_bounds__(kRowsThreads)
moe_route_rows(const int* __restrict__ expert_ids, int* __restrict__ offsets, int* __restrict__ token_of_row,
               int* __restrict__ row_of_slot, int* __restrict__ tile_starts, int num_pairs, int top_k,
               int num_experts, int tile_rows) {
  pdl_enter();
  __shared__ int scratch[kRowsWarps];
  __shared__ unsigned counts[kMaxExperts];  // every expert's pairs
  const int expert = static_cast<int>(blockIdx.x);
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  for (int e = static_cast<int>(threadIdx.x); e < kMaxExperts; e += kRowsThreads) counts[e] = 0u;
  __syncthreads();
  // integer counts: the order of the shared atomics cannot reach a result
  for (int p = static_cast<int>(threadIdx.x); p < num_pairs; p += kRowsThreads)
    atomicAdd(&counts[expert_ids[p]], 1u);
  __syncthreads();
  // thread e' < E holds expert e''s pairs and its tiles of tile_rows rows
  const int mine_e = static_cast<int>(threadIdx.x);
  const int pairs = mine_e < num_experts ? static_cast<int>(counts[mine_e]) : 0;
  const int tiles = (pairs + tile_rows - 1) / tile_rows;
  const int first_row = block_count(mine_e < expert ? pairs : 0, scratch);
  const int first_tile = block_count(mine_e < expert ? tiles : 0, scratch);
  const int all_tiles = block_count(tiles, scratch);
  if (threadIdx.x == 0) {
    offsets[expert] = first_row;
    tile_starts[expert] = first_tile;
    if (expert == num_experts - 1) offsets[num_experts] = num_pairs, tile_starts[num_experts] = all_tiles;
  }
  // chunks of kRowsChunk pairs, thread i taking kRowsItems consecutive ones: a pair's rank
  // among the chunk's pairs of this expert is the count over the threads before it (an
  // exclusive scan: the warp's by shuffles, then the warps' before it) and its items before
  int next_row = first_row;
  for (int chunk = 0; chunk < num_pairs; chunk += kRowsChunk) {
    const int p0 = chunk + static_cast<int>(threadIdx.x) * kRowsItems;
    unsigned mine = 0u;  // bit i: pair p0 + i is this expert's
#pragma unroll
    for (int i = 0; i < kRowsItems; ++i)
      if (p0 + i < num_pairs && expert_ids[p0 + i] == expert) mine |= 1u << i;
    const int count = __popc(mine);
    int inclusive = count;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int below_lane = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += below_lane;
    }
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    int row = next_row + inclusive - count, chunk_count = 0;
    for (int w = 0; w < kRowsWarps; ++w) {
      const int c = scratch[w];
      if (w < warp) row += c;
      chunk_count += c;
    }
    __syncthreads();  // every thread has read scratch before the next chunk writes it
#pragma unroll
    for (int i = 0; i < kRowsItems; ++i) {
      if (((mine >> i) & 1u) == 0u) continue;
      const int p = p0 + i;
      token_of_row[row] = p / top_k;
      row_of_slot[p] = row;
      ++row;
    }
    next_row += chunk_count;
  }
}

// xs [T * k, H] = x [T, H] rows token_of_row: grid = T * k, block = kCopyThreads.
extern "C" __global__ void __launch_bounds__(kCopyThreads)
moe_gather(const unsigned short* __restrict__ x, const int* __restrict__ token_of_row, unsigned short* __restrict__ xs,
           int hidden) {
  pdl_enter();
  const long long row = blockIdx.x;
  const unsigned short* src = x + static_cast<long long>(token_of_row[row]) * hidden;
  unsigned short* dst = xs + row * hidden;
  const unsigned long long bases = reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(xs);
  if (hidden % 8 == 0 && (bases & 15ull) == 0) {  // every row 16-byte aligned
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int i = static_cast<int>(threadIdx.x); i < hidden / 8; i += kCopyThreads) d[i] = s[i];
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < hidden; i += kCopyThreads) dst[i] = src[i];
  }
}

// out [T, H] BF16 = for each token, sum over its slots j (in order) of weights[t, j] *
// ys[row_of_slot[t * k + j]], then, with `has_shared`, + sigmoid(gate_logits[t]) *
// shared[t] (both read only then), rounded to BF16 once. grid = T, block = kCopyThreads;
// k <= kMaxTopK.
extern "C" __global__ void __launch_bounds__(kCopyThreads)
moe_combine(const unsigned short* __restrict__ ys, const float* __restrict__ weights,
            const int* __restrict__ row_of_slot, const unsigned short* __restrict__ shared,
            const unsigned short* __restrict__ gate_logits, unsigned short* __restrict__ out, int hidden, int top_k,
            int has_shared) {
  pdl_enter();
  __shared__ float slot_weight[kMaxTopK];
  __shared__ long long slot_row[kMaxTopK];  // the slot's row's first element in ys
  const long long token = blockIdx.x;
  if (static_cast<int>(threadIdx.x) < top_k) {
    const long long at = token * top_k + threadIdx.x;
    slot_weight[threadIdx.x] = weights[at];
    slot_row[threadIdx.x] = static_cast<long long>(row_of_slot[at]) * hidden;
  }
  __syncthreads();
  float gate = 0.0f;
  if (has_shared != 0) {
    const double g = bf16_double(gate_logits[token]);
    gate = __double2float_rn(__ddiv_rn(1.0, __dadd_rn(1.0, exp(-g))));
  }
  const unsigned short* shared_row = shared + token * hidden;
  unsigned short* out_row = out + token * hidden;
  const unsigned long long bases = reinterpret_cast<unsigned long long>(ys) |
                                   reinterpret_cast<unsigned long long>(out) |
                                   (has_shared != 0 ? reinterpret_cast<unsigned long long>(shared) : 0ull);
  if (hidden % 8 == 0 && (bases & 15ull) == 0) {  // 8 elements a thread, 16-byte loads
    for (int h = static_cast<int>(threadIdx.x) * 8; h < hidden; h += kCopyThreads * 8) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const uint4 v = *reinterpret_cast<const uint4*>(ys + slot_row[j] + h);
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
        const float w = slot_weight[j];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] = add_product(acc[2 * i], w, bf16_lo(words[i]));
          acc[2 * i + 1] = add_product(acc[2 * i + 1], w, bf16_hi(words[i]));
        }
      }
      if (has_shared != 0) {
        const uint4 v = *reinterpret_cast<const uint4*>(shared_row + h);
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] = add_product(acc[2 * i], gate, bf16_lo(words[i]));
          acc[2 * i + 1] = add_product(acc[2 * i + 1], gate, bf16_hi(words[i]));
        }
      }
      *reinterpret_cast<uint4*>(out_row + h) = make_uint4(bf16_pair(acc[0], acc[1]), bf16_pair(acc[2], acc[3]),
                                                          bf16_pair(acc[4], acc[5]), bf16_pair(acc[6], acc[7]));
    }
  } else {
    for (int h = static_cast<int>(threadIdx.x); h < hidden; h += kCopyThreads) {
      float acc = 0.0f;
      for (int j = 0; j < top_k; ++j)
        acc = add_product(acc, slot_weight[j], __uint_as_float(static_cast<unsigned>(ys[slot_row[j] + h]) << 16));
      if (has_shared != 0)
        acc = add_product(acc, gate, __uint_as_float(static_cast<unsigned>(shared_row[h]) << 16));
      out_row[h] = static_cast<unsigned short>(bf16_bits(acc));
    }
  }
}
