"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): the twins of the routing,
the grouped expert GEMM and the weighted sum of the experts' outputs.

A MoE layer, for T tokens, E experts of which each token takes k:

    logits = gemm(x, router)                 # [T, E] BF16, as transformers rounds them
    route = moe_route(logits, k, normalize)  # each token's k experts and their weights
    xs = moe_gather(x, route)                # [T * k, H]: token rows grouped by expert
    h = silu_mul(moe_gemm(xs, gate_up, route))   # [T * k, I]
    ys = moe_gemm(h, down, route)            # [T * k, H]
    out = moe_combine(ys, route, ...)        # [T, H] BF16: the weighted sum, rounded once

(the backends' ops; moe_gemm_ref takes the route's offsets)

Why a token's output does not depend on the step it is in (DESIGN §4): the routing
of token t reads logits[t] alone; its grouped rows are copies of x[t], and a GEMM row
is a function of its own input row and the weight alone (gemm.py; the grouped kernel
runs gemm.cu's unsplit tile, whose rows are M-independent); the combine reads token
t's k rows in its own slot order. Which rows share an expert with it moves only where
its rows sit, never what they hold.

Routing, bit for bit on both backends: the experts are chosen by the BF16 logits
(descending, ties to the lower id: softmax is monotonic, so these are the top-k
probabilities transformers picks, without a rounded exp to tie them). Their weights are
taken in float64 (exp(l - max) and its sums in ascending expert order, or slot order
for the k chosen) and rounded once to fp32; the kernel's double exp is within an ulp,
so its fp32 weights are these except where a weight lies within a few float64 ulps of
an fp32 rounding boundary (about 2^-28 of them).

Combine: acc = +0; acc = acc + w_j * y_j for the slots j = 0..k-1 in order (each
product and sum an fp32 rounding, no fused multiply-add), then, with a shared expert
(Qwen2-MoE), acc = acc + sigmoid(g) * shared with sigmoid(g) in float64 rounded to
fp32; the result rounded to BF16 once. The kernels compile with -ftz: an fp32 product,
sum or gate below 2^-126 flushes to zero there where this twin keeps it (routing is
exact either way: its comparisons are on BF16 bits, its weights rounded by hand).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import BF16, F32, to_bf16, to_f32
from .gemm import gemm_ref

F64 = np.dtype(np.float64)


@dataclass(slots=True)
class MoeRoute:
    """One step's routing of T tokens to k of E experts each; the rows of the grouped
    GEMMs are the T * k (token, slot) pairs, sorted by expert, then by token."""

    expert_ids: Any  # [T, k] int32: token t's experts, best first (ties: the lower id)
    weights: Any  # [T, k] fp32: their weights
    offsets: Any  # [E + 1] int32: expert e's grouped rows are offsets[e] .. offsets[e + 1]
    token_of_row: Any  # [T * k] int32: the token whose row each grouped row copies
    row_of_slot: Any  # [T * k] int32: the grouped row of token t's slot j, at t * k + j
    # the GPU's grouped GEMM's m tiles, numbered expert by expert (moe_tile_starts_ref):
    # [E + 1] int32 for tiles of tile_rows rows; None on the NumPy backend
    tile_starts: Any = None
    tile_rows: int = 0


def routing_weights(logits: np.ndarray, chosen: np.ndarray, normalize: bool) -> np.ndarray:
    """The fp32 weights of the chosen experts ([T, k] ids) of BF16 logits [T, E]: softmax
    over all E experts (normalize False: Qwen2-MoE's), or over the k chosen alone (True:
    Mixtral's, Qwen3-MoE's, the top-k probabilities divided by their sum), in float64."""
    l64 = to_f32(logits).astype(F64)
    peak = l64.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN logits: NaN weights
        exps = np.exp(l64 - peak)  # [T, E]
    picked = np.take_along_axis(exps, chosen.astype(np.int64), axis=1)  # [T, k]
    pool = picked if normalize else exps
    total = np.zeros((logits.shape[0], 1), dtype=F64)
    for column in range(pool.shape[1]):  # ascending order: the kernel's
        total += pool[:, column : column + 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (picked / total).astype(F32)


def moe_route_ref(logits: np.ndarray, top_k: int, normalize: bool) -> MoeRoute:
    """logits [T, E] BF16 -> the step's MoeRoute (numpy arrays)."""
    num_experts = logits.shape[1]
    assert 1 <= top_k <= num_experts, (top_k, num_experts)
    values = to_f32(logits)
    # stable sort of -value: equal logits keep ascending ids (NaN sorts last)
    order = np.argsort(-values, axis=1, kind="stable")
    expert_ids = order[:, :top_k].astype(np.int32)
    weights = routing_weights(logits, expert_ids, normalize)
    flat = expert_ids.reshape(-1)  # pair p = t * k + j
    rows_sorted = np.argsort(flat, kind="stable")  # by expert, then by pair (so by token)
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.zeros(num_experts + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(counts)
    row_of_slot = np.empty(flat.shape[0], dtype=np.int32)
    row_of_slot[rows_sorted] = np.arange(flat.shape[0], dtype=np.int32)
    token_of_row = (rows_sorted // top_k).astype(np.int32)
    return MoeRoute(expert_ids, weights, offsets, token_of_row, row_of_slot)


def moe_tile_starts_ref(offsets: np.ndarray, tile_rows: int) -> np.ndarray:
    """[E + 1] int32: expert e's m tiles of `tile_rows` rows are numbered tile_starts[e] ..
    tile_starts[e + 1] (ceil(its rows / tile_rows) of them), for the grouped GEMM's CTAs."""
    tiles = -(-np.diff(offsets.astype(np.int64)) // tile_rows)
    return np.concatenate([[0], np.cumsum(tiles)]).astype(np.int32)


def moe_gather_ref(x: np.ndarray, route: MoeRoute) -> np.ndarray:
    """x [T, H] BF16 -> [T * k, H] BF16: grouped row r is x[token_of_row[r]]."""
    return x[route.token_of_row]


def moe_gemm_ref(xs: np.ndarray, experts: Sequence[np.ndarray], offsets: np.ndarray) -> np.ndarray:
    """xs [R, K] BF16 grouped rows; experts: E weights [N, K] (BF16, or prepared by
    gemm.prepare_weight); offsets [E + 1] -> [R, N] BF16, rows offsets[e] .. offsets[e + 1]
    times expert e's weight (gemm_ref: each row a function of itself and the weight)."""
    num_rows = xs.shape[0]
    assert len(experts) + 1 == offsets.shape[0] and offsets[-1] == num_rows, (offsets, num_rows)
    out = np.zeros((num_rows, experts[0].shape[0]), dtype=BF16)
    for e, w in enumerate(experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            out[lo:hi] = gemm_ref(xs[lo:hi], w)
    return out


def shared_gate_ref(gate_logits: np.ndarray) -> np.ndarray:
    """sigmoid of BF16 [T, 1] gate logits, in float64, rounded to fp32: [T, 1]."""
    g = to_f32(gate_logits).astype(F64)
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-g))).astype(F32)


def moe_combine_ref(
    ys: np.ndarray,
    route: MoeRoute,
    shared: np.ndarray | None = None,
    shared_gate: np.ndarray | None = None,
) -> np.ndarray:
    """ys [T * k, H] BF16 (the experts' outputs, grouped rows) -> [T, H] BF16: for each
    token the sum of its slots' weight * output in slot order, then (Qwen2-MoE) its
    sigmoid-gated shared expert's output (shared [T, H] BF16, shared_gate [T, 1] BF16
    logits), in fp32, rounded once."""
    num_tokens, top_k = route.expert_ids.shape
    assert (shared is None) == (shared_gate is None)
    acc = np.zeros((num_tokens, ys.shape[1]), dtype=F32)
    rows = route.row_of_slot.reshape(num_tokens, top_k)
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(top_k):
            term = route.weights[:, j : j + 1] * to_f32(ys[rows[:, j]])
            acc = (acc + term).astype(F32)
        if shared is not None and shared_gate is not None:
            acc = (acc + shared_gate_ref(shared_gate) * to_f32(shared)).astype(F32)
    return to_bf16(acc)
