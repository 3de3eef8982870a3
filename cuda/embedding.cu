// Embedding gather into the fp32 residual stream (twin: embedding.py): the values
// are exactly the table's BF16 values, widened, or with a scale (Gemma's) each table
// value times the BF16 scale, rounded to BF16 (as torch's BF16 product), widened. An
// id >= vocab (a p-tuning fake id) reads row id - vocab of prompt_rows, the step's
// prompt-table rows, never scaled; each output row depends on its own id only, and the
// launch is the same for every batch of the same size (capturable: with no fake ids the
// launcher passes the table as prompt_rows, which is then never read; the scale is the
// model's constant).
#include "common.cuh"

// table: [vocab, hidden] BF16; token_ids: [tokens] int32, each < vocab + P;
// prompt_rows: [P, hidden] BF16; out: [tokens, hidden] fp32; scale: a BF16 value, or
// 1 for none (then the table's values are copied as they are: no multiply, so no
// denormal is flushed). grid = tokens, threads stride over hidden.
extern "C" __global__ void embed(const __nv_bfloat16* __restrict__ table, const int* __restrict__ token_ids,
                                 const __nv_bfloat16* __restrict__ prompt_rows, float* __restrict__ out,
                                 int hidden, int vocab, float scale) {
  pdl_enter();
  const long long token = blockIdx.x;
  const int id = token_ids[token];
  if (id < vocab && scale != 1.0f) {
    const __nv_bfloat16* row = table + (long long)id * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
      out[token * hidden + i] = bf16_value(__fmul_rn(__bfloat162float(row[i]), scale));  // exact, then rounded
    return;
  }
  const __nv_bfloat16* row =
      id < vocab ? table + (long long)id * hidden : prompt_rows + (long long)(id - vocab) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[token * hidden + i] = __bfloat162float(row[i]);
}
