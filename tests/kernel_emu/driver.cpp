// Every emulated kernel behind a plain C entry point that launches it (cuda_emu.h).
#include "cuda_emu.h"
#include "../../cuda/rmsnorm.cu"
#include "../../cuda/rope.cu"
#include "../../cuda/activation.cu"
#include "../../cuda/embedding.cu"
#include "../../cuda/kvcache.cu"
#include "../../cuda/sampling.cu"
#include "../../cuda/attention.cu"

extern "C" {
void run_rmsnorm(int rows, const float* x, const __nv_bfloat16* w, __nv_bfloat16* out, int hidden, float eps) {
  launch({(unsigned)rows, 1, 1}, RMSNORM_THREADS, [&] { rmsnorm(x, w, out, hidden, eps); });
}
void run_add_rmsnorm(int rows, const float* r, const __nv_bfloat16* d, const __nv_bfloat16* w, float* s,
                     __nv_bfloat16* out, int hidden, float eps) {
  launch({(unsigned)rows, 1, 1}, RMSNORM_THREADS, [&] { add_rmsnorm(r, d, w, s, out, hidden, eps); });
}
void run_rope(int tokens, int heads, const __nv_bfloat16* x, long long stride, const int* pos, const float* c,
              const float* s, __nv_bfloat16* out, int head_dim) {
  const int threads = head_dim / 2 < 32 ? 32 : head_dim / 2;
  launch({(unsigned)tokens, (unsigned)heads, 1}, threads, [&] { rope(x, stride, pos, c, s, out, heads, head_dim); });
}
void run_silu_mul(const __nv_bfloat16* gate_up, __nv_bfloat16* out, long long tokens, int inter, int blocks) {
  launch({(unsigned)blocks, 1, 1}, 256, [&] { silu_mul(gate_up, out, tokens, inter); });
}
void run_embed(int tokens, const __nv_bfloat16* table, const int* ids, float* out, int hidden) {
  launch({(unsigned)tokens, 1, 1}, 256, [&] { embed(table, ids, out, hidden); });
}
void run_kv_write(int tokens, int kv_heads, const __nv_bfloat16* k, const __nv_bfloat16* v, long long k_stride,
                  long long v_stride, const long long* slots, __nv_bfloat16* cache, int layer, int layers,
                  int block_size, int head_dim) {
  launch({(unsigned)tokens, (unsigned)kv_heads, 1}, head_dim < 128 ? head_dim : 128, [&] {
    kv_write(k, v, k_stride, v_stride, slots, cache, layer, layers, kv_heads, block_size, head_dim);
  });
}
void run_argmax(int rows, const float* logits, long long stride, int vocab, int* out) {
  launch({(unsigned)rows, 1, 1}, ARGMAX_THREADS, [&] { argmax(logits, stride, vocab, out); });
}
void run_philox_uniform(const unsigned long long* seeds, const long long* positions, float* out, int n) {
  launch({(unsigned)((n + 255) / 256), 1, 1}, 256, [&] { philox_uniform(seeds, positions, out, n); });
}
int run_paged_attention(int head_dim, int block_size, int grid_x, int grid_y, unsigned short* out,
                        const unsigned short* q, const unsigned short* cache, const int* block_tables,
                        const int* seq_lens, const int* query_start_loc, int num_tokens, int num_seqs,
                        int max_blocks, int num_heads, int num_kv_heads, int num_layers, int layer, float scale) {
  using Fn = void (*)(unsigned short*, const unsigned short*, const unsigned short*, const int*, const int*,
                      const int*, int, int, int, int, int, int, int, float);
  Fn fn = nullptr;
  if (head_dim == 64 && block_size == 16) fn = paged_attention_d64_b16;
  if (head_dim == 64 && block_size == 32) fn = paged_attention_d64_b32;
  if (head_dim == 64 && block_size == 64) fn = paged_attention_d64_b64;
  if (head_dim == 128 && block_size == 16) fn = paged_attention_d128_b16;
  if (head_dim == 128 && block_size == 32) fn = paged_attention_d128_b32;
  if (head_dim == 128 && block_size == 64) fn = paged_attention_d128_b64;
  if (fn == nullptr) return 1;
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, 128, [&] {
    fn(out, q, cache, block_tables, seq_lens, query_start_loc, num_tokens, num_seqs, max_blocks, num_heads,
       num_kv_heads, num_layers, layer, scale);
  });
  return 0;
}
}
