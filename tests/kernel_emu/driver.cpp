// Every emulated kernel behind a plain C entry point that launches it (cuda_emu.h).
// The PTX wrappers come from ptx_emu.h (REPRISE_EMULATE_PTX), and the sources' shared
// header cuda/common.cuh is included here, once, at file scope, before any source
// (each source's own include of it is then empty).
#include "cuda_emu.h"
#define REPRISE_EMULATE_PTX 1
#include "ptx_emu.h"
#include "../../cuda/common.cuh"
// rmsnorm.cu's qk_rmsnorm stages its row in the launch's dynamic shared memory: the
// window with_dynamic_smem sets (rmsnorm_smem below).
namespace {
inline float* staged_row() { return reinterpret_cast<float*>(g_ptx_smem); }
}  // namespace
#include "../../cuda/rmsnorm.cu"
constexpr unsigned RMSNORM_SMEM_CAPACITY = QK_RMSNORM_MAX_WIDTH * 4;  // 48 KiB
namespace {
alignas(16) unsigned short rmsnorm_smem[RMSNORM_SMEM_CAPACITY / 2];
}  // namespace
#include "../../cuda/rope.cu"
#include "../../cuda/activation.cu"
#include "../../cuda/bias.cu"
#include "../../cuda/embedding.cu"
#include "../../cuda/kvcache.cu"
#include "../../cuda/sampling.cu"
#include "../../cuda/penalties.cu"
// attention.cu defines its own copies of common.cuh's helpers (bf16_bits, ...) in its
// file-local namespace: a namespace of its own keeps them apart from common.cuh's.
namespace attention_emu {
#include "../../cuda/attention.cu"
}  // namespace attention_emu
// moe.cu, in a namespace of its own too: its file-local helpers (bf16_lo, ...) share
// names with other files'.
namespace moe_emu {
#include "../../cuda/moe.cu"
}  // namespace moe_emu

// The GEMM: its `extern __shared__` buffer is gemm_smem below, sized for the largest
// tile config (run_gemm checks the launch's size against it). __shared__ expands to
// nothing while gemm.cu is read, so its block-scope `extern` declaration names that
// array. gemm.cu sits in a namespace of its own: its file-local helpers share names
// with other files'.
constexpr unsigned GEMM_SMEM_CAPACITY = 4 * (16 + 64) * (128 + 8) * 2;  // Skinny: 87,040 B
namespace gemm_emu {
namespace {
alignas(16) unsigned short gemm_smem[GEMM_SMEM_CAPACITY / 2];
}  // namespace
#pragma push_macro("__shared__")
#undef __shared__
#define __shared__
#include "../../cuda/gemm.cu"
#pragma pop_macro("__shared__")
}  // namespace gemm_emu

// The tensor-core attention, the same way: its `extern __shared__` buffer is
// attention_tc_smem below, sized for its largest config: head_dim 256 with 32-key pages,
// rows of 264 halves: two stages of a K and a V page, then the merged state, 132 floats
// a thread (135,168 B; head_dim 128's largest, 64-key pages or the deep ring, 104,448).
constexpr unsigned ATTENTION_TC_SMEM_CAPACITY = 2 * 2 * 32 * (256 + 8) * 2 + 128 * 132 * 4;
static_assert(ATTENTION_TC_SMEM_CAPACITY >= 3 * 2 * 64 * (128 + 8) * 2, "head_dim 128's deep b64");
namespace attention_tc_emu {
namespace {
alignas(16) unsigned short attention_tc_smem[ATTENTION_TC_SMEM_CAPACITY / 2];
}  // namespace
#pragma push_macro("__shared__")
#undef __shared__
#define __shared__
#include "../../cuda/attention_tc.cu"
#pragma pop_macro("__shared__")
}  // namespace attention_tc_emu

