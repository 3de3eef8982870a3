"""Backends: the NumPy backend, and how to pick one (`get_backend`).

The NumPy backend is the reference: it calls each op's NumPy twin directly.
The CuPy backend (the GPU path, cupy_backend.py) provides the same ops through CUDA
kernels. What both provide is protocol.Backend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from .activation import gelu_tanh_mul_ref, silu_mul_ref, softcap_ref
from .attention import paged_attention_ref
from .bias import add_bias_ref
from .dtypes import BF16
from .embedding import embed_ref
from .gemm import gemm_ref, prepare_weight
from .kvcache import kv_write_ref, rope_kv_write_ref
from .moe import MoeRoute, moe_combine_ref, moe_gather_ref, moe_gemm_ref, moe_route_ref
from .penalties import Penalties, penalize_ref
from .protocol import Backend, CopyDone, Landed, check_tier_copies, layer_by_layer
from .rmsnorm import (
    add_rmsnorm_ref,
    head_rmsnorm_ref,
    norm_add_ref,
    norm_add_rmsnorm_ref,
    rmsnorm_ref,
)
from .rope import rope_ref
from .sampling import Draws, sample_ref

log = logging.getLogger(__name__)
CUPY_BROKEN = "CuPy is installed but does not import"  # the reason auto warns about

BackendName = Literal["auto", "numpy", "cupy"]
BACKEND_NAMES: tuple[str, ...] = ("auto", "numpy", "cupy")


class NumpyBackend:
    """Runs every op as its NumPy twin, BF16 storage with fp32 math."""

    name = "numpy"

    def linear_weight(self, w: np.ndarray) -> np.ndarray:
        """Prepare a BF16 [out, in] weight for `gemm`, once: float64 on its row grid."""
        assert w.dtype == BF16, w.dtype
        return prepare_weight(w)

    def gate_up_weight(self, w: np.ndarray) -> np.ndarray:
        """The fused [2I, K] gate/up projection (gate rows first), as `swiglu` takes it."""
        return self.linear_weight(w)

    def expert_weights(self, w: np.ndarray) -> list[np.ndarray]:
        """A mixture of experts' stacked [E, N, K] BF16 weights, as `moe_gemm` takes them:
        each expert's prepared as `linear_weight` prepares a weight."""
        return [self.linear_weight(np.ascontiguousarray(expert)) for expert in w]

    @staticmethod
    def moe_gemm(xs: np.ndarray, experts: list[np.ndarray], route: MoeRoute) -> np.ndarray:
        """The grouped rows xs [T * k, K] BF16 times each one's expert: [T * k, N] BF16."""
        return moe_gemm_ref(xs, experts, route.offsets)

    def swiglu(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """silu(gate) * up of the fused gate/up product: [T, I] BF16. Here the two twins
        in turn (the GPU backend may run them as one kernel, to the same bits)."""
        return self.silu_mul(self.gemm(x, w))

    def gemm_add_rmsnorm(
        self, x: np.ndarray, w: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """add_rmsnorm(residual, gemm(x, w), weight, eps): a projection that feeds the
        residual add and the next norm. Here the two twins in turn (the GPU backend may run
        them as one kernel, to the same bits)."""
        return self.add_rmsnorm(residual, self.gemm(x, w), weight, eps)

    def decode_tail(
        self, attn: np.ndarray, w_o: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray,
        residual: np.ndarray, mlp_norm: np.ndarray, next_norm: np.ndarray, eps: float,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """A layer's tail after attention: o_proj, the residual add and the MLP's norm,
        the MLP, the residual add and the next norm -> (summed, normed). Here its ops in
        turn (the GPU backend may run it as one persistent kernel, to the same bits)."""
        summed, x = self.gemm_add_rmsnorm(attn, w_o, residual, mlp_norm, eps)
        return self.gemm_add_rmsnorm(self.swiglu(x, w_gate_up), w_down, summed, next_norm, eps)

    def decode_tail_qkv(
        self, attn: np.ndarray, w_o: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray,
        residual: np.ndarray, mlp_norm: np.ndarray, next_norm: np.ndarray, eps: float,
        w_qkv: np.ndarray, *rope_args: Any,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """decode_tail, then the next layer's gemm_rope_kv_write of its normed rows (its
        qkv projection bias-free; `rope_args`: gemm_rope_kv_write's after the weight) ->
        (summed, the next layer's rotated queries). Here its ops in turn (the GPU backend
        may run it as one persistent kernel, to the same bits)."""
        summed, x = self.decode_tail(
            attn, w_o, w_gate_up, w_down, residual, mlp_norm, next_norm, eps
        )
        return summed, self.gemm_rope_kv_write(x, w_qkv, *rope_args)

    def attention_tail(self, attention: tuple, tail: tuple) -> tuple[np.ndarray, np.ndarray]:
        """A layer from its attention on: paged_attention(*attention) (its queries, cache,
        layer, block tables, seq_lens, query_start_loc and scale, then maybe its window and
        soft cap), then decode_tail(attn,
        *tail) (tail: decode_tail's arguments after attn). Here its ops in turn (the GPU
        backend may run the layer as one persistent kernel, to the same bits)."""
        attn = self.paged_attention(*attention)
        return self.decode_tail(attn.reshape(attn.shape[0], -1), *tail)

    def attention_tail_qkv(
        self, attention: tuple, tail: tuple, head: tuple
    ) -> tuple[np.ndarray, np.ndarray]:
        """attention_tail with the next layer's head: decode_tail_qkv(attn, *tail, *head)
        (head: its bias-free qkv weight, then gemm_rope_kv_write's arguments after it)."""
        attn = self.paged_attention(*attention)
        return self.decode_tail_qkv(attn.reshape(attn.shape[0], -1), *tail, *head)

    def attention_layers(
        self, attention: tuple, layers: Sequence[tuple], residual: np.ndarray, eps: float,
        rope: tuple,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Consecutive layers from attention[2] on, every qkv projection bias-free: layer i
        is attention_tail_qkv (its head the next layer's), the last attention_tail
        (layers[-1]'s w_qkv None) -> (summed, normed) of the last. attention:
        paged_attention's arguments for the first layer (its queries, cache, layer, block
        tables, seq_lens, query_start_loc, scale); layers[i]: (w_o, w_gate_up, w_down,
        mlp_norm, next_norm, w_qkv: the next layer's, or None); rope: gemm_rope_kv_write's
        arguments after the weight, but the layer (positions, cos, sin, cache, slot_mapping,
        num_heads). Here layer by layer (layer_by_layer; the GPU backend may run them as one
        persistent kernel, to the same bits)."""
        return layer_by_layer(self, attention, layers, residual, eps, rope)

    def gemm_rope_kv_write(
        self, x: np.ndarray, w: np.ndarray, positions: np.ndarray, cos: np.ndarray,
        sin: np.ndarray, cache: np.ndarray, layer: int, slot_mapping: np.ndarray,
        num_heads: int,
    ) -> np.ndarray:  # fmt: skip
        """rope_kv_write of a bias-free qkv projection's product ([T, heads + 2 * kv_heads,
        head_dim], head_dim the cache's): the rotated queries; keys and values into the
        cache. Here the two twins in turn (the GPU backend may run them as one kernel, to
        the same bits)."""
        qkv = self.gemm(x, w)
        qkv = qkv.reshape(qkv.shape[0], -1, cache.shape[-1])
        return self.rope_kv_write(qkv, positions, cos, sin, cache, layer, slot_mapping, num_heads)

    def device_memory_bytes(self) -> int:
        """Memory of the device the model runs on: for this backend, the host's RAM."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def kv_cache(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=BF16)

    def host_kv_cache(self, shape: tuple[int, ...]) -> np.ndarray:
        """The host tier's arena (pinned memory on the GPU backend), every page touched
        now, as pinning does there: disk hits read into its slots never fault."""
        arena = np.empty(shape, dtype=BF16)
        arena.view(np.uint16).fill(0)
        return arena

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def from_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def offload_block(
        self, cache: np.ndarray, block_id: int, host_cache: np.ndarray, slot: int
    ) -> None:
        """Copy one whole device block into a host-tier slot (the same layout), exactly."""
        host_cache[slot] = cache[block_id]

    def onboard_block(
        self, host_cache: np.ndarray, slot: int, cache: np.ndarray, block_id: int
    ) -> None:
        cache[block_id] = host_cache[slot]

    def tier_copies(
        self, cache: np.ndarray, host_cache: np.ndarray, copies: Sequence[tuple[str, int, int]]
    ) -> None:
        """(kind, src, dst) offloads and onboards, in list order, as `offload_block` and
        `onboard_block` make each (the GPU's takes a run of them in one call)."""
        check_tier_copies(copies)
        for kind, src, dst in copies:
            if kind == "offload":
                self.offload_block(cache, src, host_cache, dst)
            else:
                self.onboard_block(host_cache, src, cache, dst)

    def copy_block(self, cache: np.ndarray, src: int, dst: int) -> None:
        """Copy one device block over another, exactly."""
        cache[dst] = cache[src]

    def read_block(self, cache: np.ndarray, block_id: int, out: np.ndarray) -> CopyDone:
        """Copy one whole device block into a host array of its shape (a disk write's
        staging buffer), exactly; done when this returns, as the GPU's is once waited for."""
        out[...] = cache[block_id]
        return Landed()

    def wait_copies(self) -> None:
        """Block copies on this backend are done when issued."""

    def copies_done(self) -> CopyDone:
        """The block copies issued so far, to wait for on the host: done already here."""
        return Landed()

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A backend array of zeros (the device's memory on the GPU backend)."""
        return np.zeros(shape, dtype=dtype)

    def staging_buffer(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A host array that `upload` copies from (pinned memory on the GPU backend)."""
        return np.zeros(shape, dtype=dtype)

    def upload(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy a host array into a backend array (or view) of its shape."""
        dst[...] = src

    def download(self, dst: np.ndarray, src: np.ndarray) -> CopyDone:
        """Copy a backend array into a host array of its shape (a staging buffer), after
        the work queued; done when this returns, as the GPU's is once waited for."""
        dst[...] = src
        return Landed()

    def copy_rows(self, dst: np.ndarray, src: np.ndarray, rows: np.ndarray | None) -> None:
        """`dst[i] = src[rows[i]]` for every row of `dst` (`src[i]` with None), in order
        with the work queued before and after."""
        dst[...] = src[: dst.shape[0]] if rows is None else src[rows]

    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """What the GPU backend records as a CUDA graph, this backend just reruns."""
        return fn

    @staticmethod
    def argmax(logits: np.ndarray) -> np.ndarray:
        """Greedy choice per row of [R, vocab] logits, ties to the lowest id: [R] int32."""
        return np.argmax(logits, axis=1).astype(np.int32)

    @staticmethod
    def penalize(logits: np.ndarray, penalties: Penalties) -> None:
        """Apply each row's penalties to [R, vocab] fp32 logits, in place (penalize_ref)."""
        penalize_ref(logits, penalties)

    @staticmethod
    def sample(logits: np.ndarray, draws: Draws) -> np.ndarray:
        """One seeded draw per row of [R, vocab] fp32 logits (sample_ref): [R] int32."""
        vocab = logits.shape[1]
        tokens = np.empty(logits.shape[0], dtype=np.int32)
        for r in range(logits.shape[0]):
            k = int(draws.top_k[r])
            tokens[r] = sample_ref(
                logits[r],
                temperature=float(draws.temperature[r]),
                top_k=k if k < vocab else None,
                top_p=float(draws.top_p[r]),
                min_p=float(draws.min_p[r]),
                seed=int(draws.seeds[r]),
                position=int(draws.positions[r]),
            )
        return tokens

    embed = staticmethod(embed_ref)
    rmsnorm = staticmethod(rmsnorm_ref)
    add_rmsnorm = staticmethod(add_rmsnorm_ref)
    norm_add_rmsnorm = staticmethod(norm_add_rmsnorm_ref)
    norm_add = staticmethod(norm_add_ref)
    gemm = staticmethod(gemm_ref)
    add_bias = staticmethod(add_bias_ref)
    head_rmsnorm = staticmethod(head_rmsnorm_ref)
    rope = staticmethod(rope_ref)
    kv_write = staticmethod(kv_write_ref)
    rope_kv_write = staticmethod(rope_kv_write_ref)
    paged_attention = staticmethod(paged_attention_ref)
    silu_mul = staticmethod(silu_mul_ref)
    gelu_tanh_mul = staticmethod(gelu_tanh_mul_ref)
    softcap = staticmethod(softcap_ref)
    moe_route = staticmethod(moe_route_ref)
    moe_gather = staticmethod(moe_gather_ref)
    moe_combine = staticmethod(moe_combine_ref)


def cuda_unavailable_reason() -> str | None:
    """Why the GPU backend cannot run here, or None when it can (CuPy imports and sees
    a CUDA device)."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name == "cupy":
            return "CuPy is not installed (pip install 'reprise[cuda13]' or 'reprise[cuda12]')"
        return f"{CUPY_BROKEN}: {e}"
    except ImportError as e:
        return f"{CUPY_BROKEN}: {e}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device: CuPy raises its own runtime errors
        return f"CuPy finds no CUDA device: {e}"
    return None if count > 0 else "CuPy finds no CUDA device"


def cuda_device_available() -> bool:
    return cuda_unavailable_reason() is None


def get_backend(name: str) -> Backend:
    """Resolve a backend name; `auto` picks cupy when a CUDA device is present (and
    logs why not when CuPy is installed but unusable)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    if name == "numpy":
        return NumpyBackend()
    reason = cuda_unavailable_reason()
    if reason is not None and name == "auto":
        if reason.startswith(CUPY_BROKEN):  # a broken install, not a CPU machine
            log.warning("backend auto: running on NumPy; %s", reason)
        return NumpyBackend()
    if reason is not None:
        raise ValueError(
            f"backend 'cupy' needs CuPy and a CUDA device: {reason}; use backend='numpy' or 'auto'"
        )
    from .cupy_backend import CupyBackend

    return CupyBackend()
