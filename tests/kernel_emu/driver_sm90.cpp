// The Hopper GEMM (cuda/gemm_sm90.cu) behind a plain C entry point that launches it on
// cuda_emu.h's threads, its PTX wrappers from ptx_emu.h (cp.async), wgmma_emu.h
// (warpgroup MMA) and mbarrier_emu.h (mbarriers, bulk copies). A library of its own (tests/test_gemm_sm90.py builds it), so the
// shared emulation (driver.cpp) is untouched.
#include "cuda_emu.h"
// gemm_sm90.cu asks for one block per SM: __launch_bounds__(threads, 1).
#undef __launch_bounds__
#define __launch_bounds__(...)
#define REPRISE_EMULATE_PTX 1
#include "ptx_emu.h"
#include "wgmma_emu.h"
#include "mbarrier_emu.h"
#include "../../cuda/common.cuh"  // at file scope, before the source (as driver.cpp does)
#include "../../cuda/rmsnorm.cuh"  // the row epilogues' functions, likewise
#include "../../cuda/kvcache.cuh"

#include <functional>
#include <string>

// Its `extern __shared__` buffer is gemm_sm90_smem below, sized for the largest tile
// config; __shared__ expands to nothing while the file is read (as driver.cpp does for
// gemm.cu).
constexpr unsigned GEMM_SM90_SMEM_CAPACITY = 204880;  // WsTall: 5 stages of 40 KB and 10 mbarriers
namespace gemm_sm90_emu {
namespace {
alignas(1024) unsigned char gemm_sm90_smem[GEMM_SM90_SMEM_CAPACITY];  // the swizzle atoms
// The other CTAs' of a cluster (the _c2 entry points: 2; the _csplit ones: S, up to
// MAX_CLUSTER): each CTA its own window, which the kernel reaches through cta_smem.
alignas(1024) unsigned char gemm_sm90_smem_peers[MAX_CLUSTER - 1][GEMM_SM90_SMEM_CAPACITY];
}  // namespace
#pragma push_macro("__shared__")
#undef __shared__
#define __shared__
#include "../../cuda/gemm_sm90.cu"
#pragma pop_macro("__shared__")
}  // namespace gemm_sm90_emu

extern "C" {
// Bytes the bulk copies read under L2's evict-first policy since the last call
// (mbarrier_emu.h's bulk_copy_g2s_hinted: the weight tiles of a launch with one m tile).
unsigned long long emu_evict_first_bytes() { return g_evict_first_bytes.exchange(0); }

// Launch gemm_sm90.cu's entry point `name` as gemm_sm90_kernel launches it: grid
// (grid_x, grid_y), `threads` threads, `smem_bytes` of dynamic shared memory, which
// starts out as 0xFF bytes (BF16 NaN) so that a read of an unwritten byte shows.
// Returns 0, or 1: unknown name, 2: smem_bytes over the emulator's capacity, 3: some
// thread left cp.async copies or wgmma groups uncommitted or in flight at its exit.
int run_gemm_sm90(const char* name, int grid_x, int grid_y, int threads, int smem_bytes, const unsigned short* x,
                  const unsigned short* w, void* y, int M, int N, int K) {
  using Bf16Fn = void (*)(const unsigned short*, const unsigned short*, unsigned short*, int, int, int);
  using F32Fn = void (*)(const unsigned short*, const unsigned short*, float*, int, int, int);
  const std::string n = name;
  Bf16Fn bf16 = nullptr;
  F32Fn f32 = nullptr;
  if (n == "gemm_sm90_bf16_wg1") bf16 = gemm_sm90_emu::gemm_sm90_bf16_wg1;
  if (n == "gemm_sm90_bf16_wg2") bf16 = gemm_sm90_emu::gemm_sm90_bf16_wg2;
  if (n == "gemm_sm90_bf16_wg2wide") bf16 = gemm_sm90_emu::gemm_sm90_bf16_wg2wide;
  if (n == "gemm_sm90_f32_wg1") f32 = gemm_sm90_emu::gemm_sm90_f32_wg1;
  if (n == "gemm_sm90_f32_wg2") f32 = gemm_sm90_emu::gemm_sm90_f32_wg2;
  if (n == "gemm_sm90_f32_wg2wide") f32 = gemm_sm90_emu::gemm_sm90_f32_wg2wide;
  if (bf16 == nullptr && f32 == nullptr) return 1;
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > GEMM_SM90_SMEM_CAPACITY) return 2;
  std::memset(gemm_sm90_emu::gemm_sm90_smem, 0xFF, sizeof gemm_sm90_emu::gemm_sm90_smem);
  g_ptx_smem = gemm_sm90_emu::gemm_sm90_smem;
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  int left_behind = 0;
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, threads, [&] {
    if (bf16 != nullptr) bf16(x, w, static_cast<unsigned short*>(y), M, N, K);
    else f32(x, w, static_cast<float*>(y), M, N, K);
    const bool copies = ptx_emu_cp_async_drained(), mmas = wgmma_emu_drained();
    if (!copies || !mmas) ++left_behind;
  });
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return left_behind == 0 ? 0 : 3;
}

