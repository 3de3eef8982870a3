// Embedding gather into the fp32 residual stream (twin: embedding.py): the values
// are exactly the table's BF16 values, widened.
#include "common.cuh"

// table: [vocab, hidden] BF16; token_ids: [tokens] int32; out: [tokens, hidden] fp32.
// grid = tokens, threads stride over hidden.
extern "C" __global__ void embed(const __nv_bfloat16* __restrict__ table, const int* __restrict__ token_ids,
                                 float* __restrict__ out, int hidden) {
  const long long token = blockIdx.x;
  const __nv_bfloat16* row = table + (long long)token_ids[token] * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[token * hidden + i] = __bfloat162float(row[i]);
}
