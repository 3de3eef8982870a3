// RMSNorm of one row by one block of RMSNORM_THREADS threads, alone and fused with the
// residual add: the device functions of rmsnorm.cu's kernels, which gemm_sm90.cu's norm
// epilogue (a decode GEMM's last CTA normalizing its output rows) runs too, so both take
// the one reduction tree (DESIGN §4) and give the same bits.
//
// Thread t sums the squares of elements t, t + RMSNORM_THREADS, ... in ascending order;
// the partial sums meet in a fixed tree (common.cuh's block_sum: shuffles within each
// warp, then warp 0 over the warps' sums). `scratch`: RMSNORM_THREADS / 32 floats of
// shared memory (the kernels' static array; the GEMM's drained ring).
// NOTE: the tree depends only on the row length, never on the number of rows, the row's
// index or the kernel that runs it, so a row's result is independent of its batch.
#ifndef REPRISE_RMSNORM_CUH
#define REPRISE_RMSNORM_CUH

#include "common.cuh"

#define RMSNORM_THREADS 256
// A row of up to RMSNORM_THREADS * RMSNORM_MAX_PER_THREAD elements is held in registers,
// each thread's elements loaded at once (one round trip to memory, not one a pass).
#define RMSNORM_MAX_PER_THREAD 16

namespace {

// inv_rms of a row from each thread's sum of squares.
__device__ __forceinline__ float inverse_rms(float sum_sq, int hidden, float eps, float* scratch) {
  const float mean_sq = __fdiv_rn(block_sum<RMSNORM_THREADS>(sum_sq, scratch), (float)hidden);
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
}

// A BF16 element of `delta`, read through L2 (never a stale L1 line: the norm epilogue
// reads rows other CTAs of its grid wrote); the exact widening __bfloat162float makes.
__device__ __forceinline__ float delta_at(const __nv_bfloat16* delta, int i) {
  return __uint_as_float(static_cast<unsigned>(__ldcg(reinterpret_cast<const unsigned short*>(delta) + i)) << 16);
}

// A delta row in the CTA's own shared memory (decode_block.cu: the product's row it
// folded itself), BF16 bits; the same widening.
struct SharedBf16 {
  const unsigned short* row;
};
__device__ __forceinline__ float delta_at(SharedBf16 delta, int i) {
  return __uint_as_float(static_cast<unsigned>(delta.row[i]) << 16);
}

// out[row] = bf16(x * (1 / sqrt(mean(x^2) + eps)) * weight), x in fp32, for a row longer
// than the register path takes: each pass reads its row again.
__device__ __forceinline__ void normalize_row(const float* __restrict__ x,
                                              const __nv_bfloat16* __restrict__ weight,
                                              __nv_bfloat16* __restrict__ out, int hidden,
                                              float eps, float* scratch) {
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) sum_sq = __fmaf_rn(x[i], x[i], sum_sq);
  const float inv_rms = inverse_rms(sum_sq, hidden, eps, scratch);
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) {
    const float w = __bfloat162float(weight[i]);
    out[i] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(x[i], inv_rms), w));
  }
}

// The same row held in registers: thread t's elements t, t + RMSNORM_THREADS, ... (PER
// of them at most), loaded together with their weights before any arithmetic. The same
// elements a thread, squared and summed in the same ascending order, through the same
// tree: the same bits as normalize_row. With `delta`, x = residual + delta (fp32), also
// written to `summed`.
template <int PER, bool ADD, class Delta>
__device__ __forceinline__ void normalize_row_in_registers(
    const float* __restrict__ x, Delta delta,
    const __nv_bfloat16* __restrict__ weight, float* __restrict__ summed,
    __nv_bfloat16* __restrict__ out, int hidden, float eps, float* scratch) {
  float v[PER], w[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * RMSNORM_THREADS;
    if (i < hidden) {
      if constexpr (ADD) v[k] = __fadd_rn(x[i], delta_at(delta, i));
      else v[k] = x[i];
      w[k] = __bfloat162float(weight[i]);
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * RMSNORM_THREADS;
    if (i < hidden) {
      if (ADD) summed[i] = v[k];
      sum_sq = __fmaf_rn(v[k], v[k], sum_sq);
    }
  }
  const float inv_rms = inverse_rms(sum_sq, hidden, eps, scratch);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * RMSNORM_THREADS;
    if (i < hidden) out[i] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(v[k], inv_rms), w[k]));
  }
}

// The register path for the smallest PER (a power of two) that holds the row; false for
// a row past RMSNORM_THREADS * RMSNORM_MAX_PER_THREAD elements (the caller loops).
template <bool ADD, class Delta = const __nv_bfloat16*>
__device__ __forceinline__ bool normalize_held_row(const float* x, Delta delta,
                                                   const __nv_bfloat16* weight, float* summed,
                                                   __nv_bfloat16* out, int hidden, float eps,
                                                   float* scratch) {
  const int per = (hidden + RMSNORM_THREADS - 1) / RMSNORM_THREADS;
  if (per <= 1) normalize_row_in_registers<1, ADD, Delta>(x, delta, weight, summed, out, hidden, eps, scratch);
  else if (per <= 2) normalize_row_in_registers<2, ADD, Delta>(x, delta, weight, summed, out, hidden, eps, scratch);
  else if (per <= 4) normalize_row_in_registers<4, ADD, Delta>(x, delta, weight, summed, out, hidden, eps, scratch);
  else if (per <= 8) normalize_row_in_registers<8, ADD, Delta>(x, delta, weight, summed, out, hidden, eps, scratch);
  else if (per <= RMSNORM_MAX_PER_THREAD)
    normalize_row_in_registers<RMSNORM_MAX_PER_THREAD, ADD, Delta>(x, delta, weight, summed, out, hidden, eps, scratch);
  else return false;
  return true;
}

// One row of add_rmsnorm: s = r + d (fp32), o = rmsnorm(s), by all RMSNORM_THREADS
// threads of the block (each calls it; it holds barriers). d: a BF16 row in global memory,
// or (SharedBf16) in the CTA's shared memory: the same values, the same bits.
template <class Delta = const __nv_bfloat16*>
__device__ __forceinline__ void add_rmsnorm_row(const float* r, Delta d,
                                                const __nv_bfloat16* weight, float* s,
                                                __nv_bfloat16* o, int hidden, float eps,
                                                float* scratch) {
  if (normalize_held_row<true, Delta>(r, d, weight, s, o, hidden, eps, scratch)) return;
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) s[i] = __fadd_rn(r[i], delta_at(d, i));
  __syncthreads();  // NOTE: each thread reads back only what it wrote, but keep the row complete
  normalize_row(s, weight, o, hidden, eps, scratch);
}

}  // namespace

#endif  // REPRISE_RMSNORM_CUH
