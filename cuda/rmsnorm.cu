// RMSNorm, alone and fused with the residual add (twin: rmsnorm.py).
//
// One row per block of RMSNORM_THREADS threads, through rmsnorm.cuh's row functions
// (their reduction tree and its NOTE are there).
#include "common.cuh"
#include "rmsnorm.cuh"  // the row functions, shared with gemm_sm90.cu's norm epilogue

// x: [rows, hidden] fp32; weight: [hidden] BF16; out: [rows, hidden] BF16. grid = rows.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm(const float* __restrict__ x, const __nv_bfloat16* __restrict__ weight,
        __nv_bfloat16* __restrict__ out, int hidden, float eps) {
  pdl_enter();
  __shared__ float scratch[RMSNORM_THREADS / 32];  // block_sum's
  const long long row = blockIdx.x;
  const float* xr = x + row * hidden;
  __nv_bfloat16* o = out + row * hidden;
  if (!normalize_held_row<false>(xr, nullptr, weight, nullptr, o, hidden, eps, scratch))
    normalize_row(xr, weight, o, hidden, eps, scratch);
}

// residual: [rows, hidden] fp32, delta: [rows, hidden] BF16.
// summed = residual + delta (fp32, written to summed_out), out = rmsnorm(summed).
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
add_rmsnorm(const float* __restrict__ residual, const __nv_bfloat16* __restrict__ delta,
            const __nv_bfloat16* __restrict__ weight, float* __restrict__ summed_out,
            __nv_bfloat16* __restrict__ out, int hidden, float eps) {
  pdl_enter();
  __shared__ float scratch[RMSNORM_THREADS / 32];  // block_sum's
  const long long row = blockIdx.x;
  add_rmsnorm_row(residual + row * hidden, delta + row * hidden, weight, summed_out + row * hidden,
                  out + row * hidden, hidden, eps, scratch);
}
