// Gated MLP activations from the fused gate/up projection (twins: activation.py):
// SwiGLU's silu(gate) * up and GeGLU's gelu_tanh(gate) * up. Elementwise, so a row's
// result never depends on its batch; each rounds as its twin: silu = gate / (1 +
// exp(-gate)), out = bf16(silu * up); gelu = bf16(gelu_tanh(gate)), out = bf16(gelu * up).
#include "common.cuh"

// gate_up: [tokens, 2 * inter] BF16 (gate first, then up); out: [tokens, inter] BF16,
// bf16(value(gate, up)). One thread per output element, grid-stride; the kernels call
// pdl_enter() first.
template <class Value>
__device__ __forceinline__ void gated_mul(const __nv_bfloat16* __restrict__ gate_up,
                                          __nv_bfloat16* __restrict__ out, long long tokens, int inter,
                                          Value value) {
  const long long total = tokens * inter;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long token = idx / inter, i = idx - token * inter;
    const float gate = __bfloat162float(gate_up[token * 2 * inter + i]);
    const float up = __bfloat162float(gate_up[token * 2 * inter + inter + i]);
    out[idx] = __float2bfloat16_rn(value(gate, up));
  }
}

extern "C" __global__ void silu_mul(const __nv_bfloat16* __restrict__ gate_up,
                                    __nv_bfloat16* __restrict__ out, long long tokens, int inter) {
  pdl_enter();
  // common.cuh's, as the gated GEMM's epilogue computes it
  gated_mul(gate_up, out, tokens, inter, [](float gate, float up) { return silu_mul_value(gate, up); });
}

// gelu_tanh(x) = 0.5 * x * (1 + tanh(beta * (x + kappa * x^3))) in torch's fp32 steps and
// order, each rounded (the _rn intrinsics: no contraction into FMAs), and tanh taken in
// double then rounded to fp32: for every BF16 x that is the correctly rounded fp32 tanh
// (activation.py: gelu_tanh_ref), where tanhf's 2 ulps would move the value by many BF16
// ulps wherever 1 + tanh cancels (x in about [-5.5, -3]). x^3 overflows to inf past
// |x| ~ 7e12, where tanh is +-1 and the value x or -0; never NaN for finite x.
__device__ __forceinline__ float gelu_tanh_value(float x) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2 / pi), as torch's fp32
  const float cube = __fmul_rn(__fmul_rn(x, x), x);
  const float inner = __fmul_rn(beta, __fadd_rn(x, __fmul_rn(kappa, cube)));
  const float tanh_inner = static_cast<float>(tanh(static_cast<double>(inner)));
  return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanh_inner));
}

extern "C" __global__ void gelu_tanh_mul(const __nv_bfloat16* __restrict__ gate_up,
                                         __nv_bfloat16* __restrict__ out, long long tokens, int inter) {
  pdl_enter();
  gated_mul(gate_up, out, tokens, inter, [](float gate, float up) {
    return __fmul_rn(bf16_value(gelu_tanh_value(gate)), up);  // gelu rounded, as torch's BF16 gelu
  });
}

// Gemma 2's soft-capping of fp32 logits in place: x = cap * tanh(x / cap), each step
// rounded to fp32 as torch's (no FMA), tanh in double then rounded (activation.py:
// softcap_ref). x: [rows, vocab] fp32, contiguous. Grid-stride, one thread an element.
extern "C" __global__ void logit_softcap(float* __restrict__ x, long long total, float cap) {
  pdl_enter();
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const float t = __fdiv_rn(x[idx], cap);
    x[idx] = __fmul_rn(static_cast<float>(tanh(static_cast<double>(t))), cap);
  }
}