// decode_block.cu's persistent launch: its CTAs are resident together and meet at grid
// barriers (common.cuh's grid_sync), so its grid runs as one cluster here
// (run_persistent below: every CTA's threads fibers of one scheduler, a CTA running as far
// as it can alone before the next takes its turn), each CTA with its own window of
// dynamic shared memory (block_smem, and g_ptx_smem for the cp.async of its attention:
// the running fiber's CTA's). __shared__ expands to nothing while the file is read (it
// brings attention_tc.cuh, whose own-launch path names attention_tc_smem below: never
// run here, where its CTAs are virtual).
constexpr unsigned DECODE_BLOCK_SMEM_CAPACITY = 200 * 1024;  // decode_block_kernel.MAX_SMEM
constexpr unsigned DECODE_BLOCK_MAX_CTAS = emu::kMaxFibers / 256;
namespace decode_block_emu {
namespace {
alignas(16) unsigned char decode_block_windows[DECODE_BLOCK_MAX_CTAS][DECODE_BLOCK_SMEM_CAPACITY];
unsigned char* block_smem() { return decode_block_windows[emu::g_rank]; }
alignas(16) unsigned short attention_tc_smem[8];
}  // namespace
#pragma push_macro("__shared__")
#undef __shared__
#define __shared__
#include "../../cuda/decode_block.cu"
#pragma pop_macro("__shared__")
}  // namespace decode_block_emu

#include <atomic>
#include <string>

