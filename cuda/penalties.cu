// Logit bias, then repetition, frequency and presence penalties, then a token mask, on logits rows, in place
// (twin: penalties.py). add_logit_bias runs first, as a launch of its own (only for a batch
// with a bias): each biased logit plus its bias, one round-to-nearest fp32 add.
//
// Each listed token's logit goes through the twin's fp32 steps, each an explicit
// round-to-nearest intrinsic (no contraction into a fused multiply-add): divided by the
// repetition penalty if > 0, else multiplied by it; then, if generated c > 0 times,
// minus frequency * c, minus presence. An element depends on its own value and its
// row's parameters alone, so a row's result does not depend on the batch or on the
// order its tokens are listed in.
#include "common.cuh"

// logits: [rows, vocab] fp32, changed in place; token_offsets: [rows + 1] int32 (row r's
// tokens are token_ids[token_offsets[r] .. token_offsets[r + 1]), distinct within a row);
// output_counts: [N] int32; repetition, frequency, presence: [rows] fp32.
// grid = rows, block = any.
extern "C" __global__ void apply_penalties(float* __restrict__ logits, int vocab,
                                           const int* __restrict__ token_offsets,
                                           const int* __restrict__ token_ids,
                                           const int* __restrict__ output_counts,
                                           const float* __restrict__ repetition,
                                           const float* __restrict__ frequency,
                                           const float* __restrict__ presence) {
  pdl_enter();
  float* row = logits + (long long)blockIdx.x * vocab;
  const float rep = repetition[blockIdx.x], freq = frequency[blockIdx.x], pres = presence[blockIdx.x];
  const int end = token_offsets[blockIdx.x + 1];
  for (int i = token_offsets[blockIdx.x] + threadIdx.x; i < end; i += blockDim.x) {
    const int token = token_ids[i];
    const int count = output_counts[i];
    float x = row[token];
    x = x > 0.0f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
    if (count > 0) x = __fsub_rn(__fsub_rn(x, __fmul_rn(freq, (float)count)), pres);
    row[token] = x;
  }
}

// logits: [rows, vocab] fp32, changed in place; offsets: [rows + 1] int32 (row r's biases are
// ids[offsets[r] .. offsets[r + 1]), distinct within a row); values: fp32, one an id.
// grid = rows, block = any.
extern "C" __global__ void add_logit_bias(float* __restrict__ logits, int vocab, const int* __restrict__ offsets,
                                          const int* __restrict__ ids, const float* __restrict__ values) {
  pdl_enter();
  float* row = logits + (long long)blockIdx.x * vocab;
  const int end = offsets[blockIdx.x + 1];
  for (int i = offsets[blockIdx.x] + threadIdx.x; i < end; i += blockDim.x) row[ids[i]] = __fadd_rn(row[ids[i]], values[i]);
}

// logits: [rows, vocab] fp32, changed in place; words: [rows, num_words] uint32, row r keeps
// token t when bit t % 32 of words[r * num_words + t / 32] is set, every other logit becomes
// -inf (a structured output's grammar; runs last, after the penalties). grid = rows, block = any.
extern "C" __global__ void apply_token_mask(float* __restrict__ logits, int vocab,
                                            const unsigned* __restrict__ words, int num_words) {
  pdl_enter();
  float* row = logits + (long long)blockIdx.x * vocab;
  const unsigned* mask = words + (long long)blockIdx.x * num_words;
  for (int t = threadIdx.x; t < vocab; t += blockDim.x)
    if (!((mask[t >> 5] >> (t & 31)) & 1u)) row[t] = negative_infinity();
}
