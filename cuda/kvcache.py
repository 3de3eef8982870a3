"""The paged KV cache tensor and the KV write.

Layout, block-major so that one block (every layer's K and V for
`block_size` tokens) is one contiguous run of bytes, which makes host
offload and onboarding one copy per block:

    # [num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]  BF16

A token's slot is `block_id * block_size + offset_in_block`.
"""

from __future__ import annotations

import numpy as np

from .dtypes import BF16


def kv_cache_shape(
    num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int
) -> tuple[int, ...]:
    return (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)


def kv_write_ref(
    cache: np.ndarray, layer: int, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray
) -> None:
    """Write k, v ([T, num_kv_heads, head_dim] BF16) of one layer into their slots, in place."""
    assert k.dtype == BF16 and v.dtype == BF16, (k.dtype, v.dtype)
    block_size = cache.shape[4]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Advanced indices separated by slices put the token axis first: [T, kv_heads, head_dim].
    cache[blocks, layer, 0, :, offsets, :] = k
    cache[blocks, layer, 1, :, offsets, :] = v