extern "C" {
void run_rmsnorm(int rows, const float* x, const __nv_bfloat16* w, __nv_bfloat16* out, int hidden, float eps) {
  launch({(unsigned)rows, 1, 1}, RMSNORM_THREADS, [&] { rmsnorm(x, w, out, hidden, eps); });
}
void run_head_rmsnorm(int tokens, __nv_bfloat16* qkv, const __nv_bfloat16* q_w, const __nv_bfloat16* k_w,
                      int heads, int kv_heads, int head_dim, float eps) {
  launch({(unsigned)(tokens * (heads + kv_heads)), 1, 1}, RMSNORM_THREADS,
         [&] { head_rmsnorm(qkv, q_w, k_w, heads, kv_heads, head_dim, eps); });
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
void run_add_bias(const float* y, const __nv_bfloat16* bias, __nv_bfloat16* out, long long tokens, int width,
                  int blocks) {
  launch({(unsigned)blocks, 1, 1}, 256, [&] { add_bias(y, bias, out, tokens, width); });
}
void run_embed(int tokens, const __nv_bfloat16* table, const int* ids, const __nv_bfloat16* prompt_rows,
               float* out, int hidden, int vocab, float scale) {
  launch({(unsigned)tokens, 1, 1}, 256, [&] { embed(table, ids, prompt_rows, out, hidden, vocab, scale); });
}
void run_kv_write(int tokens, int kv_heads, const __nv_bfloat16* k, const __nv_bfloat16* v, long long k_stride,
                  long long v_stride, const long long* slots, __nv_bfloat16* cache, int layer, int layers,
                  int block_size, int head_dim) {
  launch({(unsigned)tokens, (unsigned)kv_heads, 1}, head_dim < 128 ? head_dim : 128, [&] {
    kv_write(k, v, k_stride, v_stride, slots, cache, layer, layers, kv_heads, block_size, head_dim);
  });
}
void run_rope_kv_write(int tokens, int heads, int kv_heads, const __nv_bfloat16* qkv, long long stride,
                       const int* pos, const float* c, const float* s, __nv_bfloat16* q_out, const long long* slots,
                       __nv_bfloat16* cache, int layer, int layers, int block_size, int head_dim) {
  launch({(unsigned)tokens, (unsigned)(heads + kv_heads), 1}, head_dim / 2, [&] {
    rope_kv_write(qkv, stride, pos, c, s, q_out, slots, cache, layer, layers, heads, kv_heads, block_size, head_dim);
  });
}
void run_argmax(int rows, const float* logits, long long stride, int vocab, int* out) {
  launch({(unsigned)rows, 1, 1}, ARGMAX_THREADS, [&] { argmax(logits, stride, vocab, out); });
}
// argmax_split: grid (rows, ceil(vocab / slice)) of ARGMAX_SPLIT_THREADS, the slices'
// bests in part_v / part_i ([rows * slices]), counters ([rows], zero, left zero).
void run_argmax_split(int rows, const float* logits, long long stride, int vocab, int slice, float* part_v,
                      int* part_i, unsigned* counters, int* out) {
  const unsigned slices = static_cast<unsigned>((vocab + slice - 1) / slice);
  launch({(unsigned)rows, slices, 1}, ARGMAX_SPLIT_THREADS,
         [&] { argmax_split(logits, stride, vocab, slice, part_v, part_i, counters, out); });
}
void run_sample_sorted(int rows, const float* sorted, const int* ids, const int* top_k, const float* top_p,
                       const float* min_p, const float* uniforms, float* cum, int vocab, int* out) {
  launch({(unsigned)rows, 1, 1}, 128,
         [&] { sample_sorted(sorted, ids, top_k, top_p, min_p, uniforms, cum, vocab, out); });
}
void run_apply_penalties(int rows, float* logits, int vocab, const int* offsets, const int* ids, const int* counts,
                         const float* rep, const float* freq, const float* pres) {
  launch({(unsigned)rows, 1, 1}, 128, [&] { apply_penalties(logits, vocab, offsets, ids, counts, rep, freq, pres); });
}
void run_add_logit_bias(int rows, float* logits, int vocab, const int* offsets, const int* ids, const float* values) {
  launch({(unsigned)rows, 1, 1}, 128, [&] { add_logit_bias(logits, vocab, offsets, ids, values); });
}
void run_apply_token_mask(int rows, float* logits, int vocab, const unsigned* words, int num_words) {
  launch({(unsigned)rows, 1, 1}, 128, [&] { apply_token_mask(logits, vocab, words, num_words); });
}
void run_philox_uniform(const unsigned long long* seeds, const long long* positions, float* out, int n) {
  launch({(unsigned)((n + 255) / 256), 1, 1}, 256, [&] { philox_uniform(seeds, positions, out, n); });
}
// The sliding window run_paged_attention passes (attention_kernel's `window`; 0: none).
static int g_attention_window = 0;
void set_attention_window(int window) { g_attention_window = window; }
// The soft cap run_paged_attention passes (attention_kernel's `softcap`; 0: none).
static float g_attention_softcap = 0.0f;
void set_attention_softcap(float softcap) { g_attention_softcap = softcap; }
// Launch attention.cu's entry point for (head_dim, block_size) as attention_kernel does:
// grid (grid_x, grid_y), 128 threads; workspace and counters as the split reads them;
// the window set_attention_window set and the cap set_attention_softcap set.
int run_paged_attention(int head_dim, int block_size, int grid_x, int grid_y, unsigned short* out,
                        const unsigned short* q, const unsigned short* cache, const int* block_tables,
                        const int* seq_lens, const int* query_start_loc, float* workspace, unsigned* counters,
                        int num_tokens, int num_seqs, int max_blocks, int num_heads, int num_kv_heads,
                        int num_layers, int layer, int head_parts, int kv_lanes, float scale) {
  using Fn = void (*)(unsigned short*, const unsigned short*, const unsigned short*, const int*, const int*,
                      const int*, float*, unsigned*, int, int, int, int, int, int, int, int, int, float, int,
                      float);
  Fn fn = nullptr;
  if (head_dim == 64 && block_size == 16) fn = attention_emu::paged_attention_d64_b16;
  if (head_dim == 64 && block_size == 32) fn = attention_emu::paged_attention_d64_b32;
  if (head_dim == 64 && block_size == 64) fn = attention_emu::paged_attention_d64_b64;
  if (head_dim == 128 && block_size == 16) fn = attention_emu::paged_attention_d128_b16;
  if (head_dim == 128 && block_size == 32) fn = attention_emu::paged_attention_d128_b32;
  if (head_dim == 128 && block_size == 64) fn = attention_emu::paged_attention_d128_b64;
  if (head_dim == 256 && block_size == 16) fn = attention_emu::paged_attention_d256_b16;
  if (head_dim == 256 && block_size == 32) fn = attention_emu::paged_attention_d256_b32;
  if (head_dim == 256 && block_size == 64) fn = attention_emu::paged_attention_d256_b64;
  if (fn == nullptr) return 1;
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, 128, [&] {
    fn(out, q, cache, block_tables, seq_lens, query_start_loc, workspace, counters, num_tokens, num_seqs,
       max_blocks, num_heads, num_kv_heads, num_layers, layer, head_parts, kv_lanes, scale, g_attention_window,
       g_attention_softcap);
  });
  return 0;
}
// Launch gemm.cu's entry point `name` (gemm_kernel.launch_plan's names) as the launcher
// does: grid (grid_x, grid_y), `threads` threads, `smem_bytes` of dynamic shared memory,
// which starts out as 0xFF bytes (BF16 NaN) so that a read of an unwritten byte shows;
// y is the output.
// Returns 0, or 1: unknown name, 2: smem_bytes over the emulator's capacity, 3: some
// thread left cp.async copies uncommitted or in flight at its exit.
int run_gemm(const char* name, int grid_x, int grid_y, int threads, int smem_bytes, const unsigned short* x,
             const unsigned short* w, void* y, int M, int N, int K, int split_len) {
  using Bf16Fn = void (*)(const unsigned short*, const unsigned short*, unsigned short*, int, int, int, int);
  using F32Fn = void (*)(const unsigned short*, const unsigned short*, float*, int, int, int, int);
  const std::string n = name;
  Bf16Fn bf16 = nullptr;
  F32Fn f32 = nullptr;
#define BF16(fn) if (n == #fn) bf16 = gemm_emu::fn;
#define F32(fn) if (n == #fn) f32 = gemm_emu::fn;
  BF16(gemm_bf16_skinny) BF16(gemm_bf16_mid) BF16(gemm_bf16_big) BF16(gemm_bf16_mid_fold)
  BF16(gemm_bf16_big_fold) F32(gemm_f32_skinny) F32(gemm_f32_mid) F32(gemm_f32_big)
  F32(gemm_f32_mid_fold) F32(gemm_f32_big_fold)
#undef BF16
#undef F32
  if (bf16 == nullptr && f32 == nullptr) return 1;
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > GEMM_SMEM_CAPACITY) return 2;
  std::memset(gemm_emu::gemm_smem, 0xFF, sizeof gemm_emu::gemm_smem);
  g_ptx_smem = reinterpret_cast<unsigned char*>(gemm_emu::gemm_smem);
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  std::atomic<int> left_behind{0};
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, threads, [&] {
    if (bf16 != nullptr) bf16(x, w, static_cast<unsigned short*>(y), M, N, K, split_len);
    else f32(x, w, static_cast<float*>(y), M, N, K, split_len);
    if (!ptx_emu_cp_async_drained()) ++left_behind;
  });
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return left_behind.load() == 0 ? 0 : 3;
}

