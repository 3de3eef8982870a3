// KV write into the paged cache (twin: kvcache.py). The layout, key_row and
// rope_kv_write's work item are kvcache.cuh's.
#include "common.cuh"
#include "kvcache.cuh"  // key_row, rope_kv_write_pair: shared with gemm_sm90.cu's rope epilogue

// k, v: [tokens, kv_heads, head_dim] BF16 with `k_stride` / `v_stride` elements between
// tokens (v is a slice of the fused QKV output); slots: [tokens] int64.
// grid = (tokens, kv_heads), threads stride over head_dim.
extern "C" __global__ void kv_write(const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                                    long long k_stride, long long v_stride, const long long* __restrict__ slots,
                                    __nv_bfloat16* __restrict__ cache, int layer, int num_layers,
                                    int kv_heads, int block_size, int head_dim) {
  pdl_enter();
  const int token = blockIdx.x, head = blockIdx.y;
  const long long k_base = key_row(slots[token], layer, num_layers, head, kv_heads, block_size, head_dim);
  const long long v_base = k_base + (long long)kv_heads * block_size * head_dim;
  const __nv_bfloat16* k_row = k + token * k_stride + (long long)head * head_dim;
  const __nv_bfloat16* v_row = v + token * v_stride + (long long)head * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    cache[k_base + d] = k_row[d];
    cache[v_base + d] = v_row[d];
  }
}

// rope then kv_write in one launch (twin: kvcache.py's rope_kv_write_ref), bit for bit the two
// kernels': qkv [tokens, heads + 2 * kv_heads, head_dim] BF16 with `token_stride` elements
// between tokens (the fused QKV output); q_out [tokens, heads, head_dim] BF16, contiguous.
// grid = (tokens, heads + kv_heads), block = head_dim / 2 threads (one pair each): a block
// y < heads rotates query head y into q_out; a block y >= heads rotates key head y - heads
// into its cache slot and copies the value head beside it.
extern "C" __global__ void rope_kv_write(const __nv_bfloat16* __restrict__ qkv, long long token_stride,
                                         const int* __restrict__ positions, const float* __restrict__ cos_table,
                                         const float* __restrict__ sin_table, __nv_bfloat16* __restrict__ q_out,
                                         const long long* __restrict__ slots, __nv_bfloat16* __restrict__ cache,
                                         int layer, int num_layers, int heads, int kv_heads, int block_size,
                                         int head_dim) {
  const int token = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
  if (i >= head_dim >> 1) {
    pdl_enter();
    return;
  }
  const RopeKvArgs args{positions, cos_table, sin_table, q_out, slots, cache,
                        layer, num_layers, heads, kv_heads, block_size, head_dim};
  // Before this grid's wait (programmatic dependent launch): the pair's rotation and cache
  // row, from the positions, slots and tables alone (kvcache.cuh); the rows of qkv, which
  // the projection just before writes, after it.
  const RopeKvPlace place = rope_kv_place(args, token, head, i);
  pdl_enter();
  rope_kv_write_at<false>(qkv, token_stride, args, token, head, i, place);
}
