// The paged KV cache's layout and rope_kv_write's work item: the device functions of
// kvcache.cu's kernels, which gemm_sm90.cu's rope epilogue (a decode's qkv projection's
// last CTA rotating its rows and writing their keys and values) runs too, so both do the
// one computation per element (DESIGN §4: the same bits).
//
// Cache layout, block-major so a block is one contiguous copy for the host tier:
//   [num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim] BF16
// A token's slot is block_id * block_size + offset_in_block.
#ifndef REPRISE_KVCACHE_CUH
#define REPRISE_KVCACHE_CUH

#include "common.cuh"

namespace {

// Where KV head `head`'s key row for cache slot `slot` starts (its value row is
// kv_heads * block_size * head_dim elements later).
__device__ __forceinline__ long long key_row(long long slot, int layer, int num_layers, int head, int kv_heads,
                                             int block_size, int head_dim) {
  const long long block = slot / block_size, offset = slot - block * block_size;
  return ((block * num_layers + layer) * 2 * kv_heads + head) * (long long)block_size * head_dim + offset * head_dim;
}

// What rope_kv_write needs besides the rows: the rope tables and positions, the queries'
// output, the cache and where each token's keys and values go.
struct RopeKvArgs {
  const int* positions;    // [tokens] int32
  const float* cos_table;  // [max_positions, head_dim / 2]
  const float* sin_table;
  __nv_bfloat16* q_out;    // [tokens, heads, head_dim]
  const long long* slots;  // [tokens] int64
  __nv_bfloat16* cache;
  int layer, num_layers, heads, kv_heads, block_size, head_dim;
};

// A BF16 element as fp32 (the exact widening): THROUGH_L2 reads it through L2 (rows other
// CTAs of the grid wrote: gemm_sm90.cu's rope epilogue), else as any load.
template <bool THROUGH_L2>
__device__ __forceinline__ unsigned short bf16_at(const __nv_bfloat16* p, int i) {
  const unsigned short* bits = reinterpret_cast<const unsigned short*>(p) + i;
  if constexpr (THROUGH_L2) return __ldcg(bits);
  else return __ldg(bits);  // the grid before wrote them: read only after the wait
}

// Where pair i of head `head` of `token` goes and how it turns: its position's cosine
// and sine, and a key head's cache row. Only what the step uploaded before its first
// kernel (positions, slots) and the constant tables, so the rope_kv_write kernel reads it
// before its PDL wait, while the qkv projection still runs.
struct RopeKvPlace {
  float c, s;
  long long k_base;  // a key head's row in the cache (0 for a query head)
};

// KV head `kv_head`'s key row for `token`'s slot, in the launch's layer.
__device__ __forceinline__ long long token_key_row(const RopeKvArgs& a, int token, int kv_head) {
  return key_row(__ldg(a.slots + token), a.layer, a.num_layers, kv_head, a.kv_heads, a.block_size, a.head_dim);
}

__device__ __forceinline__ RopeKvPlace rope_kv_place(const RopeKvArgs& a, int token, int head, int i) {
  RopeKvPlace p;
  rope_angle(a.positions, a.cos_table, a.sin_table, token, i, a.head_dim >> 1, p.c, p.s);
  p.k_base = head < a.heads ? 0 : token_key_row(a, token, head - a.heads);
  return p;
}

// rope_kv_write's pair i of head `head` of token `token` (qkv: [tokens, heads + 2 *
// kv_heads, head_dim] with `token_stride` elements between tokens): a query head (head <
// heads) rotated into q_out; a key head (heads <= head < heads + kv_heads) rotated into
// its cache slot (rope_rotate_at), with the same pair of its value head copied beside it
// (value_copy_at). The same, its place (rope_kv_place) read before.
template <bool THROUGH_L2>
__device__ __forceinline__ void rope_rotate_at(const __nv_bfloat16* qkv, long long token_stride,
                                               const RopeKvArgs& a, int token, int head, int i,
                                               const RopeKvPlace& place) {
  const int half = a.head_dim >> 1;
  const __nv_bfloat16* row = qkv + token * token_stride + (long long)head * a.head_dim;
  const float x1 = __uint_as_float(static_cast<unsigned>(bf16_at<THROUGH_L2>(row, i)) << 16);
  const float x2 = __uint_as_float(static_cast<unsigned>(bf16_at<THROUGH_L2>(row, i + half)) << 16);
  __nv_bfloat16* dst = head < a.heads ? a.q_out + ((long long)token * a.heads + head) * a.head_dim
                                       : a.cache + place.k_base;
  rope_store(dst, i, half, x1, x2, place.c, place.s);
}

// Pair i (elements i and i + half) of value head `kv_head` of `token` copied as is into
// the value row beside the key row at k_base.
template <bool THROUGH_L2>
__device__ __forceinline__ void value_copy_at(const __nv_bfloat16* qkv, long long token_stride, const RopeKvArgs& a,
                                              int token, int kv_head, int i, long long k_base) {
  const int half = a.head_dim >> 1;
  const __nv_bfloat16* v_row = qkv + token * token_stride + (long long)(a.heads + a.kv_heads + kv_head) * a.head_dim;
  unsigned short* v_dst = reinterpret_cast<unsigned short*>(a.cache + k_base + (long long)a.kv_heads * a.block_size * a.head_dim);
  v_dst[i] = bf16_at<THROUGH_L2>(v_row, i);
  v_dst[i + half] = bf16_at<THROUGH_L2>(v_row, i + half);
}

template <bool THROUGH_L2>
__device__ __forceinline__ void rope_kv_write_at(const __nv_bfloat16* qkv, long long token_stride,
                                                 const RopeKvArgs& a, int token, int head, int i,
                                                 const RopeKvPlace& place) {
  rope_rotate_at<THROUGH_L2>(qkv, token_stride, a, token, head, i, place);
  if (head >= a.heads) value_copy_at<THROUGH_L2>(qkv, token_stride, a, token, head - a.heads, i, place.k_base);
}

// The same computation split by the product's heads rather than by pairs (decode_block.cu:
// the qkv projection's CTA that finished a head's columns writes that head alone): column
// head `col_head` of qkv's heads + 2 kv_heads, pair i. A query or key head: rope_rotate_at
// (as rope_kv_write_pair); a value head: value_copy_at into its key head's slot.
template <bool THROUGH_L2>
__device__ __forceinline__ void rope_kv_write_head_pair(const __nv_bfloat16* qkv, long long token_stride,
                                                        const RopeKvArgs& a, int token, int col_head, int i) {
  const int kv_end = a.heads + a.kv_heads;
  if (col_head < kv_end) {
    rope_rotate_at<THROUGH_L2>(qkv, token_stride, a, token, col_head, i, rope_kv_place(a, token, col_head, i));
    return;
  }
  const int kv_head = col_head - kv_end;
  value_copy_at<THROUGH_L2>(qkv, token_stride, a, token, kv_head, i, token_key_row(a, token, kv_head));
}

template <bool THROUGH_L2>
__device__ __forceinline__ void rope_kv_write_pair(const __nv_bfloat16* qkv, long long token_stride,
                                                   const RopeKvArgs& a, int token, int head, int i) {
  rope_kv_write_at<THROUGH_L2>(qkv, token_stride, a, token, head, i, rope_kv_place(a, token, head, i));
}

}  // namespace

#endif  // REPRISE_KVCACHE_CUH