// gemm_bf16_skinny_split / gemm_f32_skinny_split as the launcher runs them: y the output,
// ws the fp32 workspace [S, M, N], counters one zero per tile. Returns as run_gemm does.
int run_gemm_split(const char* name, int grid_x, int grid_y, int threads, int smem_bytes, const unsigned short* x,
                   const unsigned short* w, float* ws, void* y, unsigned* counters, int M, int N, int K,
                   int split_len) {
  const std::string n = name;
  if (n != "gemm_bf16_skinny_split" && n != "gemm_f32_skinny_split") return 1;
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > GEMM_SMEM_CAPACITY) return 2;
  std::memset(gemm_emu::gemm_smem, 0xFF, sizeof gemm_emu::gemm_smem);
  g_ptx_smem = reinterpret_cast<unsigned char*>(gemm_emu::gemm_smem);
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  std::atomic<int> left_behind{0};
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, threads, [&] {
    if (n == "gemm_bf16_skinny_split")
      gemm_emu::gemm_bf16_skinny_split(x, w, ws, static_cast<unsigned short*>(y), counters, M, N, K, split_len);
    else
      gemm_emu::gemm_f32_skinny_split(x, w, ws, static_cast<float*>(y), counters, M, N, K, split_len);
    if (!ptx_emu_cp_async_drained()) ++left_behind;
  });
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return left_behind.load() == 0 ? 0 : 3;
}