// The warp-specialized WHOLE entry points on a packed weight, as run_gemm_sm90 launches
// the others: gemm_sm90_ws_{bf16,f32} (tile 0), gemm_sm90_ws_{bf16,f32}_wide (tile 1)
// gemm_sm90_ws_{bf16,f32}_decode (tile 2) and gemm_sm90_ws_{bf16,f32}_m64 (tile 3); the
// same return codes.
int run_gemm_sm90_ws(int out_f32, int tile, int grid_x, int grid_y, int threads, int smem_bytes,
                     const unsigned short* x, const unsigned char* w_packed, void* y, int M, int N, int K) {
  namespace e = gemm_sm90_emu;
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > GEMM_SM90_SMEM_CAPACITY) return 2;
  std::memset(e::gemm_sm90_smem, 0xFF, sizeof e::gemm_sm90_smem);
  g_ptx_smem = e::gemm_sm90_smem;
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  auto* y16 = static_cast<unsigned short*>(y);
  auto* y32 = static_cast<float*>(y);
  int left_behind = 0;
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, threads, [&] {
    if (threadIdx.x == 0) mbar_emu_reset();  // runs first in its CTA: before any init
    if (tile == 1 && out_f32) e::gemm_sm90_ws_f32_wide(x, w_packed, y32, M, N, K);
    else if (tile == 1) e::gemm_sm90_ws_bf16_wide(x, w_packed, y16, M, N, K);
    else if (tile == 2 && out_f32) e::gemm_sm90_ws_f32_decode(x, w_packed, y32, M, N, K);
    else if (tile == 2) e::gemm_sm90_ws_bf16_decode(x, w_packed, y16, M, N, K);
    else if (tile == 3 && out_f32) e::gemm_sm90_ws_f32_m64(x, w_packed, y32, M, N, K);
    else if (tile == 3) e::gemm_sm90_ws_bf16_m64(x, w_packed, y16, M, N, K);
    else if (out_f32) e::gemm_sm90_ws_f32(x, w_packed, y32, M, N, K);
    else e::gemm_sm90_ws_bf16(x, w_packed, y16, M, N, K);
    const bool copies = ptx_emu_cp_async_drained(), mmas = wgmma_emu_drained();
    if (!copies || !mmas) ++left_behind;
  });
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return left_behind == 0 ? 0 : 3;
}

