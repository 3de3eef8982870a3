// RMSNorm, alone and fused with the residual add (twin: rmsnorm.py).
//
// One row per block of RMSNORM_THREADS threads. Thread t sums the squares of
// elements t, t + RMSNORM_THREADS, ... in ascending order; the partial sums meet
// in a fixed tree (common.cuh's block_sum: shuffles within each warp, then warp 0
// over the warps' sums).
// NOTE: the tree depends only on the row length, never on the number of rows or
// the row's index, so a row's result is independent of its batch.
#include "common.cuh"

#define RMSNORM_THREADS 256

// out[row] = bf16(x * (1 / sqrt(mean(x^2) + eps)) * weight), x in fp32
__device__ __forceinline__ void normalize_row(const float* __restrict__ x,
                                              const __nv_bfloat16* __restrict__ weight,
                                              __nv_bfloat16* __restrict__ out, int hidden,
                                              float eps) {
  __shared__ float scratch[RMSNORM_THREADS / 32];
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) sum_sq = __fmaf_rn(x[i], x[i], sum_sq);
  const float mean_sq = __fdiv_rn(block_sum<RMSNORM_THREADS>(sum_sq, scratch), (float)hidden);
  const float inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) {
    const float w = __bfloat162float(weight[i]);
    out[i] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(x[i], inv_rms), w));
  }
}

// x: [rows, hidden] fp32; weight: [hidden] BF16; out: [rows, hidden] BF16. grid = rows.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm(const float* __restrict__ x, const __nv_bfloat16* __restrict__ weight,
        __nv_bfloat16* __restrict__ out, int hidden, float eps) {
  pdl_enter();
  const long long row = blockIdx.x;
  normalize_row(x + row * hidden, weight, out + row * hidden, hidden, eps);
}

// residual: [rows, hidden] fp32, delta: [rows, hidden] BF16.
// summed = residual + delta (fp32, written to summed_out), out = rmsnorm(summed).
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
add_rmsnorm(const float* __restrict__ residual, const __nv_bfloat16* __restrict__ delta,
            const __nv_bfloat16* __restrict__ weight, float* __restrict__ summed_out,
            __nv_bfloat16* __restrict__ out, int hidden, float eps) {
  pdl_enter();
  const long long row = blockIdx.x;
  const float* r = residual + row * hidden;
  const __nv_bfloat16* d = delta + row * hidden;
  float* s = summed_out + row * hidden;
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) s[i] = __fadd_rn(r[i], __bfloat162float(d[i]));
  __syncthreads();  // NOTE: each thread reads back only what it wrote, but keep the row complete
  normalize_row(s, weight, out + row * hidden, hidden, eps);
}