// Later launches run their CTAs last to first (nonzero) or first to last (0).
void set_reversed_ctas(int reversed) { emu::g_reversed_ctas = reversed != 0; }
// Later launches' thread schedule (cuda_emu.h, g_warp_major): 0 every thread in turn, 1
// (2) one warp at a time as far as it goes alone, first to last (last to first).
void set_warp_major(int order) { emu::g_warp_major = order; }
// Nonzero: __fdiv_rn returns a hash of its operands' bits (cuda_emu.h, g_fdiv_probe).
void set_fdiv_probe(int on) { emu::g_fdiv_probe = on != 0; }
// Launch attention_tc.cu's entry point for (head_dim, block_size), its deep ring if
// `deep`, as attention_tc_kernel does: grid (grid_x, grid_y), 128 threads, `smem_bytes` of
// dynamic shared memory, which starts out as 0xFF bytes (BF16 NaN) so that a read of an
// unwritten byte shows; the window set_attention_window set, the cap set_attention_softcap.
// Returns 0, or 1: no such entry point, 2: smem_bytes over the emulator's capacity,
// 3: some thread left cp.async copies uncommitted or in flight at its exit.
int run_paged_attention_tc(int head_dim, int block_size, int deep, int grid_x, int grid_y, int smem_bytes,
                           unsigned short* out, const unsigned short* q, const unsigned short* cache,
                           const int* block_tables, const int* seq_lens, const int* query_start_loc,
                           float* workspace, unsigned* counters, int num_tokens, int num_seqs, int max_blocks,
                           int num_heads, int num_kv_heads, int num_layers, int layer, int head_parts,
                           int kv_lanes, float scale) {
  using Fn = void (*)(unsigned short*, const unsigned short*, const unsigned short*, const int*, const int*,
                      const int*, float*, unsigned*, int, int, int, int, int, int, int, int, int, float, int,
                      float);
  Fn fn = nullptr;
#define TC(d, b) \
  if (head_dim == d && block_size == b) \
    fn = deep ? attention_tc_emu::paged_attention_tc_d##d##_b##b##_deep : attention_tc_emu::paged_attention_tc_d##d##_b##b;
  TC(64, 16) TC(64, 32) TC(64, 64) TC(128, 16) TC(128, 32) TC(128, 64)
#undef TC
  if (head_dim == 256 && !deep && block_size == 16) fn = attention_tc_emu::paged_attention_tc_d256_b16;
  if (head_dim == 256 && !deep && block_size == 32) fn = attention_tc_emu::paged_attention_tc_d256_b32;
  if (fn == nullptr) return 1;
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > ATTENTION_TC_SMEM_CAPACITY) return 2;
  std::memset(attention_tc_emu::attention_tc_smem, 0xFF, sizeof attention_tc_emu::attention_tc_smem);
  g_ptx_smem = reinterpret_cast<unsigned char*>(attention_tc_emu::attention_tc_smem);
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  std::atomic<int> left_behind{0};
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, 128, [&] {
    fn(out, q, cache, block_tables, seq_lens, query_start_loc, workspace, counters, num_tokens, num_seqs,
       max_blocks, num_heads, num_kv_heads, num_layers, layer, head_parts, kv_lanes, scale, g_attention_window,
       g_attention_softcap);
    if (!ptx_emu_cp_async_drained()) ++left_behind;
  });
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return left_behind.load() == 0 ? 0 : 3;
}
}

