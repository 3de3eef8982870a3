"""Paged attention, one routine for prefill and decode queries.

For each sequence, its queries (the last `q_len` tokens of `seq_len`) attend
causally to keys read from the paged cache, page by page in ascending order,
with an online softmax in fp32:

    s = (q . k) * scale                 fp32 (BF16 operands)
    m' = max(m, max(s));  a = exp(m - m')
    denom = denom * a + sum(exp(s - m'))  fp32 probabilities summed
    acc = acc * a + bf16(exp(s - m')) . v   probabilities rounded to BF16 for the PV product
    out = bf16(acc / denom)

Grouped-query heads are stacked as rows (query head h reads KV head
h // group), so each K/V page serves its whole group at once. Key tiles are
the cache pages (`block_size` keys) and always start at multiples of
`block_size`; a tile whose keys are all in the future of a row leaves that
row's state exactly unchanged, so a query's result does not depend on how
the prompt was chunked.
"""

from __future__ import annotations

import numpy as np

from reprise.cuda.dtypes import F32, to_bf16, to_f32


def paged_attention_ref(
    q: np.ndarray,
    cache: np.ndarray,
    layer: int,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    scale: float,
) -> np.ndarray:
    """
    q:               [T, num_heads, head_dim] BF16, roped
    cache:           [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] BF16
    block_tables:    [B, max_blocks_per_seq] int32
    seq_lens:        [B] keys visible to each sequence's last query
    query_start_loc: [B + 1] rows of q belonging to each sequence
    returns          [T, num_heads, head_dim] BF16
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[3], cache.shape[4]
    group = num_heads // num_kv_heads
    out = np.empty((num_tokens, num_heads, head_dim), dtype=F32)
    scale32 = F32.type(scale)
    for b in range(len(seq_lens)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, seq_len = end - start, int(seq_lens[b])
        if q_len == 0:
            continue
        # rows ordered (token, group member) within each KV head: [kv_heads, q_len * group, head_dim]
        rows = to_f32(q[start:end]).reshape(q_len, num_kv_heads, group, head_dim)
        rows = rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, q_len * group, head_dim)
        row_pos = np.repeat(np.arange(seq_len - q_len, seq_len), group)  # [q_len * group]
        m = np.full((num_kv_heads, q_len * group), -np.inf, dtype=F32)
        denom = np.zeros((num_kv_heads, q_len * group), dtype=F32)
        acc = np.zeros((num_kv_heads, q_len * group, head_dim), dtype=F32)
        num_tiles = -(-seq_len // block_size)
        for t in range(num_tiles):
            page = cache[int(block_tables[b, t]), layer]  # [2, kv_heads, block_size, head_dim]
            k, v = to_f32(page[0]), to_f32(page[1])
            key_pos = t * block_size + np.arange(block_size)
            visible = key_pos[None, :] <= row_pos[:, None]  # [rows, block_size]
            s = np.matmul(rows, k.transpose(0, 2, 1)) * scale32
            s = np.where(visible[None], s, F32.type(-np.inf))
            m_new = np.maximum(m, s.max(axis=-1))
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[..., None])
            denom = denom * alpha + p.sum(axis=-1, dtype=F32)
            acc = acc * alpha[..., None] + np.matmul(to_f32(to_bf16(p)), v)
            m = m_new
        result = acc / denom[..., None]  # [kv_heads, q_len * group, head_dim]
        out[start:end] = (
            result.reshape(num_kv_heads, q_len, group, head_dim)
            .transpose(1, 0, 2, 3)
            .reshape(q_len, num_heads, head_dim)
        )
    return to_bf16(out)
