// RMSNorm, alone and fused with the residual add (twin: rmsnorm.py).
//
// One row per block of RMSNORM_THREADS threads, through rmsnorm.cuh's row functions
// (their reduction tree and its NOTE are there).
#include "common.cuh"
#include "rmsnorm.cuh"  // the row functions, shared with gemm_sm90.cu's norm epilogue

// qk_rmsnorm's widest row: its fp32 copy fills the launch's dynamic shared memory (48 KiB,
// over the default limit with the static scratch: the launcher opts in).
#define QK_RMSNORM_MAX_WIDTH 12288

#ifndef REPRISE_EMULATE_PTX
namespace {
// The launch's dynamic shared memory (the emulator's driver gives its own).
__device__ __forceinline__ float* staged_row() {
  extern __shared__ __align__(16) float rmsnorm_smem[];
  return rmsnorm_smem;
}
}  // namespace
#endif

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

// qkv: [rows, num_heads + 2 * num_kv_heads, head_dim] BF16, in place: each token's queries
// normalized as one row of num_heads * head_dim elements with q_weight and its keys as one
// of num_kv_heads * head_dim with k_weight (OLMo 2's and OLMoE's q_norm and k_norm, over
// the whole projection), the values untouched. grid = rows * 2 (CTA 2t: token t's
// queries, 2t + 1: its keys); dynamic shared memory: num_heads * head_dim floats, at most
// QK_RMSNORM_MAX_WIDTH. The segment is widened into shared memory first and normalized
// from there as rmsnorm normalizes an fp32 row: its tree and bits, and every read of the
// segment before the write over it.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
qk_rmsnorm(__nv_bfloat16* __restrict__ qkv, const __nv_bfloat16* __restrict__ q_weight,
           const __nv_bfloat16* __restrict__ k_weight, int num_heads, int num_kv_heads,
           int head_dim, float eps) {
  pdl_enter();
  __shared__ float scratch[RMSNORM_THREADS / 32];  // block_sum's
  float* row = staged_row();
  const long long token = blockIdx.x / 2;
  const bool keys = blockIdx.x % 2 != 0;
  const int width = (keys ? num_kv_heads : num_heads) * head_dim;
  const __nv_bfloat16* weight = keys ? k_weight : q_weight;
  __nv_bfloat16* segment =
      qkv + (token * (num_heads + 2 * num_kv_heads) + (keys ? num_heads : 0)) * (long long)head_dim;
  for (int i = threadIdx.x; i < width; i += RMSNORM_THREADS) row[i] = __bfloat162float(segment[i]);
  __syncthreads();
  if (!normalize_held_row<false>(row, nullptr, weight, nullptr, segment, width, eps, scratch))
    normalize_row(row, weight, segment, width, eps, scratch);
}

// OLMo 2's post-norm: summed = residual + rmsnorm(delta, delta_weight) (the normalized
// delta rounded to BF16, added in fp32), out = bf16(summed); with_delta 0: summed =
// residual (delta and delta_weight never read). residual, summed: [rows, hidden] fp32;
// delta, out: [rows, hidden] BF16. As norm_add_rmsnorm: the delta row widened into
// `summed`, normalized from there into `out` (rmsnorm's bits), then both overwritten by
// the add; each thread adds the elements it normalized. NOTE: a minimum of 1 CTA an SM in
// its bounds: without it ptxas (CUDA 13, sm_90) held it to 48 registers and spilled.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS, 1)
norm_add(const float* __restrict__ residual, const __nv_bfloat16* __restrict__ delta,
         const __nv_bfloat16* __restrict__ delta_weight, float* __restrict__ summed_out,
         __nv_bfloat16* __restrict__ out, int hidden, float eps, int with_delta) {
  pdl_enter();
  __shared__ float scratch[RMSNORM_THREADS / 32];  // block_sum's
  const long long row = blockIdx.x;
  const float* r = residual + row * hidden;
  float* s = summed_out + row * hidden;
  __nv_bfloat16* o = out + row * hidden;
  if (with_delta) {
    for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) s[i] = delta_at(delta + row * hidden, i);
    __syncthreads();  // NOTE: each thread reads back only what it wrote, but keep the row complete
    if (!normalize_held_row<false>(s, nullptr, delta_weight, nullptr, o, hidden, eps, scratch))
      normalize_row(s, delta_weight, o, hidden, eps, scratch);
    __syncthreads();  // the normalized row complete before the add reads it
    for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) {
      s[i] = __fadd_rn(r[i], __bfloat162float(o[i]));
      o[i] = __float2bfloat16_rn(s[i]);
    }
    return;
  }
  for (int i = threadIdx.x; i < hidden; i += RMSNORM_THREADS) {
    s[i] = r[i];
    o[i] = __float2bfloat16_rn(r[i]);
  }
}
