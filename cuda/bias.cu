// A linear layer's bias on the GEMM's fp32 output, rounded to BF16 once (twin: bias.py).
// Elementwise, so a row's result never depends on its batch; rounds like the twin:
// out = bf16(y + float(bias)).
#include "common.cuh"

// y: [tokens, width] fp32; bias: [width] BF16; out: [tokens, width] BF16.
// One thread per output element, grid-stride.
extern "C" __global__ void add_bias(const float* __restrict__ y,
                                    const __nv_bfloat16* __restrict__ bias,
                                    __nv_bfloat16* __restrict__ out, long long tokens, int width) {
  pdl_enter();
  const long long total = tokens * width;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const int col = (int)(idx % width);
    out[idx] = __float2bfloat16_rn(__fadd_rn(y[idx], __bfloat162float(bias[col])));
  }
}
