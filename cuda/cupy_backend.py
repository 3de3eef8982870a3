"""The GPU backend: the same ops as the NumPy backend, through our CUDA kernels.

Arrays live on the current CUDA device as CuPy arrays; BF16 ones as uint16 bit
patterns (CuPy has no bfloat16). The model code is the same for both backends:
it calls these methods and never looks inside the arrays. Results agree with the
NumPy backend within BF16 tolerance (DESIGN §5), and each kernel keeps the
batch invariance of §4 on its own (see each `.cu` file).

The host tier's arena is pinned host memory, so block copies between it and the
device pool run at full bus bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import decode_block_kernel, launchers, moe_kernel, pdl
from .dtypes import BF16
from .kernels import BF16_BITS, to_device
from .kernels import to_host as _to_host
from .penalties import Penalties
from .penalties_kernel import add_logit_bias, apply_penalties, apply_token_mask
from .protocol import check_tier_copies, layer_by_layer
from .sampling import Draws

ATTENTION_KERNELS = ("cuda-cores", "tensor-cores")


def kernel_head_dim(head_dim: int) -> int:
    """The head size the GPU's attention kernels run a model of `head_dim` at: the
    smallest of attention_kernel.HEAD_DIMS (64, 128, 256) that holds it (a smaller head
    is padded with zeros: ModelConfig.padded). ValueError, one line, for a head larger
    than any: said before any weight loads, not at the first step. head_dim 256 runs on
    the CUDA-core kernel whatever `attention` says (the tensor-core one lacks it)."""
    from .attention_kernel import HEAD_DIMS

    fits = [size for size in HEAD_DIMS if size >= head_dim]
    if not fits:
        raise ValueError(
            f"the GPU attention kernels take head_dim up to {max(HEAD_DIMS)}; this model's is "
            f"{head_dim}: run it with --backend numpy"
        )
    return fits[0]


GEMM_FAMILIES = ("mma", "wgmma")


def _tail_weights(tail: tuple, w_qkv: Any = None) -> decode_block_kernel.LayerWeights:
    """decode_tail's arguments after attn (w_o, w_gate_up, w_down, residual, mlp_norm,
    next_norm, eps) as the layer launch's table holds a layer's weights."""
    w_o, w_gate_up, w_down, _residual, mlp_norm, next_norm, _eps = tail
    return decode_block_kernel.LayerWeights(w_o, w_gate_up, w_down, mlp_norm, next_norm, w_qkv)


class CupyBackend:
    """Runs every op as a CUDA kernel on the current device.

    `attention` picks the paged-attention kernel: "tensor-cores" (attention_tc.cu, mma
    for Q.K and P.V; the default, faster at every shape measured on the H100) or
    "cuda-cores" (attention.cu). Each is batch
    invariant on its own; an engine must use one throughout, as their bits differ.

    `gemm` picks the GEMM family: "mma" (gemm.cu, `mma.sync` with a fixed split-K per
    weight; every device), "wgmma" (gemm_sm90.cu, Hopper's warpgroup MMA on a packed
    weight, split over K by the same rule), or None, the default: "wgmma" on sm_90 and
    "mma" elsewhere (gemm_sm90_kernel.WGMMA_BY_DEFAULT, measured on an H100). A weight
    takes its family's kernel for every M, chosen from the device and its (N, K) alone
    when it loads (gemm_sm90_kernel.gemm_family), so rows stay M-independent; a weight
    "wgmma" cannot take stays on "mma". The families' bits differ, as the attention
    kernels' do: `kernel_choice` names both choices (the disk tier keys its files by it)."""

    name = "cupy"

    def __init__(self, attention: str = "tensor-cores", gemm: str | None = None) -> None:
        import cupy

        if attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTION_KERNELS)}; got {attention!r}"
            )
        if gemm is not None and gemm not in GEMM_FAMILIES:
            raise ValueError(f"gemm must be one of {', '.join(GEMM_FAMILIES)}; got {gemm!r}")
        pdl.requested()  # a bad REPRISE_PDL is refused here, before any weight is read
        self.attention = attention
        self.gemm_family = gemm
        self._cupy = cupy
        # Block copies to and from host memory, created on use: device to host (offloads,
        # disk writes' reads) on one stream, host to device (onboards) on another, so the
        # two directions share the bus at once (it is full duplex). Where a copy touches
        # bytes a copy of the other direction touched since the last `wait_copies`, it
        # waits for that copy's event (`_issue`).
        self._streams: dict[str, Any] = {}
        self._touched: dict[str, set[tuple[str, int]]] = {"d2h": set(), "h2d": set()}
        self._graph_pool: Any = None  # the memory every captured graph's temporaries live in
        # decode_block_kernel.layer_table of each run of layers launched (_table), by the
        # weights' ids (the weights kept with it, so the ids stay theirs)
        self._layer_tables: dict[tuple[int, ...], tuple[Any, Any]] = {}

    def linear_weight(self, w: np.ndarray) -> Any:
        """A BF16 [out, in] weight on the device, as `gemm` takes it: packed for the
        Hopper kernel when `gemm="wgmma"` and the device and shape allow it."""
        assert w.dtype == BF16, w.dtype
        weight = to_device(w)
        if self.gemm_family != "mma":
            from .gemm_sm90_kernel import device_arch, gemm_family, prepare_weight

            n, k = w.shape
            if gemm_family(device_arch(), n, k, requested=self.gemm_family) == "wgmma":
                return prepare_weight(weight)
        return weight

    def gate_up_weight(self, w: np.ndarray) -> Any:
        """The fused [2I, K] gate/up projection (gate rows first): as `linear_weight`
        makes any weight, or, where it takes the Hopper kernel and GATED_BY_DEFAULT is on,
        packed with its rows interleaved for the gated epilogue (`swiglu`: one kernel)."""
        from . import gemm_sm90_plan

        if gemm_sm90_plan.GATED_BY_DEFAULT and w.shape[0] % 2 == 0 and self.gemm_family != "mma":
            from .gemm_sm90_kernel import device_arch, gemm_family, prepare_weight

            n, k = w.shape
            if gemm_family(device_arch(), n, k, requested=self.gemm_family) == "wgmma":
                assert w.dtype == BF16, w.dtype
                return prepare_weight(to_device(w), gated=True)
        return self.linear_weight(w)

    def swiglu(self, x: Any, w: Any) -> Any:
        """silu(gate) * up of the fused gate/up product, [T, I] BF16: one kernel on a weight
        `gate_up_weight` packed for the gated epilogue, else the product then silu_mul
        (through `gemm`, which a subclass may replace). The same bits either way."""
        from .gemm_sm90_kernel import PackedWeight, gemm_sm90

        if isinstance(w, PackedWeight) and w.gated:
            return gemm_sm90(x, w, gated=True)
        return self.silu_mul(self.gemm(x, w))

    def gemm_add_rmsnorm(
        self, x: Any, w: Any, residual: Any, weight: Any, eps: float
    ) -> tuple[Any, Any]:
        """add_rmsnorm(residual, gemm(x, w), weight, eps) -> (summed, normed): on a weight
        the Hopper kernel takes, its norm epilogue where the plan allows
        (gemm_sm90_add_rmsnorm: one kernel), else the product (through `gemm`, which a
        subclass may replace) then add_rmsnorm. The same bits either way."""
        from .gemm_sm90_kernel import PackedWeight, gemm_sm90_add_rmsnorm

        if isinstance(w, PackedWeight) and not w.gated:
            return gemm_sm90_add_rmsnorm(x, w, residual, weight, eps)
        return self.add_rmsnorm(residual, self.gemm(x, w), weight, eps)

    def decode_tail(
        self, attn: Any, w_o: Any, w_gate_up: Any, w_down: Any, residual: Any, mlp_norm: Any,
        next_norm: Any, eps: float,
    ) -> tuple[Any, Any]:  # fmt: skip
        """A layer's tail after attention (o_proj through the next norm) -> (summed,
        normed): where decode_block_kernel.BY_DEFAULT is on and `takes` allows (a decode's
        few rows), one persistent launch (decode_block.cu); else gemm_add_rmsnorm, swiglu,
        gemm_add_rmsnorm. The same bits either way."""
        weights = (w_o, w_gate_up, w_down)
        if decode_block_kernel.BY_DEFAULT and decode_block_kernel.takes(attn.shape[0], *weights):
            return decode_block_kernel.decode_tail(
                attn, *weights, residual, mlp_norm, next_norm, eps
            )
        summed, x = self.gemm_add_rmsnorm(attn, w_o, residual, mlp_norm, eps)
        return self.gemm_add_rmsnorm(self.swiglu(x, w_gate_up), w_down, summed, next_norm, eps)

    def decode_tail_qkv(
        self, attn: Any, w_o: Any, w_gate_up: Any, w_down: Any, residual: Any, mlp_norm: Any,
        next_norm: Any, eps: float, w_qkv: Any, *rope_args: Any,
    ) -> tuple[Any, Any]:  # fmt: skip
        """decode_tail, then the next layer's gemm_rope_kv_write (its qkv projection
        bias-free) -> (summed, its rotated queries): one persistent launch where
        decode_block_kernel.BY_DEFAULT is on and `takes` allows, else the two ops. The same
        bits either way."""
        weights = (w_o, w_gate_up, w_down)
        if decode_block_kernel.BY_DEFAULT and decode_block_kernel.takes(
            attn.shape[0], *weights, w_qkv
        ):
            head = decode_block_kernel.NextHead(w_qkv, decode_block_kernel.Rope(*rope_args))
            return decode_block_kernel.decode_tail(
                attn, *weights, residual, mlp_norm, next_norm, eps, head=head
            )
        summed, x = self.decode_tail(attn, *weights, residual, mlp_norm, next_norm, eps)
        return summed, self.gemm_rope_kv_write(x, w_qkv, *rope_args)

    def attention_tail(self, attention: tuple, tail: tuple) -> tuple[Any, Any]:
        """paged_attention then decode_tail: one persistent launch where the tail takes it
        (decode_tail's rule) and the tensor-core attention's plan has an entry point
        (decode_block_kernel.layer_plan), the layer's attention then run inside it; else
        the two ops (always with a soft cap, attention[8]: layer_plan refuses one). The same
        bits either way."""
        if plan := self._layer_plan(attention, tail):
            weights = _tail_weights(tail)
            return decode_block_kernel.decode_layer(
                decode_block_kernel.Attention(*attention), *tail, plan=plan,
                table=self._table([weights]),
            )  # fmt: skip
        attn = self.paged_attention(*attention)
        return self.decode_tail(attn.reshape(attn.shape[0], -1), *tail)

    def attention_tail_qkv(self, attention: tuple, tail: tuple, head: tuple) -> tuple[Any, Any]:
        """attention_tail with the next layer's head (decode_tail_qkv's), likewise."""
        if plan := self._layer_plan(attention, tail, head[0]):
            weights = _tail_weights(tail, head[0])
            return decode_block_kernel.decode_layer(
                decode_block_kernel.Attention(*attention), *tail,
                head=decode_block_kernel.NextHead(head[0], decode_block_kernel.Rope(*head[1:])),
                plan=plan, table=self._table([weights]),
            )  # fmt: skip
        attn = self.paged_attention(*attention)
        return self.decode_tail_qkv(attn.reshape(attn.shape[0], -1), *tail, *head)

    def attention_layers(
        self, attention: tuple, layers: Sequence[tuple], residual: Any, eps: float, rope: tuple
    ) -> tuple[Any, Any]:
        """Backend.attention_layers: where the layer launch takes them (its plan and
        decode_block_kernel.layers_take), persistent launches of up to
        decode_block_kernel.MAX_LAYERS_A_LAUNCH layers each (decode_layers), else layer by
        layer (attention_tail_qkv, attention_tail). The same bits either way."""
        dbk = decode_block_kernel
        weights = [dbk.LayerWeights(*layer) for layer in layers]
        att = dbk.Attention(*attention)
        plan = self._layer_plan(attention, weights[0][:3], weights[0].w_qkv)
        per = dbk.MAX_LAYERS_A_LAUNCH or len(weights)
        starts = range(0, len(weights), per)
        if plan is None or not all(dbk.layers_take(att, weights[i : i + per]) for i in starts):
            return layer_by_layer(self, attention, layers, residual, eps, rope)
        positions, cos, sin, cache, slots, num_heads = rope
        summed, q = residual, att.q
        for i in starts:
            group = weights[i : i + per]
            heads = any(w.w_qkv is not None for w in group)
            group_rope = dbk.Rope(positions, cos, sin, cache, att.layer + i + 1, slots, num_heads)
            summed, q = dbk.decode_layers(
                att._replace(q=q, layer=att.layer + i), group, summed, eps,
                rope=group_rope if heads else None, plan=plan, table=self._table(group),
            )  # fmt: skip
        return summed, q

    def _table(self, layers: Sequence[Any]) -> Any:
        """decode_block_kernel.layer_table of `layers` (LayerWeights): an upload, so made
        on their first launch (an eager step, or a capture's warm-up run) and kept, with
        the weights, for every launch after, a graph's replays included."""
        key = tuple(id(x) for w in layers for x in w)
        if key not in self._layer_tables:
            self._layer_tables[key] = (decode_block_kernel.layer_table(layers), tuple(layers))
        return self._layer_tables[key][0]

    def _layer_plan(self, attention: tuple, tail: tuple, w_qkv: Any = None) -> Any:
        """The attention's split plan where the layer launch takes this call, else None."""
        rows = attention[0].shape[0]
        w_o, w_gate_up, w_down = tail[:3]
        if not (
            decode_block_kernel.BY_DEFAULT
            and self.attention == "tensor-cores"
            and decode_block_kernel.takes(rows, w_o, w_gate_up, w_down, w_qkv)
        ):
            return None
        return decode_block_kernel.layer_plan(decode_block_kernel.Attention(*attention), rows)

    def gemm_rope_kv_write(
        self, x: Any, w: Any, positions: Any, cos: Any, sin: Any, cache: Any, layer: int,
        slot_mapping: Any, num_heads: int,
    ) -> Any:  # fmt: skip
        """rope_kv_write of a bias-free qkv projection's product -> the rotated queries: on a
        weight the Hopper kernel takes, its rope epilogue where the plan allows
        (gemm_sm90_rope_kv_write: one kernel), else the product (through `gemm`) then
        rope_kv_write. The same bits either way."""
        from .gemm_sm90_kernel import PackedWeight, gemm_sm90_rope_kv_write

        args = (positions, cos, sin, cache, layer, slot_mapping, num_heads)
        if isinstance(w, PackedWeight) and not w.gated:
            return gemm_sm90_rope_kv_write(x, w, *args)
        qkv = self.gemm(x, w)
        return self.rope_kv_write(qkv.reshape(qkv.shape[0], -1, cache.shape[-1]), *args)

    @property
    def kernel_choice(self) -> str:
        """The kernels whose bits this backend's results carry: attention and the GEMM
        family its weights take on this device (the one gemm_family gives a shape the
        Hopper kernel supports), e.g. "tensor-cores/wgmma"; "tensor-cores+d256/..." where
        D256_BY_DEFAULT sends heads of 256 to the tensor-core kernel too."""
        from . import attention_tc_kernel
        from .gemm_sm90_kernel import device_arch, gemm_family
        from .gemm_sm90_plan import BLOCK_K

        gemm = gemm_family(device_arch(), 128, BLOCK_K, requested=self.gemm_family)
        attention = self.attention
        if attention == "tensor-cores" and attention_tc_kernel.D256_BY_DEFAULT:
            attention += "+d256"  # a head of 256 on this kernel too: other bits than before
        return f"{attention}/{gemm}"

    def device_memory_bytes(self) -> int:
        _, total = self._cupy.cuda.runtime.memGetInfo()
        return int(total)

    def kv_cache(self, shape: tuple[int, ...]) -> Any:
        return self._cupy.zeros(shape, dtype=BF16_BITS)

    def host_kv_cache(self, shape: tuple[int, ...]) -> np.ndarray:
        """The host tier's arena in pinned memory, viewed as BF16."""
        if not shape[0]:  # no host tier: nothing to pin
            return np.zeros(shape, dtype=BF16)
        import cupyx

        return cupyx.zeros_pinned(shape, dtype=BF16_BITS).view(BF16)

    def to_host(self, x: Any) -> np.ndarray:
        return _to_host(x)

    def from_host(self, x: np.ndarray) -> Any:
        return to_device(np.asarray(x))

    def offload_block(self, cache: Any, block_id: int, host_cache: np.ndarray, slot: int) -> None:
        """Copy one device block into a pinned host slot: `tier_copies` of one offload."""
        self.tier_copies(cache, host_cache, (("offload", block_id, slot),))

    def onboard_block(self, host_cache: np.ndarray, slot: int, cache: Any, block_id: int) -> None:
        """Copy a pinned host slot into a device block: `tier_copies` of one onboard."""
        self.tier_copies(cache, host_cache, (("onboard", slot, block_id),))

    def tier_copies(
        self, cache: Any, host_cache: np.ndarray, copies: Sequence[tuple[str, int, int]]
    ) -> None:
        """(kind, src, dst) offloads (device block `src` -> pinned host slot `dst`) and
        onboards (slot `src` -> block `dst`), in list order, each asynchronous on its
        direction's stream, after the compute already queued (which may still write a
        block offloaded or read one onboarded over) and after every copy of the other
        direction since the last `wait_copies` that touched its block or slot (an evicted
        block's offload before the onboard into it; an offload into a slot before the
        onboard from it).

        One call for a run of copies, as the runner hands them (a long host-tier match's
        hundreds): the compute is recorded once, each copy is one memcpyAsync between
        addresses (no array views, no event of its own), and an event is recorded only
        where a copy must wait for the other direction. (Before, each copy recorded the
        compute, made two views and recorded its own event: about 60 us of host time a
        copy under cProfile on the H200's host, which paced a long match's copies rather
        than the bus: bench/results/2026-11-28-h200, `profile host:`.)"""
        check_tier_copies(copies)
        if not copies:
            return
        runtime = self._cupy.cuda.runtime
        block_bytes = cache.nbytes // cache.shape[0]
        if not (cache.flags.c_contiguous and host_cache.flags.c_contiguous
                and host_cache.nbytes // host_cache.shape[0] == block_bytes):  # fmt: skip
            raise ValueError(
                "tier copies move whole blocks between contiguous arrays of one block size"
            )
        device0, host0 = int(cache.data.ptr), int(host_cache.ctypes.data)
        compute = self._cupy.cuda.get_current_stream().record()
        waited: set[str] = set()  # the directions whose stream waits for `compute` already
        for kind, src, dst in copies:
            if kind == "offload":
                direction, block, slot = "d2h", src, dst
            else:
                direction, block, slot = "h2d", dst, src
            device, host = device0 + block * block_bytes, host0 + slot * block_bytes
            stream = self._issue(
                direction, _keys(device, host), None if direction in waited else compute
            )
            waited.add(direction)
            if direction == "d2h":
                runtime.memcpyAsync(
                    host, device, block_bytes, runtime.memcpyDeviceToHost, stream.ptr
                )
            else:
                runtime.memcpyAsync(
                    device, host, block_bytes, runtime.memcpyHostToDevice, stream.ptr
                )

    def copy_block(self, cache: Any, src: int, dst: int) -> None:
        """Copy one device block over another on the compute stream, in order with the
        forward queued before and after it: one device-to-device memcpy (CuPy's indexed
        assignment, a copy kernel, took ~70 us of host time a call on the H200's host:
        a cached prompt's last block is copied in its admission)."""
        assert cache.flags.c_contiguous and src != dst, (cache.strides, src, dst)
        runtime = self._cupy.cuda.runtime
        block_bytes = cache.nbytes // cache.shape[0]
        base = cache.data.ptr
        runtime.memcpyAsync(base + dst * block_bytes, base + src * block_bytes, block_bytes,
                            runtime.memcpyDeviceToDevice,
                            self._cupy.cuda.get_current_stream().ptr)  # fmt: skip

    def read_block(self, cache: Any, block_id: int, out: np.ndarray) -> Any:
        """Copy one device block into a pinned host buffer of its shape (BF16 or its
        bits), asynchronously on the device-to-host stream, after the compute already
        queued (which may still be writing it). Returns the event recorded after the copy:
        `out` holds the block once `synchronize()` returns. Compute that later writes the
        block must be ordered after the copy by `wait_copies`, as after an offload."""
        return self._read(cache[block_id], out.view(BF16_BITS))

    def _read(self, src: Any, out: np.ndarray) -> Any:
        """A device-to-host copy after the compute queued and after any onboard since the
        last `wait_copies` that wrote `src` or read `out`; returns its event."""
        if not (src.flags.c_contiguous and out.flags.c_contiguous and src.nbytes == out.nbytes):
            raise ValueError("a block read copies a contiguous block into a buffer of its size")
        device, host = int(src.data.ptr), int(out.ctypes.data)
        compute = self._cupy.cuda.get_current_stream().record()
        stream = self._issue("d2h", _keys(device, host), compute)
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(host, device, src.nbytes, runtime.memcpyDeviceToHost, stream.ptr)
        return stream.record()

    def wait_copies(self) -> None:
        """Later compute waits for the copies issued so far, on the device. Every later
        copy waits for that compute, so it is ordered after these copies too."""
        compute = self._cupy.cuda.get_current_stream()
        for stream in self._streams.values():
            compute.wait_event(stream.record())
        for touched in self._touched.values():
            touched.clear()

    def copies_done(self) -> Any:
        """The block copies issued so far, to wait for on the host (`synchronize()`): the
        events recorded after them on each copy stream."""
        return _AllLanded([stream.record() for stream in self._streams.values()])

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._cupy.zeros(shape, dtype=dtype)

    def staging_buffer(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """Pinned host memory, so that `upload` from it is asynchronous."""
        import cupyx

        return cupyx.zeros_pinned(shape, dtype=dtype)

    def upload(self, dst: Any, src: np.ndarray) -> None:
        """Copy a host array into a device array or view of its shape and dtype, on the
        current stream: asynchronous when `src` is pinned, so `src` must then stay
        unchanged until the stream has passed the copy. A 2-d pair may have strided
        rows (a column range of a wider table); anything else must be contiguous."""
        runtime = self._cupy.cuda.runtime
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"upload needs one shape and dtype; got {dst.shape} {dst.dtype} from "
                f"{src.shape} {src.dtype}"
            )
        stream = self._cupy.cuda.get_current_stream().ptr
        kind = runtime.memcpyHostToDevice
        if dst.flags.c_contiguous and src.flags.c_contiguous:
            runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, kind, stream)
            return
        itemsize = src.dtype.itemsize
        if src.ndim != 2 or dst.strides[1] != itemsize or src.strides[1] != itemsize:
            raise ValueError(f"upload takes contiguous arrays or 2-d row views; got {src.strides}")
        rows, cols = src.shape
        runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0], src.ctypes.data, src.strides[0],
                              cols * itemsize, rows, kind, stream)  # fmt: skip

    def download(self, dst: np.ndarray, src: Any) -> Any:
        """Copy a contiguous device array into a pinned host array of its size, on the
        current stream after the work queued there (asynchronous: one memcpyAsync).
        Returns the event recorded after it: `dst` holds the bytes once `synchronize()`
        returns, while later work on the stream runs on."""
        if not (src.flags.c_contiguous and dst.flags.c_contiguous and src.nbytes == dst.nbytes):
            raise ValueError("download copies a contiguous array into a host buffer of its size")
        runtime = self._cupy.cuda.runtime
        stream = self._cupy.cuda.get_current_stream()
        runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, src.nbytes,
                            runtime.memcpyDeviceToHost, stream.ptr)  # fmt: skip
        return stream.record()

    def copy_rows(self, dst: Any, src: Any, rows: Any) -> None:
        """`dst[i] = src[rows[i]]` for every row of `dst`, on the current stream: with
        `rows` None (`src[i]`), one device-to-device memcpy; else a gather by the device
        array `rows`."""
        if rows is not None:
            dst[...] = src[rows]
            return
        if not (src.flags.c_contiguous and dst.flags.c_contiguous and src.dtype == dst.dtype):
            raise ValueError("copy_rows copies between contiguous arrays of one dtype")
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, runtime.memcpyDeviceToDevice,
                            self._cupy.cuda.get_current_stream().ptr)  # fmt: skip

    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Record `fn`'s kernels once as a CUDA graph; the callable returned replays them
        on the current stream and returns what `fn` returned at capture, the same device
        arrays each time.

        `fn` must take its inputs from, and leave its results in, device arrays that stay
        where they are (static buffers, the weights, the KV cache), must not touch the
        host, and must launch the same kernels each call. It runs once eagerly first, to
        load its kernels and grow the graphs' memory pool, then once under capture.
        Its temporaries come from a pool of their own that nothing else allocates from:
        graphs replay one at a time on one stream, so they may share it, and what a
        graph returns stays referenced, so no later capture reuses it.
        """
        cupy = self._cupy
        if self._graph_pool is None:
            self._graph_pool = cupy.cuda.MemoryPool()
        stream = cupy.cuda.Stream(non_blocking=True)  # capture cannot run on the legacy stream
        cupy.cuda.Device().synchronize()  # the static inputs were uploaded on another stream
        with cupy.cuda.using_allocator(self._graph_pool.malloc), stream:
            fn()
            stream.begin_capture()
            try:
                with pdl.capturing():
                    out = fn()
            except BaseException:
                stream.end_capture()
                raise
            graph = stream.end_capture()
        stream.synchronize()

        def replay() -> Any:
            graph.launch(stream=cupy.cuda.get_current_stream())
            return out

        return replay

    def _issue(self, direction: str, keys: tuple[tuple[str, int], ...], compute: Any) -> Any:
        """The stream of `direction` ("d2h" or "h2d") for a copy touching `keys`, made to
        wait for `compute` (an event of the compute stream, or None where this stream
        waits for it already) and, where a copy of the other direction since the last
        `wait_copies` touched any of `keys`, for every copy of that direction so far.
        NOTE: copies of one direction run in issue order on their stream; each waits for
        the compute queued before it (so it reads a block only once written and
        overwrites one only once read) and, across the two streams, for the copies
        touching its bytes: so every pair of copies touching the same bytes runs in
        issue order, while copies of different blocks in the two directions overlap.
        `_touched[d]` holds what d's copies touched that the other stream is not yet
        ordered after: one wait for the other stream's latest event orders all of them,
        so it empties."""
        stream = self._streams.get(direction)
        if stream is None:
            stream = self._streams[direction] = self._cupy.cuda.Stream(non_blocking=True)
        if compute is not None:
            stream.wait_event(compute)
        other = "h2d" if direction == "d2h" else "d2h"
        touched = self._touched[other]
        if touched and not touched.isdisjoint(keys):
            stream.wait_event(self._streams[other].record())
            touched.clear()
        self._touched[direction].update(keys)
        return stream

    embed = staticmethod(launchers.embed)
    rmsnorm = staticmethod(launchers.rmsnorm)
    add_rmsnorm = staticmethod(launchers.add_rmsnorm)
    norm_add_rmsnorm = staticmethod(launchers.norm_add_rmsnorm)
    norm_add = staticmethod(launchers.norm_add)
    rope = staticmethod(launchers.rope)
    kv_write = staticmethod(launchers.kv_write)
    rope_kv_write = staticmethod(launchers.rope_kv_write)
    silu_mul = staticmethod(launchers.silu_mul)
    gelu_tanh_mul = staticmethod(launchers.gelu_tanh_mul)
    softcap = staticmethod(launchers.softcap)
    add_bias = staticmethod(launchers.add_bias)
    head_rmsnorm = staticmethod(launchers.head_rmsnorm)
    argmax = staticmethod(launchers.argmax)

    @staticmethod
    def penalize(logits: Any, penalties: Penalties) -> None:
        """Apply each row's penalties (its logit bias first, its token mask last) to
        [R, vocab] fp32 device logits, in place."""
        if (bias := penalties.bias) is not None:
            add_logit_bias(logits, to_device(bias.offsets), to_device(bias.ids),
                           to_device(bias.values))  # fmt: skip
        apply_penalties(
            logits,
            token_offsets=to_device(penalties.token_offsets),
            token_ids=to_device(penalties.token_ids),
            output_counts=to_device(penalties.output_counts),
            repetition=to_device(penalties.repetition),
            frequency=to_device(penalties.frequency),
            presence=to_device(penalties.presence),
        )
        if (mask := penalties.mask) is not None:
            apply_token_mask(logits, to_device(mask.words))

    @staticmethod
    def sample(logits: Any, draws: Draws) -> Any:
        """One seeded draw per row of [R, vocab] fp32 device logits: [R] int32, on the device."""
        return launchers.sample(
            logits,
            temperature=to_device(draws.temperature),
            top_k=to_device(draws.top_k),
            top_p=to_device(draws.top_p),
            min_p=to_device(draws.min_p),
            seeds=to_device(draws.seeds),
            positions=to_device(draws.positions),
        )

    # Mixture-of-experts MLPs (moe_kernel.py; twins: moe.py): a layer's experts as one
    # [E, N, K] weight, the routing, the gather into expert groups, the grouped GEMM and
    # the weighted sum; every launch's grid a function of the shapes alone, so capturable.
    def expert_weights(self, w: np.ndarray) -> Any:
        """A layer's BF16 [E, N, K] expert weights (each [N, K] in the Hugging Face
        layout) on the device as one contiguous array, as moe_gemm takes them."""
        assert w.dtype == BF16 and w.ndim == 3, (w.dtype, w.shape)
        return to_device(w)

    moe_route = staticmethod(moe_kernel.moe_route)
    moe_gather = staticmethod(moe_kernel.moe_gather)
    moe_gemm = staticmethod(moe_kernel.moe_gemm)
    moe_combine = staticmethod(moe_kernel.moe_combine)

    @staticmethod
    def gemm(x: Any, w: Any, *, out_f32: bool = False) -> Any:
        from .gemm_sm90_kernel import PackedWeight, gemm_sm90

        if isinstance(w, PackedWeight):  # linear_weight chose the Hopper kernel for it
            return gemm_sm90(x, w, out_f32=out_f32)
        from .gemm_kernel import gemm

        return gemm(x, w, out_f32=out_f32)

    def paged_attention(
        self,
        q: Any,
        cache: Any,
        layer: int,
        block_tables: Any,
        seq_lens: Any,
        query_start_loc: Any,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Any:
        from . import attention_tc_kernel as tc

        # a head the tensor-core kernel lacks, or Gemma's 256 where D256_BY_DEFAULT is off,
        # runs on the CUDA cores: the choice is the model's and the settings', so every
        # step of an engine takes the same kernel
        head_dim, block_size = q.shape[2], cache.shape[4]
        on_tc = tc.takes(head_dim, block_size) and (head_dim != 256 or tc.D256_BY_DEFAULT)
        if self.attention == "tensor-cores" and on_tc:
            from .attention_tc_kernel import paged_attention_tc as kernel
        else:
            from .attention_kernel import paged_attention as kernel
        return kernel(
            q, cache, layer, block_tables, seq_lens, query_start_loc, scale, window, softcap
        )


def _keys(device: int, host: int) -> tuple[tuple[str, int], ...]:
    """A copy's two ends, by the address each starts at: block copies always move whole
    blocks, so two copies touch the same bytes exactly when an end starts at the same
    address."""
    return ("device", device), ("host", host)


class _AllLanded:
    """Copies on several streams, landed when each stream's event has."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()