// The split-K entry points (S > 1), as gemm_sm90_kernel.launch_plan names them:
// gemm_sm90_{bf16,f32}_wg1_split and gemm_sm90_ws_{bf16,f32}_split (partials through the
// fp32 workspace ws [S, M, N], folded by each tile's last CTA, which counts in
// `counters`), gemm_sm90_{bf16,f32}_wg2_fold and gemm_sm90_ws_{bf16,f32}_fold (each CTA
// walks all of K; ws and counters unused; gemm_sm90_ws_{bf16,f32}_tall_fold too, on the
// three-consumer tile), gemm_sm90_ws_{bf16,f32}_wide_fold (the same,
// its running totals in ws [M, N]), gemm_sm90_ws_{bf16,f32}_decode_split (PARTIAL on the
// decode tile), gemm_sm90_ws_{bf16,f32}_m64_split (PARTIAL on the 64 x 128 tile). w is the
// packed weight for gemm_sm90_ws_*.
// The _c2 entry points run in clusters of two CTAs along x (emu::g_cluster_x), the _csplit
// ones in clusters of the split count S, each CTA with its own shared memory. Returns as
// run_gemm_sm90, or 4: a grid.x that is not whole clusters (or a cluster past 8).
int run_gemm_sm90_split(const char* name, int grid_x, int grid_y, int threads, int smem_bytes,
                        const unsigned short* x, const void* w, float* ws, void* y, unsigned* counters, int M,
                        int N, int K, int split_len) {
  namespace e = gemm_sm90_emu;
  using Plain = const unsigned short*;
  using Packed = const unsigned char*;
  const std::string n = name;
  auto* y16 = static_cast<unsigned short*>(y);
  auto* y32 = static_cast<float*>(y);
  std::function<void()> body;
  if (n == "gemm_sm90_bf16_wg1_split")
    body = [&] { e::gemm_sm90_bf16_wg1_split(x, static_cast<Plain>(w), ws, y16, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_f32_wg1_split")
    body = [&] { e::gemm_sm90_f32_wg1_split(x, static_cast<Plain>(w), ws, y32, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_bf16_wg2_fold")
    body = [&] { e::gemm_sm90_bf16_wg2_fold(x, static_cast<Plain>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_f32_wg2_fold")
    body = [&] { e::gemm_sm90_f32_wg2_fold(x, static_cast<Plain>(w), y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_fold")
    body = [&] { e::gemm_sm90_ws_bf16_fold(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_fold")
    body = [&] { e::gemm_sm90_ws_f32_fold(x, static_cast<Packed>(w), y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_split")
    body = [&] { e::gemm_sm90_ws_bf16_split(x, static_cast<Packed>(w), ws, y16, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_tall_fold")
    body = [&] { e::gemm_sm90_ws_bf16_tall_fold(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_tall_fold")
    body = [&] { e::gemm_sm90_ws_f32_tall_fold(x, static_cast<Packed>(w), y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_wide_fold")  // ws holds the [M, N] running totals
    body = [&] { e::gemm_sm90_ws_bf16_wide_fold(x, static_cast<Packed>(w), ws, y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_wide_fold")
    body = [&] { e::gemm_sm90_ws_f32_wide_fold(x, static_cast<Packed>(w), ws, y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_decode_split")
    body = [&] { e::gemm_sm90_ws_bf16_decode_split(x, static_cast<Packed>(w), ws, y16, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_decode_split")
    body = [&] { e::gemm_sm90_ws_f32_decode_split(x, static_cast<Packed>(w), ws, y32, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_m64_split")
    body = [&] { e::gemm_sm90_ws_bf16_m64_split(x, static_cast<Packed>(w), ws, y16, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_m64_split")
    body = [&] { e::gemm_sm90_ws_f32_m64_split(x, static_cast<Packed>(w), ws, y32, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_split")
    body = [&] { e::gemm_sm90_ws_f32_split(x, static_cast<Packed>(w), ws, y32, counters, M, N, K, split_len); };
  // The gated entry points (y: [M, N / 2] BF16), WHOLE ones ignoring ws, counters and split_len.
  if (n == "gemm_sm90_ws_gated") body = [&] { e::gemm_sm90_ws_gated(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_gated_wide")
    body = [&] { e::gemm_sm90_ws_gated_wide(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_gated_decode")
    body = [&] { e::gemm_sm90_ws_gated_decode(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_gated_m64")
    body = [&] { e::gemm_sm90_ws_gated_m64(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_gated_split")
    body = [&] { e::gemm_sm90_ws_gated_split(x, static_cast<Packed>(w), ws, y16, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_gated_decode_split")
    body = [&] {
      e::gemm_sm90_ws_gated_decode_split(x, static_cast<Packed>(w), ws, y16, counters, M, N, K, split_len);
    };
  if (n == "gemm_sm90_ws_gated_m64_split")
    body = [&] { e::gemm_sm90_ws_gated_m64_split(x, static_cast<Packed>(w), ws, y16, counters, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_gated_fold")
    body = [&] { e::gemm_sm90_ws_gated_fold(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_gated_tall_fold")
    body = [&] { e::gemm_sm90_ws_gated_tall_fold(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  // Clusters of two CTAs along M (WHOLE ones ignoring ws, counters and split_len).
  if (n == "gemm_sm90_ws_bf16_c2") body = [&] { e::gemm_sm90_ws_bf16_c2(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_f32_c2") body = [&] { e::gemm_sm90_ws_f32_c2(x, static_cast<Packed>(w), y32, M, N, K); };
  if (n == "gemm_sm90_ws_gated_c2") body = [&] { e::gemm_sm90_ws_gated_c2(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_bf16_wide_c2")
    body = [&] { e::gemm_sm90_ws_bf16_wide_c2(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_f32_wide_c2")
    body = [&] { e::gemm_sm90_ws_f32_wide_c2(x, static_cast<Packed>(w), y32, M, N, K); };
  if (n == "gemm_sm90_ws_gated_wide_c2")
    body = [&] { e::gemm_sm90_ws_gated_wide_c2(x, static_cast<Packed>(w), y16, M, N, K); };
  if (n == "gemm_sm90_ws_bf16_fold_c2")
    body = [&] { e::gemm_sm90_ws_bf16_fold_c2(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_fold_c2")
    body = [&] { e::gemm_sm90_ws_f32_fold_c2(x, static_cast<Packed>(w), y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_gated_fold_c2")
    body = [&] { e::gemm_sm90_ws_gated_fold_c2(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  // The cluster split (S CTAs a cluster; ws and counters unused).
  if (n == "gemm_sm90_ws_bf16_csplit")
    body = [&] { e::gemm_sm90_ws_bf16_csplit(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_csplit")
    body = [&] { e::gemm_sm90_ws_f32_csplit(x, static_cast<Packed>(w), y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_gated_csplit")
    body = [&] { e::gemm_sm90_ws_gated_csplit(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_decode_csplit")
    body = [&] { e::gemm_sm90_ws_bf16_decode_csplit(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_decode_csplit")
    body = [&] { e::gemm_sm90_ws_f32_decode_csplit(x, static_cast<Packed>(w), y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_gated_decode_csplit")
    body = [&] { e::gemm_sm90_ws_gated_decode_csplit(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_bf16_m64_csplit")
    body = [&] { e::gemm_sm90_ws_bf16_m64_csplit(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_f32_m64_csplit")
    body = [&] { e::gemm_sm90_ws_f32_m64_csplit(x, static_cast<Packed>(w), y32, M, N, K, split_len); };
  if (n == "gemm_sm90_ws_gated_m64_csplit")
    body = [&] { e::gemm_sm90_ws_gated_m64_csplit(x, static_cast<Packed>(w), y16, M, N, K, split_len); };
  if (!body) return 1;
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > GEMM_SM90_SMEM_CAPACITY) return 2;
  const bool warp_specialized = n.rfind("gemm_sm90_ws_", 0) == 0;
  const auto ends_with = [&](const char* tail) {
    const std::string t = tail;
    return n.size() > t.size() && n.compare(n.size() - t.size(), t.size(), t) == 0;
  };
  // CTAs a cluster: 2 (_c2), the split count (_csplit: the tile's S splits), else 1
  const unsigned cluster = ends_with("_c2") ? 2u
                           : ends_with("_csplit") && split_len > 0 ? static_cast<unsigned>((K + split_len - 1) / split_len)
                                                                   : 1u;
  if (cluster > MAX_CLUSTER || grid_x % cluster != 0) return 4;  // a grid that is not whole clusters
  std::memset(e::gemm_sm90_smem, 0xFF, sizeof e::gemm_sm90_smem);
  g_ptx_smem = e::gemm_sm90_smem;
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  if (cluster > 1) {  // each CTA of the cluster its own window, the running thread's in g_ptx_smem
    g_cluster_smem[0] = e::gemm_sm90_smem;
    for (unsigned r = 1; r < cluster; ++r) {
      std::memset(e::gemm_sm90_smem_peers[r - 1], 0xFF, GEMM_SM90_SMEM_CAPACITY);
      g_cluster_smem[r] = e::gemm_sm90_smem_peers[r - 1];
    }
    emu::g_cluster_x = cluster;
    emu::g_on_switch = [](unsigned rank) { g_ptx_smem = g_cluster_smem[rank]; };
  }
  int left_behind = 0;
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, threads, [&] {
    if (warp_specialized && threadIdx.x == 0) mbar_emu_reset();  // runs first in its CTA
    body();
    const bool copies = ptx_emu_cp_async_drained(), mmas = wgmma_emu_drained();
    if (!copies || !mmas) ++left_behind;
  });
  emu::g_cluster_x = 1;
  emu::g_on_switch = nullptr;
  for (auto& window : g_cluster_smem) window = nullptr;
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return left_behind == 0 ? 0 : 3;
}

}  // extern "C"

// One launch of a ws entry point's `body` on cuda_emu.h's threads, as run_gemm_sm90_ws
// makes it: shared memory poisoned, each CTA's mbarriers reset before its first thread
// runs; the same return codes (2: smem_bytes over capacity, 3: work left in flight).
static int run_ws_grid(int grid_x, int grid_y, int threads, int smem_bytes, const std::function<void()>& body) {
  namespace e = gemm_sm90_emu;
  if (smem_bytes < 0 || static_cast<unsigned>(smem_bytes) > GEMM_SM90_SMEM_CAPACITY) return 2;
  std::memset(e::gemm_sm90_smem, 0xFF, sizeof e::gemm_sm90_smem);
  g_ptx_smem = e::gemm_sm90_smem;
  g_ptx_smem_bytes = static_cast<unsigned>(smem_bytes);
  int left_behind = 0;
  launch({(unsigned)grid_x, (unsigned)grid_y, 1}, threads, [&] {
    if (threadIdx.x == 0) mbar_emu_reset();  // runs first in its CTA: before any init
    body();
    const bool copies = ptx_emu_cp_async_drained(), mmas = wgmma_emu_drained();
    if (!copies || !mmas) ++left_behind;
  });
  g_ptx_smem = nullptr;
  g_ptx_smem_bytes = 0;
  return left_behind == 0 ? 0 : 3;
}

extern "C" {
// The norm epilogue's entry points (gemm_sm90_ws_norm_{decode,m64}[_split]): the BF16
// product into y (PARTIAL: through ws, counted in `counters`), then add_rmsnorm of its rows
// into summed and normed, by the CTA that completes the m tile's last n tile (counted in
// the counter past the fold's). The same return codes as run_gemm_sm90.
int run_gemm_sm90_norm(const char* name, int grid_x, int grid_y, int threads, int smem_bytes,
                       const unsigned short* x, const unsigned char* w_packed, float* ws, unsigned short* y,
                       unsigned* counters, int M, int N, int K, int split_len, const float* residual,
                       const __nv_bfloat16* norm_weight, float* summed, __nv_bfloat16* normed, float eps) {
  namespace e = gemm_sm90_emu;
  using Fn = void (*)(const unsigned short*, const unsigned char*, float*, unsigned short*, unsigned*, int, int,
                      int, int, const float*, const __nv_bfloat16*, float*, __nv_bfloat16*, float);
  const std::string n = name;
  Fn fn = nullptr;
  if (n == "gemm_sm90_ws_norm_decode") fn = e::gemm_sm90_ws_norm_decode;
  if (n == "gemm_sm90_ws_norm_decode_split") fn = e::gemm_sm90_ws_norm_decode_split;
  if (n == "gemm_sm90_ws_norm_m64") fn = e::gemm_sm90_ws_norm_m64;
  if (n == "gemm_sm90_ws_norm_m64_split") fn = e::gemm_sm90_ws_norm_m64_split;
  if (fn == nullptr) return 1;
  return run_ws_grid(grid_x, grid_y, threads, smem_bytes, [&] {
    fn(x, w_packed, ws, y, counters, M, N, K, split_len, residual, norm_weight, summed, normed, eps);
  });
}

// The rope epilogue's entry points (gemm_sm90_ws_rope_{decode,m64}[_split]): the BF16
// product into y (PARTIAL: through ws), then rope_kv_write's work on its rows (q_out, the
// cache), by the CTA that completes the m tile's last n tile. The same return codes.
int run_gemm_sm90_rope(const char* name, int grid_x, int grid_y, int threads, int smem_bytes,
                       const unsigned short* x, const unsigned char* w_packed, float* ws, unsigned short* y,
                       unsigned* counters, int M, int N, int K, int split_len, const int* positions,
                       const float* cos_table, const float* sin_table, __nv_bfloat16* q_out,
                       const long long* slots, __nv_bfloat16* cache, int layer, int num_layers, int heads,
                       int kv_heads, int block_size, int head_dim) {
  namespace e = gemm_sm90_emu;
  using Fn = void (*)(const unsigned short*, const unsigned char*, float*, unsigned short*, unsigned*, int, int,
                      int, int, const int*, const float*, const float*, __nv_bfloat16*, const long long*,
                      __nv_bfloat16*, int, int, int, int, int, int);
  const std::string n = name;
  Fn fn = nullptr;
  if (n == "gemm_sm90_ws_rope_decode") fn = e::gemm_sm90_ws_rope_decode;
  if (n == "gemm_sm90_ws_rope_decode_split") fn = e::gemm_sm90_ws_rope_decode_split;
  if (n == "gemm_sm90_ws_rope_m64") fn = e::gemm_sm90_ws_rope_m64;
  if (n == "gemm_sm90_ws_rope_m64_split") fn = e::gemm_sm90_ws_rope_m64_split;
  if (fn == nullptr) return 1;
  return run_ws_grid(grid_x, grid_y, threads, smem_bytes, [&] {
    fn(x, w_packed, ws, y, counters, M, N, K, split_len, positions, cos_table, sin_table, q_out, slots, cache,
       layer, num_layers, heads, kv_heads, block_size, head_dim);
  });
}

// Nonzero: launch() runs a grid's CTAs last to first (the split's counters then see
// every other finishing order than launch order's).
void set_reversed_ctas(int reversed) { emu::g_reversed_ctas = reversed != 0; }
// Later launches' thread schedule (cuda_emu.h, g_warp_major): 0 every thread in turn, 1
// (2) one warp at a time as far as it goes alone, first to last (last to first).
void set_warp_major(int order) { emu::g_warp_major = order; }
// A permutation of the grid's CTAs to run them in (the caller keeps it alive), or null.
void set_cta_order(const unsigned* order) { emu::g_cta_order = order; }
}
