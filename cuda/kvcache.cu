// KV write into the paged cache (twin: kvcache.py).
//
// Cache layout, block-major so a block is one contiguous copy for the host tier:
//   [num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim] BF16
// A token's slot is block_id * block_size + offset_in_block.
#include "common.cuh"

// k, v: [tokens, kv_heads, head_dim] BF16 with `k_stride` / `v_stride` elements between
// tokens (v is a slice of the fused QKV output); slots: [tokens] int64.
// grid = (tokens, kv_heads), threads stride over head_dim.
extern "C" __global__ void kv_write(const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                                    long long k_stride, long long v_stride, const long long* __restrict__ slots,
                                    __nv_bfloat16* __restrict__ cache, int layer, int num_layers,
                                    int kv_heads, int block_size, int head_dim) {
  pdl_enter();
  const int token = blockIdx.x, head = blockIdx.y;
  const long long slot = slots[token];
  const long long block = slot / block_size, offset = slot - block * block_size;
  const long long head_stride = (long long)block_size * head_dim;
  const long long k_base = ((block * num_layers + layer) * 2 * kv_heads + head) * head_stride + offset * head_dim;
  const long long v_base = k_base + (long long)kv_heads * head_stride;
  const __nv_bfloat16* k_row = k + token * k_stride + (long long)head * head_dim;
  const __nv_bfloat16* v_row = v + token * v_stride + (long long)head * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    cache[k_base + d] = k_row[d];
    cache[v_base + d] = v_row[d];
  }
}
