// Rotary position embedding, Hugging Face's half-split layout (twin: rope.py).
//
// cos/sin come from one fp32 table [max_positions, head_dim / 2] indexed by the
// token's absolute position, so a token's rotation depends on its position alone.
// The products and sums round as the twin's fp32 numpy expressions do (rope_pair in
// common.cuh, which kvcache.cu's fused rope_kv_write shares).
#include "common.cuh"

// x: [tokens, heads, head_dim] BF16 with row stride `token_stride` elements between
// tokens (a slice of the fused QKV output); out: [tokens, heads, head_dim] BF16,
// contiguous. grid = (tokens, heads), block = head_dim / 2 threads (one pair each).
extern "C" __global__ void rope(const __nv_bfloat16* __restrict__ x, long long token_stride,
                                const int* __restrict__ positions, const float* __restrict__ cos_table,
                                const float* __restrict__ sin_table, __nv_bfloat16* __restrict__ out,
                                int heads, int head_dim) {
  pdl_enter();
  const int token = blockIdx.x, head = blockIdx.y, i = threadIdx.x, half = head_dim >> 1;
  if (i >= half) return;
  float c, s;
  rope_angle(positions, cos_table, sin_table, token, i, half, c, s);
  const __nv_bfloat16* row = x + token * token_stride + (long long)head * head_dim;
  rope_pair(row, out + ((long long)token * heads + head) * head_dim, i, half, c, s);
}
