// SwiGLU: silu(gate) * up from the fused gate/up projection (twin: activation.py).
// Elementwise, so a row's result never depends on its batch; rounds like the twin:
// silu = gate / (1 + exp(-gate)), out = bf16(silu * up).
#include "common.cuh"

// gate_up: [tokens, 2 * inter] BF16 (gate first, then up); out: [tokens, inter] BF16.
// One thread per output element, grid-stride.
extern "C" __global__ void silu_mul(const __nv_bfloat16* __restrict__ gate_up,
                                    __nv_bfloat16* __restrict__ out, long long tokens, int inter) {
  pdl_enter();
  const long long total = tokens * inter;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long token = idx / inter, i = idx - token * inter;
    const float gate = __bfloat162float(gate_up[token * 2 * inter + i]);
    const float up = __bfloat162float(gate_up[token * 2 * inter + inter + i]);
    out[idx] = __float2bfloat16_rn(silu_mul_value(gate, up));  // common.cuh, as the gated GEMM
  }
}
