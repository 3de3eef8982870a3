// Embedding gather into the fp32 residual stream (twin: embedding.py): the values
// are exactly the table's BF16 values, widened. An id >= vocab (a p-tuning fake id)
// reads row id - vocab of prompt_rows, the step's prompt-table rows; each output row
// depends on its own id only, and the launch is the same for every batch of the same
// size (capturable: with no fake ids the launcher passes the table as prompt_rows,
// which is then never read).
#include "common.cuh"

// table: [vocab, hidden] BF16; token_ids: [tokens] int32, each < vocab + P;
// prompt_rows: [P, hidden] BF16; out: [tokens, hidden] fp32.
// grid = tokens, threads stride over hidden.
extern "C" __global__ void embed(const __nv_bfloat16* __restrict__ table, const int* __restrict__ token_ids,
                                 const __nv_bfloat16* __restrict__ prompt_rows, float* __restrict__ out,
                                 int hidden, int vocab) {
  pdl_enter();
  const long long token = blockIdx.x;
  const int id = token_ids[token];
  const __nv_bfloat16* row =
      id < vocab ? table + (long long)id * hidden : prompt_rows + (long long)(id - vocab) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[token * hidden + i] = __bfloat162float(row[i]);
}
