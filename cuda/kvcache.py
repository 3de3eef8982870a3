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
from .rope import rope_ref


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


def rope_kv_write_ref(
    qkv: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    cache: np.ndarray,
    layer: int,
    slot_mapping: np.ndarray,
    num_heads: int,
) -> np.ndarray:
    """rope of the query and key heads of qkv ([T, num_heads + 2 * num_kv_heads, head_dim]
    BF16), the keys and values written into their slots (kv_write_ref), in place; returns
    the rotated queries [T, num_heads, head_dim]. One step of the two ops, fused on the GPU."""
    num_kv_heads = (qkv.shape[1] - num_heads) // 2
    assert qkv.shape[1] == num_heads + 2 * num_kv_heads, qkv.shape
    k_end = num_heads + num_kv_heads
    kv_write_ref(cache, layer, rope_ref(qkv[:, num_heads:k_end], positions, cos, sin),
                 qkv[:, k_end:], slot_mapping)  # fmt: skip
    return rope_ref(qkv[:, :num_heads], positions, cos, sin)