// ---------------------------------------------------------------------------------------
// A launch by name, as the CUDA driver takes one (tests/kernel_emu/emucupy.py, the
// emulated CuPy the engine runs on in tests/test_cupy_emulated.py): `args[i]` points at
// the value of parameter i. The driver cannot check what it is handed; this one can, as
// the parameter types are known here: each argument's kind (pointer or value) and size
// (a value's bytes, or a pointer's element bytes; 0: any) must match the kernel's, so
// an np.int64 passed for an `int`, or an fp32 array for a BF16 pointer, fails here with
// its name instead of reading garbage on a GPU.
#include <string_view>
#include <type_traits>
#include <utility>

namespace {
struct NamedLaunch {
  dim3 grid;
  int threads;
  void** args;
  const int* sizes;    // per argument: a value's bytes or an array's element bytes
  const int* is_array; // per argument: 1 for a device array, 0 for a value
  int count;
  char* error;
  int error_len;
};

template <class A> constexpr int element_bytes() {
  using E = std::remove_cv_t<std::remove_pointer_t<A>>;
  if constexpr (std::is_void_v<E>) return 0;
  else return static_cast<int>(sizeof(E));
}

template <class... A, std::size_t... I>
void call_unpacked(void (*fn)(A...), void** args, std::index_sequence<I...>) {
  fn(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// `left_behind`, when given, counts the threads that exit with cp.async copies in flight.
template <class... A>
int launch_checked(void (*fn)(A...), const char* name, const NamedLaunch& l, std::atomic<int>* left_behind = nullptr) {
  constexpr int n = sizeof...(A);
  if (l.count != n) {
    std::snprintf(l.error, l.error_len, "%s takes %d arguments; got %d", name, n, l.count);
    return 4;
  }
  const bool pointer[] = {std::is_pointer_v<A>...};
  const int bytes[] = {(std::is_pointer_v<A> ? element_bytes<A>() : static_cast<int>(sizeof(A)))...};
  for (int i = 0; i < n; ++i) {
    if (pointer[i] != (l.is_array[i] != 0)) {
      std::snprintf(l.error, l.error_len, "%s argument %d must be %s", name, i,
                    pointer[i] ? "a device array" : "a value (a NumPy scalar)");
      return 4;
    }
    if (bytes[i] != 0 && bytes[i] != l.sizes[i]) {
      std::snprintf(l.error, l.error_len, "%s argument %d must be %s of %d bytes; got %d", name, i,
                    pointer[i] ? "an array of elements" : "a value", bytes[i], l.sizes[i]);
      return 4;
    }
  }
  launch(l.grid, l.threads, [&] {
    call_unpacked(fn, l.args, std::index_sequence_for<A...>{});
    if (left_behind != nullptr && !ptx_emu_cp_async_drained()) ++*left_behind;
  });
  return 0;
}

// Run `body(left_behind)` with the launch's dynamic shared memory in `buffer` (0xFF
// bytes first, so that a read of an unwritten byte shows); 2: more asked than the buffer
// holds, 3: some thread left cp.async copies in flight.
template <class F> int with_dynamic_smem(unsigned short* buffer, unsigned capacity, int smem_bytes, F body) {
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > capacity) return 2;
  std::memset(buffer, 0xFF, capacity);
  g_ptx_smem = reinterpret_cast<unsigned char*>(buffer);
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  std::atomic<int> left_behind{0};
  const int rc = body(&left_behind);
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return rc != 0 ? rc : left_behind.load() == 0 ? 0 : 3;
}

// A persistent launch (decode_block.cu): the grid as one cluster of at most
// DECODE_BLOCK_MAX_CTAS CTAs, each its own shared memory window (0xFF bytes first).
template <class... A>
int run_persistent(void (*fn)(A...), const char* name, const NamedLaunch& l, int smem_bytes) {
  if (l.grid.y != 1 || l.grid.z != 1 || l.grid.x > DECODE_BLOCK_MAX_CTAS) {
    std::snprintf(l.error, l.error_len, "%s: a persistent grid of (%u, %u) CTAs; the emulator runs 1-d grids of "
                  "at most %u", name, l.grid.x, l.grid.y, DECODE_BLOCK_MAX_CTAS);
    return 5;
  }
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > DECODE_BLOCK_SMEM_CAPACITY) return 2;
  std::memset(decode_block_emu::decode_block_windows, 0xFF, sizeof decode_block_emu::decode_block_windows);
  const unsigned cluster = emu::g_cluster_x;
  emu::g_cluster_x = l.grid.x;
  emu::g_on_switch = [](unsigned rank) { g_ptx_smem = decode_block_emu::decode_block_windows[rank]; };
  g_ptx_smem = decode_block_emu::decode_block_windows[0];
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  std::atomic<int> left_behind{0};
  const int rc = launch_checked(fn, name, l, &left_behind);
  emu::g_on_switch = nullptr;
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  emu::g_cluster_x = cluster;
  return rc != 0 ? rc : left_behind.load() == 0 ? 0 : 3;
}
}  // namespace

