"""Launchers of a mixture-of-experts MLP on the GPU: moe.cu's routing, gather and combine,
and gemm.cu's grouped expert GEMM (gemm_kernel.grouped_gemm). Twins: moe.py, whose
docstring is the contract; every kernel gives the twin's bits (the grouped GEMM: within
BF16 rounding, as every GEMM of ours, its rows independent of the routing).

Each launcher checks its inputs (ValueError naming the bad one), allocates its outputs
with cupy.empty (every element is written) and launches through kernels.launch_kernel.
Nothing here reads device data, and every grid is a function of the shapes alone (T, E,
k, H, N), never of the routing: a step's MoE layers capture into a CUDA graph that
replays for any routing. T = 0 launches nothing. CuPy is imported lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .gemm_kernel import INT32_MAX, grouped_gemm, grouped_tile_config
from .kernels import BF16_BITS, check, kernel, launch_kernel
from .moe import MoeRoute

MAX_EXPERTS = 256  # moe.cu's kMaxExperts: a warp's lanes hold 8 logits each
MAX_TOP_K = 32  # kMaxTopK: slot j is lane j's
ROUTE_WARPS = 4  # kRouteWarps: moe_route_topk's tokens a CTA, a warp each
ROWS_THREADS = 256  # kRowsThreads: moe_route_rows' CTA, one an expert
COPY_THREADS = 128  # kCopyThreads: moe_gather's CTA a row, moe_combine's a token


def moe_route(logits: Any, top_k: int, normalize: bool) -> MoeRoute:
    """Twin: moe_route_ref. logits [T, E] BF16 (the router's product) -> the step's
    MoeRoute of device arrays: each token's top_k experts by logit (ties to the lower id)
    and their weights (softmax over the k chosen with `normalize`, else over all E), and
    the grouped rows' bookkeeping, their m tiles numbered for the tile the grouped GEMMs
    will take (gemm_kernel.grouped_tile_config). Two launches: moe_route_topk (a warp a
    token), then moe_route_rows (a CTA an expert)."""
    check("logits", logits, BF16_BITS, 2)
    num_tokens, num_experts = logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(
            f"the expert count (logits' columns) must be in [1, {MAX_EXPERTS}]; got {num_experts}"
        )
    if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(
            f"top_k must be in [1, {min(num_experts, MAX_TOP_K)}] for {num_experts} experts; got {top_k}"
        )
    num_pairs = num_tokens * top_k
    if num_pairs > INT32_MAX:
        raise ValueError(f"T * top_k must fit in int32; got {num_tokens} * {top_k}")
    import cupy

    tile_rows = grouped_tile_config(num_tokens, top_k, num_experts).block_m
    route = MoeRoute(
        expert_ids=cupy.empty((num_tokens, top_k), dtype=np.int32),
        weights=cupy.empty((num_tokens, top_k), dtype=np.float32),
        # no tokens: every expert's rows empty, and no launch to say so
        offsets=(cupy.empty if num_tokens else cupy.zeros)(num_experts + 1, dtype=np.int32),
        token_of_row=cupy.empty(num_pairs, dtype=np.int32),
        row_of_slot=cupy.empty(num_pairs, dtype=np.int32),
        tile_starts=(cupy.empty if num_tokens else cupy.zeros)(num_experts + 1, dtype=np.int32),
        tile_rows=tile_rows,
    )
    if num_tokens == 0:
        return route
    i32 = np.int32
    launch_kernel(
        kernel("moe", "moe_route_topk"), (-(-num_tokens // ROUTE_WARPS),), (32 * ROUTE_WARPS,),
        (logits, route.expert_ids, route.weights, i32(num_tokens), i32(num_experts), i32(top_k),
         i32(1 if normalize else 0)),
    )  # fmt: skip
    launch_kernel(
        kernel("moe", "moe_route_rows"), (num_experts,), (ROWS_THREADS,),
        (route.expert_ids, route.offsets, route.token_of_row, route.row_of_slot,
         route.tile_starts, i32(num_pairs), i32(top_k), i32(num_experts), i32(tile_rows)),
    )  # fmt: skip
    return route


def moe_gather(x: Any, route: MoeRoute) -> Any:
    """Twin: moe_gather_ref. x [T, H] BF16 -> xs [T * k, H] BF16, grouped row r a copy of
    x[token_of_row[r]]."""
    num_tokens, top_k, _ = _route_shape(route)
    check("x", x, BF16_BITS, 2)
    if x.shape[0] != num_tokens:
        raise ValueError(f"x must have the route's {num_tokens} rows; got {tuple(x.shape)}")
    hidden = x.shape[1]
    import cupy

    xs = cupy.empty((num_tokens * top_k, hidden), dtype=BF16_BITS)
    if num_tokens == 0 or hidden == 0:
        return xs
    launch_kernel(
        kernel("moe", "moe_gather"), (num_tokens * top_k,), (COPY_THREADS,),
        (x, route.token_of_row, xs, np.int32(hidden)),
    )  # fmt: skip
    return xs


def moe_gemm(xs: Any, experts: Any, route: MoeRoute) -> Any:
    """Twin: moe_gemm_ref. xs [T * k, K] grouped rows, experts [E, N, K] (BF16, contiguous:
    CupyBackend.expert_weights) -> [T * k, N] BF16, expert e's rows times experts[e]^T
    (gemm_kernel.grouped_gemm: one launch, its grid a function of T * k, N, E and the
    route's tile)."""
    num_tokens, top_k, num_experts = _route_shape(route)
    check("xs", xs, BF16_BITS, 2)
    check("experts", experts, BF16_BITS, 3)
    if xs.shape[0] != num_tokens * top_k:
        raise ValueError(
            f"xs must have the route's {num_tokens * top_k} rows; got {tuple(xs.shape)}"
        )
    if experts.shape[0] != num_experts:
        raise ValueError(
            f"experts must hold the route's {num_experts} experts; got {tuple(experts.shape)}"
        )
    return grouped_gemm(xs, experts, route.offsets, route.tile_starts, route.tile_rows)


def moe_combine(ys: Any, route: MoeRoute, shared: Any = None, shared_gate: Any = None) -> Any:
    """Twin: moe_combine_ref. ys [T * k, H] BF16 (the experts' outputs, grouped rows) ->
    [T, H] BF16: each token's weighted sum of its slots' rows in slot order, then (with
    `shared` [T, H] BF16 and `shared_gate` [T, 1] BF16 logits, Qwen2-MoE's shared expert)
    sigmoid(gate) * shared, in fp32 with no FMA, rounded once."""
    num_tokens, top_k, _ = _route_shape(route)
    check("ys", ys, BF16_BITS, 2)
    if ys.shape[0] != num_tokens * top_k:
        raise ValueError(
            f"ys must have the route's {num_tokens * top_k} rows; got {tuple(ys.shape)}"
        )
    hidden = ys.shape[1]
    if (shared is None) != (shared_gate is None):
        raise ValueError("shared and shared_gate come together (a shared expert) or not at all")
    if shared is not None:
        check("shared", shared, BF16_BITS, 2)
        check("shared_gate", shared_gate, BF16_BITS, 2)
        if shared.shape != (num_tokens, hidden):
            raise ValueError(
                f"shared must have shape {(num_tokens, hidden)}; got {tuple(shared.shape)}"
            )
        if shared_gate.shape != (num_tokens, 1):
            raise ValueError(
                f"shared_gate must have shape {(num_tokens, 1)}; got {tuple(shared_gate.shape)}"
            )
    import cupy

    out = cupy.empty((num_tokens, hidden), dtype=BF16_BITS)
    if num_tokens == 0 or hidden == 0:
        return out
    has_shared = shared is not None
    launch_kernel(
        kernel("moe", "moe_combine"), (num_tokens,), (COPY_THREADS,),
        (ys, route.weights, route.row_of_slot, shared if has_shared else ys,
         shared_gate if has_shared else ys, out, np.int32(hidden), np.int32(top_k),
         np.int32(has_shared)),
    )  # fmt: skip
    return out


def _route_shape(route: MoeRoute) -> tuple[int, int, int]:
    """(T, k, E) of a MoeRoute of device arrays as moe_route makes it; ValueError naming
    the field that does not fit."""
    check("route.expert_ids", route.expert_ids, np.int32, 2)
    num_tokens, top_k = route.expert_ids.shape
    check("route.weights", route.weights, np.float32, 2)
    check("route.offsets", route.offsets, np.int32, 1)
    check("route.token_of_row", route.token_of_row, np.int32, 1)
    check("route.row_of_slot", route.row_of_slot, np.int32, 1)
    if route.weights.shape != (num_tokens, top_k):
        raise ValueError(
            f"route.weights must have shape {(num_tokens, top_k)}; got {route.weights.shape}"
        )
    for name in ("token_of_row", "row_of_slot"):
        if getattr(route, name).shape != (num_tokens * top_k,):
            raise ValueError(
                f"route.{name} must have shape {(num_tokens * top_k,)}; got {getattr(route, name).shape}"
            )
    num_experts = route.offsets.shape[0] - 1
    if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(
            f"the route's top_k must be in [1, {MAX_TOP_K}] and at most its experts; got {top_k}"
        )
    return num_tokens, top_k, num_experts
