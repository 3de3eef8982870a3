"""What a backend provides (`Backend`).

Its own module so that both backends (backend.py's NumPy one, cupy_backend.py's GPU
one) and their callers import it, and neither backend module imports the other:
backend.get_backend imports cupy_backend only on request, and cupy_backend imports
nothing of backend.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .penalties import Penalties
    from .sampling import Draws


class CopyDone(Protocol):
    """A copy issued to the host, maybe still under way: `synchronize()` returns once its
    bytes are in the host buffer (the GPU backend returns the CUDA event recorded
    after it; waiting on one from another thread is safe)."""

    def synchronize(self) -> None: ...


class Landed:
    """A copy that was complete when issued (the NumPy backend's)."""

    def synchronize(self) -> None:
        return None


TIER_COPY_KINDS = ("offload", "onboard")


def check_tier_copies(copies: Sequence[tuple[str, int, int]]) -> None:
    """ValueError unless every (kind, src, dst) is an offload or an onboard: checked
    before a backend issues any of them."""
    for kind, _, _ in copies:
        if kind not in TIER_COPY_KINDS:
            raise ValueError(f"tier_copies runs offloads and onboards, not {kind!r}")


class Backend(Protocol):
    """What the model runs on: weights and caches in the backend's arrays, and the ops."""

    name: str

    def linear_weight(self, w: np.ndarray) -> Any: ...
    def gate_up_weight(self, w: np.ndarray) -> Any: ...  # the fused [2I, K] gate/up projection
    def expert_weights(self, w: np.ndarray) -> Any: ...  # stacked experts' [E, N, K], for moe_gemm
    def device_memory_bytes(self) -> int: ...
    def kv_cache(self, shape: tuple[int, ...]) -> Any: ...
    def host_kv_cache(self, shape: tuple[int, ...]) -> np.ndarray: ...
    def to_host(self, x: Any) -> np.ndarray: ...
    def from_host(self, x: np.ndarray) -> Any: ...
    def offload_block(
        self, cache: Any, block_id: int, host_cache: np.ndarray, slot: int
    ) -> None: ...
    def onboard_block(
        self, host_cache: np.ndarray, slot: int, cache: Any, block_id: int
    ) -> None: ...
    def tier_copies(  # (kind, src, dst): "offload" block -> slot, "onboard" slot -> block
        self, cache: Any, host_cache: np.ndarray, copies: Sequence[tuple[str, int, int]]
    ) -> None: ...
    def read_block(self, cache: Any, block_id: int, out: np.ndarray) -> CopyDone: ...
    def copy_block(self, cache: Any, src: int, dst: int) -> None: ...
    def wait_copies(self) -> None: ...
    def copies_done(self) -> CopyDone: ...
    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any: ...
    def staging_buffer(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray: ...
    def upload(self, dst: Any, src: np.ndarray) -> None: ...
    def download(self, dst: np.ndarray, src: Any) -> CopyDone: ...
    def copy_rows(self, dst: Any, src: Any, rows: Any) -> None: ...
    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]: ...

    embed: Callable[..., Any]
    rmsnorm: Callable[..., Any]
    add_rmsnorm: Callable[..., Any]
    norm_add_rmsnorm: Callable[..., Any]  # Gemma's: add_rmsnorm(residual, rmsnorm(delta))
    norm_add: Callable[..., Any]  # OLMo 2's: residual + rmsnorm(delta), and it in BF16
    gemm: Callable[..., Any]
    gemm_add_rmsnorm: Callable[..., Any]  # add_rmsnorm(residual, gemm(x, w)), maybe one kernel
    add_bias: Callable[..., Any]
    head_rmsnorm: Callable[..., Any]
    rope: Callable[..., Any]
    kv_write: Callable[..., None]
    rope_kv_write: Callable[..., Any]  # rope of q and k, then kv_write, as one op
    gemm_rope_kv_write: Callable[..., Any]  # rope_kv_write(gemm(x, w)), maybe one kernel
    paged_attention: Callable[..., Any]
    silu_mul: Callable[..., Any]
    swiglu: Callable[..., Any]  # silu_mul(gemm(x, w)) of a gate_up_weight, maybe one kernel
    gelu_tanh_mul: Callable[..., Any]  # Gemma's gelu_tanh(gate) * up, as silu_mul takes it
    softcap: Callable[..., Any]  # Gemma 2's cap * tanh(logits / cap), in place
    decode_tail: Callable[..., Any]  # o_proj through the next norm, maybe one kernel
    decode_tail_qkv: Callable[..., Any]  # decode_tail, then the next gemm_rope_kv_write
    attention_tail: Callable[..., Any]  # paged_attention, then decode_tail, maybe one kernel
    attention_tail_qkv: Callable[..., Any]  # paged_attention, then decode_tail_qkv, likewise
    attention_layers: Callable[..., Any]  # attention_tail_qkv layer after layer, likewise
    argmax: Callable[..., Any]
    # a mixture of experts (moe.py): the routing, the grouped rows, their GEMM, the sum
    moe_route: Callable[..., Any]
    moe_gather: Callable[..., Any]
    moe_gemm: Callable[..., Any]
    moe_combine: Callable[..., Any]

    def penalize(self, logits: Any, penalties: Penalties) -> None: ...
    def sample(self, logits: Any, draws: Draws) -> Any: ...


def layer_by_layer(
    ops: Any, attention: tuple, layers: Sequence[tuple], residual: Any, eps: float, rope: tuple
) -> tuple[Any, Any]:
    """attention_layers (its arguments) as `ops`' attention_tail_qkv of each layer but the
    last, then its attention_tail."""
    q, cache, first, *step = attention
    positions, cos, sin, rope_cache, slots, num_heads = rope
    summed = residual
    for i, (w_o, w_gate_up, w_down, mlp_norm, next_norm, w_qkv) in enumerate(layers):
        layer_attention = (q, cache, first + i, *step)
        tail = (w_o, w_gate_up, w_down, summed, mlp_norm, next_norm, eps)
        if w_qkv is None:
            assert i == len(layers) - 1, "only the last layer lacks the next one's head"
            return ops.attention_tail(layer_attention, tail)
        head = (w_qkv, positions, cos, sin, rope_cache, first + i + 1, slots, num_heads)
        summed, q = ops.attention_tail_qkv(layer_attention, tail, head)
    return summed, q