extern "C" {
// How many threads called pdl_enter since the last call (ptx_emu.h).
unsigned long long emu_pdl_entered() { return g_pdl_entered.exchange(0); }
// mma.sync by threads past each CTA's first warp since the last call (ptx_emu.h).
unsigned long long emu_mma_past_warp0() { return g_mma_past_warp0.exchange(0); }
// Bytes read by ldg_evict_first since the last call (ptx_emu.h).
unsigned long long emu_evict_first_bytes() { return g_evict_first_bytes.exchange(0); }
// Name `bytes` at `begin` as written by the grid before (cuda_emu.h, "Reads before a
// grid's wait"); a null `begin` forgets every range named and zeroes the counts.
void set_unready(const void* begin, unsigned long long bytes) {
  if (begin == nullptr) {
    emu::g_unready.clear();
    emu::g_unready_reads = emu::g_early_reads = 0;
    return;
  }
  const char* b = static_cast<const char*>(begin);
  emu::g_unready.emplace_back(b, b + bytes);
}
// Reads of unready bytes before a thread's wait, and of other bytes before it, since the
// last call (then zeroed): [unready, early].
void emu_unready_reads(unsigned long long* out) {
  out[0] = emu::g_unready_reads;
  out[1] = emu::g_early_reads;
  emu::g_unready_reads = emu::g_early_reads = 0;
}

// 0: launched; 1: no such kernel; 2: dynamic shared memory over the emulator's buffer;
// 3: cp.async copies left in flight; 4: arguments that do not fit the kernel (`error`
// says which); 5: a launch shape the emulator does not run (`error` says why).
int emu_launch(const char* name, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
               unsigned block_y, unsigned block_z, int smem_bytes, void** args, const int* sizes,
               const int* is_array, int count, char* error, int error_len) {
  if (block_y != 1 || block_z != 1 || block_x == 0 || block_x > 1024 || grid_x == 0 || grid_y == 0 ||
      grid_z == 0) {
    std::snprintf(error, error_len, "%s: launch grid (%u, %u, %u) block (%u, %u, %u): the emulator runs "
                  "grids of 1-d blocks of 1 to 1024 threads", name, grid_x, grid_y, grid_z,
                  block_x, block_y, block_z);
    return 5;
  }
  const NamedLaunch l{{grid_x, grid_y, grid_z}, static_cast<int>(block_x), args, sizes, is_array, count, error,
                      error_len};
  const std::string_view n = name;
#define PLAIN(fn) if (n == #fn) return launch_checked(fn, name, l);
  PLAIN(rmsnorm) PLAIN(add_rmsnorm) PLAIN(norm_add_rmsnorm) PLAIN(norm_add) PLAIN(head_rmsnorm) PLAIN(rope) PLAIN(silu_mul) PLAIN(gelu_tanh_mul) PLAIN(logit_softcap) PLAIN(add_bias)
  PLAIN(embed) PLAIN(kv_write)
  PLAIN(rope_kv_write)
  PLAIN(argmax) PLAIN(argmax_split) PLAIN(sample_sorted) PLAIN(philox_uniform) PLAIN(apply_penalties)
  PLAIN(add_logit_bias) PLAIN(apply_token_mask)
#undef PLAIN
  if (n == "qk_rmsnorm")
    return with_dynamic_smem(rmsnorm_smem, RMSNORM_SMEM_CAPACITY, smem_bytes,
                             [&](auto*) { return launch_checked(qk_rmsnorm, name, l); });
#define ATTENTION(fn) if (n == #fn) return launch_checked(attention_emu::fn, name, l);
  ATTENTION(paged_attention_d64_b16) ATTENTION(paged_attention_d64_b32) ATTENTION(paged_attention_d64_b64)
  ATTENTION(paged_attention_d128_b16) ATTENTION(paged_attention_d128_b32) ATTENTION(paged_attention_d128_b64)
  ATTENTION(paged_attention_d256_b16) ATTENTION(paged_attention_d256_b32) ATTENTION(paged_attention_d256_b64)
#undef ATTENTION
#define MOE(fn) if (n == #fn) return launch_checked(moe_emu::fn, name, l);
  MOE(moe_route_topk) MOE(moe_route_rows) MOE(moe_gather) MOE(moe_combine)
#undef MOE
#define GEMM(fn) if (n == #fn) return with_dynamic_smem(gemm_emu::gemm_smem, GEMM_SMEM_CAPACITY, smem_bytes, \
    [&](auto* left) { return launch_checked(gemm_emu::fn, name, l, left); });
  GEMM(gemm_bf16_skinny) GEMM(gemm_f32_skinny) GEMM(gemm_bf16_mid) GEMM(gemm_f32_mid)
  GEMM(gemm_bf16_big) GEMM(gemm_f32_big) GEMM(gemm_bf16_skinny_split) GEMM(gemm_f32_skinny_split) GEMM(gemm_bf16_mid_fold)
  GEMM(gemm_f32_mid_fold) GEMM(gemm_bf16_big_fold) GEMM(gemm_f32_big_fold)
  GEMM(moe_gemm_bf16_skinny) GEMM(moe_gemm_bf16_mid) GEMM(moe_gemm_bf16_big)
#undef GEMM
#define TC(fn) if (n == #fn) return with_dynamic_smem(attention_tc_emu::attention_tc_smem, \
    ATTENTION_TC_SMEM_CAPACITY, smem_bytes, [&](auto* left) { return launch_checked(attention_tc_emu::fn, name, l, left); });
  TC(paged_attention_tc_d64_b16) TC(paged_attention_tc_d64_b32) TC(paged_attention_tc_d64_b64)
  TC(paged_attention_tc_d128_b16) TC(paged_attention_tc_d128_b32) TC(paged_attention_tc_d128_b64)
  TC(paged_attention_tc_d64_b16_deep) TC(paged_attention_tc_d64_b32_deep) TC(paged_attention_tc_d64_b64_deep)
  TC(paged_attention_tc_d128_b16_deep) TC(paged_attention_tc_d128_b32_deep) TC(paged_attention_tc_d128_b64_deep)
  TC(paged_attention_tc_d256_b16) TC(paged_attention_tc_d256_b32)
#undef TC
#define PERSISTENT(fn) if (n == #fn) return run_persistent(decode_block_emu::fn, name, l, smem_bytes);
  PERSISTENT(decode_tail_plain) PERSISTENT(decode_tail_packed)
  PERSISTENT(decode_layer_plain_d64_b16) PERSISTENT(decode_layer_plain_d64_b32) PERSISTENT(decode_layer_plain_d128_b32)
  PERSISTENT(decode_layer_packed_d64_b16) PERSISTENT(decode_layer_packed_d64_b32)
  PERSISTENT(decode_layer_packed_d128_b32)
#undef PERSISTENT
  std::snprintf(error, error_len, "no kernel named %s", name);
  return 1;
}
}
