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

// Gemma's sandwich norm, then the next: normed_delta = rmsnorm(delta, delta_weight) (BF16),
// summed = residual + normed_delta (fp32), out = rmsnorm(summed, weight). residual,
// summed: [rows, hidden] fp32; delta, normed_delta, out: [rows, hidden] BF16. The delta
// row is widened into `summed` first (exactly), normalized from there as rmsnorm
// normalizes an fp32 row, and `summed` is then overwritten by the add: the two norms'
// bits are rmsnorm's and add_rmsnorm's.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
norm_add_rmsnorm(const float* __restrict__ residual, const __nv_bfloat16* __restrict__ delta,
                 const __nv_bfloat16* __restrict__ delta_weight, const __nv_bfloat16* __restrict__ weight,
                 __nv_bfloat16* __restrict__ normed_delta, float* __restrict__ summed_out,
                 __nv_bfloat16* __restrict__ out, int hidden, float eps) {
  pdl_enter();
  __shared__ float scratch[RMSNORM_THREADS / 32];  // block_sum's
  const long long row = blockIdx.x;
  float* s = summed_out + row * hidden;
  __nv_bfloat16* nd = normed_delta + row * hidden;
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) s[i] = delta_at(delta + row * hidden, i);
  __syncthreads();  // NOTE: each thread reads back only what it wrote, but keep the row complete
  if (!normalize_held_row<false>(s, nullptr, delta_weight, nullptr, nd, hidden, eps, scratch))
    normalize_row(s, delta_weight, nd, hidden, eps, scratch);
  __syncthreads();  // the normalized row complete before the add reads it
  add_rmsnorm_row(residual + row * hidden, nd, weight, s, out + row * hidden, hidden, eps, scratch);
}

// qkv: [rows, num_heads + 2 * num_kv_heads, head_dim] BF16, in place: each query and key
// head normalized over head_dim (Qwen3's q_norm and k_norm, before RoPE), the values
// untouched. grid = rows * (num_heads + num_kv_heads), head_dim <= RMSNORM_THREADS. The
// head is widened into shared memory first, so each thread writes its element back only
// after the block's sum (a barrier) has read them all: the row functions' tree and bits.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
head_rmsnorm(__nv_bfloat16* __restrict__ qkv, const __nv_bfloat16* __restrict__ q_weight,
             const __nv_bfloat16* __restrict__ k_weight, int num_heads, int num_kv_heads,
             int head_dim, float eps) {
  pdl_enter();
  __shared__ float scratch[RMSNORM_THREADS / 32];  // block_sum's
  __shared__ float head_row[RMSNORM_THREADS];
  const int normed = num_heads + num_kv_heads;
  const long long token = blockIdx.x / normed;
  const int head = blockIdx.x % normed;
  __nv_bfloat16* h = qkv + (token * (num_heads + 2 * num_kv_heads) + head) * (long long)head_dim;
  if (threadIdx.x < head_dim) head_row[threadIdx.x] = __bfloat162float(h[threadIdx.x]);
  __syncthreads();
  normalize_row_in_registers<1, false>(head_row, static_cast<const __nv_bfloat16*>(nullptr),
                                       head < num_heads ? q_weight : k_weight, nullptr, h, head_dim,
                                       eps, scratch);
}
