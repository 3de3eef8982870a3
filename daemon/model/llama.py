"""The Llama forward pass, written once over a backend's ops, for every family in
the registry (registry.py); a family's options switch its extra steps on.

    embed -> [add+rmsnorm, qkv gemm (+ bias), rope, kv write, paged attention, o gemm,
              add+rmsnorm, gate/up gemm, silu*mul, down gemm] x L
          -> add+rmsnorm -> lm_head (fp32 logits, only for the rows asked for)

Gemma (`gemma`) normalizes the attention's and the MLP's outputs before each residual
add (norm_add_rmsnorm), its MLP is gelu_tanh*mul, its embedding is scaled; Gemma 3's
sliding layers rotate by their own base, Gemma 2's scores and logits are soft-capped:
its layers run op by op.

OLMo 2 (`post_norms`) normalizes no layer input: a layer takes the residual stream in
BF16, and its attention's and MLP's outputs are normalized before each add (norm_add);
its layers run op by op.

A mixture of experts (`experts`: Mixtral, Qwen2-MoE, Qwen3-MoE) replaces a sparse
layer's MLP by its router, the grouped GEMMs of the k experts each token picks and
their weighted sum (cuda/moe.py; Qwen2-MoE's gated shared expert joins the sum): its
layers run op by op.

With `qkv_bias` (Qwen2) the QKV GEMM returns fp32 and `add_bias` adds the bias and
rounds to BF16 once, as transformers' BF16 linear layer does. With `qk_norm` (Qwen3)
each query and key head of the QKV output is RMS-normalized over head_dim
(`head_rmsnorm`) before RoPE; OLMo's (`qk_norm_whole`) normalize all the query heads of
a token as one row and all its key heads as one. A layer with either has its head (qkv, rope, kv write)
run op by op; the others' may run inside the projection's launch or the layer kernels.

The residual stream is fp32; every GEMM input is BF16. K and V are written
to the cache before attention, which reads them back from it, the current
tokens' own included, so a position's result never depends on whether its
prefix was computed in this step or an earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...cuda.protocol import Backend
from ...cuda.rope import rope_table
from .config import ModelConfig
from .weights import ExpertWeights, LlamaWeights


@dataclass(slots=True)
class ForwardBatch:
    """One engine step's tokens, flattened across sequences."""

    token_ids: np.ndarray  # [T] int32; an id >= vocab selects row id - vocab of prompt_rows
    positions: np.ndarray  # [T] int32, absolute position of each token
    slot_mapping: np.ndarray  # [T] int64, cache slot each token's K/V goes to
    block_tables: np.ndarray  # [B, max_blocks_per_seq] int32
    seq_lens: np.ndarray  # [B] int32, keys visible to each sequence after this step
    query_start_loc: np.ndarray  # [B + 1] int32, rows of each sequence
    logit_rows: np.ndarray | None  # [R] int32, rows whose logits are returned; None: all
    # [P, hidden] BF16: the prompt-table rows this step's fake ids select; None: no fake ids
    prompt_rows: np.ndarray | None = None


@dataclass(slots=True)
class _Layer:
    attn_norm: np.ndarray | None  # None: OLMo 2 normalizes no layer input
    qkv_proj: np.ndarray
    o_proj: np.ndarray
    mlp_norm: np.ndarray | None
    gate_up_proj: np.ndarray | None  # None: a sparse layer's MLP is its experts
    down_proj: np.ndarray | None
    qkv_bias: np.ndarray | None  # [q_size + 2 * kv_size] BF16; None: the family has none
    q_norm: np.ndarray | None = None  # BF16 (ModelConfig.qk_norm_sizes); None: no qk_norm
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # [hidden] BF16: Gemma's and OLMo 2's
    post_mlp_norm: np.ndarray | None = None
    experts: ExpertWeights | None = None  # the backend's arrays

    @property
    def plain_head(self) -> bool:
        """Its head is the projection, RoPE and the KV write alone (no bias or norm)."""
        return self.qkv_bias is None and self.q_norm is None


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: LlamaWeights, backend: Backend) -> None:
        self.config = config
        self.ops = backend
        linear = backend.linear_weight
        self.gemma = config.family.gemma
        # a GeGLU's gate/up product goes through gelu_tanh_mul, not swiglu's fusions
        gate_up = linear if self.gemma else backend.gate_up_weight

        def held(x: np.ndarray | None, hold: Any = backend.from_host) -> Any:
            return None if x is None else hold(x)

        def experts(w: ExpertWeights | None) -> ExpertWeights | None:
            if w is None:
                return None
            return ExpertWeights(
                router=linear(w.router),
                gate_up=backend.expert_weights(w.gate_up),
                down=backend.expert_weights(w.down),
                shared_gate_up=held(w.shared_gate_up, backend.gate_up_weight),
                shared_down=held(w.shared_down, linear),
                shared_gate=held(w.shared_gate, linear),
            )

        self.embed_tokens = backend.from_host(weights.embed_tokens)
        self.layers = [
            _Layer(
                attn_norm=held(w.attn_norm),
                qkv_proj=linear(w.qkv_proj),
                o_proj=linear(w.o_proj),
                mlp_norm=held(w.mlp_norm),
                gate_up_proj=held(w.gate_up_proj, gate_up),
                down_proj=held(w.down_proj, linear),
                qkv_bias=held(w.qkv_bias),
                q_norm=held(w.q_norm),
                k_norm=held(w.k_norm),
                post_attn_norm=held(w.post_attn_norm),
                post_mlp_norm=held(w.post_mlp_norm),
                experts=experts(w.experts),
            )
            for w in weights.layers
        ]
        self.final_norm = backend.from_host(weights.final_norm)
        # the norm that follows each layer: the next layer's input norm, or the final norm
        self._next_norm = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        self.lm_head = linear(weights.lm_head)
        cos, sin = rope_table(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.rotary_dim,
        )
        self.rope_cos, self.rope_sin = backend.from_host(cos), backend.from_host(sin)
        # each layer's (cos, sin): a layer without RoPE (SmolLM3's) rotates by angle 0, by
        # tables of ones and zeros, exactly the identity (x * 1 - y * 0 == x)
        rotating = config.rope_layers or (True,) * config.num_layers
        self.rope_tables = [(self.rope_cos, self.rope_sin)] * len(rotating)
        if not all(rotating):
            identity = backend.from_host(np.ones_like(cos)), backend.from_host(np.zeros_like(sin))
            self.rope_tables = [
                tables if rotates else identity
                for rotates, tables in zip(rotating, self.rope_tables, strict=True)
            ]
        if config.local_rope_layers is not None:  # Gemma 3's sliding layers: their own base
            assert config.local_rope_theta is not None, "ModelConfig checks both come together"
            local = rope_table(config.head_dim, config.max_position_embeddings,
                               config.local_rope_theta, None, config.rotary_dim)  # fmt: skip
            local = backend.from_host(local[0]), backend.from_host(local[1])
            self.rope_tables = [
                local if is_local else tables
                for is_local, tables in zip(config.local_rope_layers, self.rope_tables, strict=True)
            ]
        self.scale = config.attention_scale

    def num_bytes(self) -> int:
        """Bytes the weights take on the backend, as it holds them."""
        arrays = [self.embed_tokens, self.final_norm, self.lm_head]
        arrays += [table for tables in self.rope_tables for table in tables]
        for layer in self.layers:
            arrays += [getattr(layer, name) for name in layer.__slots__ if name != "experts"]
            if (moe := layer.experts) is not None:  # an expert's weights: maybe a list
                for name in moe.__slots__:
                    held = getattr(moe, name)
                    arrays += held if isinstance(held, list) else [held]
        arrays = [a for a in arrays if a is not None]
        unique = {id(a): a for a in arrays}  # a tied lm_head may be the embedding itself
        return sum(int(a.nbytes) for a in unique.values())

    def forward(self, batch: ForwardBatch, kv_cache: np.ndarray) -> np.ndarray:
        """Run one step; K/V of every token land in `kv_cache`. Returns fp32 [R, vocab]."""
        return self.forward_device(self._to_device(batch), kv_cache)

    def forward_hidden(self, batch: ForwardBatch, kv_cache: np.ndarray) -> tuple[Any, Any]:
        """`forward`, and the final norm's output at the same rows: (fp32 [R, vocab],
        BF16 [R, hidden]), the lm_head's input and output (embeddings: params.embed)."""
        hidden = self._final_hidden(self._to_device(batch), kv_cache)
        return self._logits(hidden), hidden

    def _to_device(self, batch: ForwardBatch) -> ForwardBatch:
        # the step's indices go to the device once (no copy on the NumPy backend)
        fields = (getattr(batch, f) for f in ForwardBatch.__slots__)
        moved: list[Any] = [None if x is None else self.ops.from_host(x) for x in fields]
        return ForwardBatch(*moved)

    def forward_device(self, batch: ForwardBatch, kv_cache: np.ndarray) -> np.ndarray:
        """`forward` on a batch whose arrays are already the backend's. It launches the
        same kernels for every batch of the same shapes and reads nothing back to the
        host, so the GPU backend can capture it in a CUDA graph (daemon/engine/graphs.py)."""
        return self._logits(self._final_hidden(batch, kv_cache))

    def _logits(self, hidden: Any) -> Any:
        """The lm_head's fp32 [R, vocab] logits of the final norm's output (Gemma 2's
        soft-capped)."""
        logits = self.ops.gemm(hidden, self.lm_head, out_f32=True)
        if self.config.final_softcap is not None:
            logits = self.ops.softcap(logits, self.config.final_softcap)
        return logits

    def _experts(self, x: Any, experts: ExpertWeights) -> Any:
        """A sparse layer's MLP of its normed rows x [T, hidden] BF16: [T, hidden] BF16."""
        ops, cfg = self.ops, self.config.experts
        assert cfg is not None
        route = ops.moe_route(ops.gemm(x, experts.router), cfg.top_k, cfg.normalize)
        grouped = ops.moe_gemm(ops.moe_gather(x, route), experts.gate_up, route)
        outputs = ops.moe_gemm(ops.silu_mul(grouped), experts.down, route)
        if experts.shared_gate_up is None:
            return ops.moe_combine(outputs, route)
        shared = ops.gemm(ops.swiglu(x, experts.shared_gate_up), experts.shared_down)
        return ops.moe_combine(outputs, route, shared, ops.gemm(x, experts.shared_gate))

    def _final_hidden(self, batch: ForwardBatch, kv_cache: np.ndarray) -> Any:
        """The layers and the final norm: its output [R, hidden] BF16 at `logit_rows`."""
        ops, cfg = self.ops, self.config
        num_tokens = batch.token_ids.shape[0]
        eps = cfg.rms_norm_eps
        # [T, heads + 2 * kv_heads, head_dim]: a biased qkv's view, built once
        heads_shape = (num_tokens, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        positions, slots, num_heads = batch.positions, batch.slot_mapping, cfg.num_heads
        tables, seq_lens, starts = batch.block_tables, batch.seq_lens, batch.query_start_loc
        cos, sin, scale = self.rope_cos, self.rope_sin, self.scale
        rope_tables = self.rope_tables
        # [T, hidden] fp32; fake ids read the step's prompt-table rows (never scaled)
        residual = ops.embed(self.embed_tokens, batch.token_ids, batch.prompt_rows,
                             cfg.embed_scale)  # fmt: skip
        if cfg.family.post_norms:  # OLMo 2's first layer takes the embeddings in BF16
            residual, x = ops.norm_add(residual, None, None, eps)
        else:
            x = ops.rmsnorm(residual, self.layers[0].attn_norm, eps)  # [T, hidden] BF16

        def rope_args(idx: int) -> tuple:
            return (positions, *rope_tables[idx], kv_cache, idx, slots, num_heads)

        def head(x: Any, idx: int) -> Any:
            # the queries come back rotated, the keys (rotated) and values go into their
            # cache slots: one launch on the GPU, or two with the projection's
            layer = self.layers[idx]
            if layer.plain_head:  # maybe in the projection's launch: gemm_rope_kv_write
                return ops.gemm_rope_kv_write(x, layer.qkv_proj, *rope_args(idx))
            if layer.qkv_bias is None:
                qkv = ops.gemm(x, layer.qkv_proj)
            else:
                qkv = ops.add_bias(ops.gemm(x, layer.qkv_proj, out_f32=True), layer.qkv_bias)
            qkv = qkv.reshape(heads_shape)
            if layer.q_norm is not None:
                qkv = ops.head_rmsnorm(qkv, layer.q_norm, layer.k_norm, num_heads, eps)
            return ops.rope_kv_write(qkv, *rope_args(idx))

        windows = cfg.layer_windows or (0,) * cfg.num_layers  # each layer's sliding window
        if cfg.experts is not None:  # a mixture of experts: op by op
            for idx, layer in enumerate(self.layers):
                attention: tuple = (head(x, idx), kv_cache, idx, tables, seq_lens, starts,
                                    scale, windows[idx])  # fmt: skip
                attn = ops.paged_attention(*attention).reshape(num_tokens, -1)
                residual, x = ops.gemm_add_rmsnorm(attn, layer.o_proj, residual, layer.mlp_norm,
                                                   eps)  # fmt: skip
                if layer.experts is None:  # a dense layer (Qwen's mlp_only_layers)
                    residual, x = ops.gemm_add_rmsnorm(ops.swiglu(x, layer.gate_up_proj),
                        layer.down_proj, residual, self._next_norm[idx], eps)  # fmt: skip
                else:
                    residual, x = ops.add_rmsnorm(residual, self._experts(x, layer.experts),
                                                  self._next_norm[idx], eps)  # fmt: skip
            return x if batch.logit_rows is None else x[batch.logit_rows]
        if cfg.family.post_norms:  # OLMo 2's outputs normalized before each add: op by op
            for idx, layer in enumerate(self.layers):
                attention = (head(x, idx), kv_cache, idx, tables, seq_lens, starts, scale,
                             windows[idx])  # fmt: skip
                out = ops.gemm(ops.paged_attention(*attention).reshape(num_tokens, -1),
                               layer.o_proj)  # fmt: skip
                residual, x = ops.norm_add(residual, out, layer.post_attn_norm, eps)
                out = ops.gemm(ops.swiglu(x, layer.gate_up_proj), layer.down_proj)
                if idx + 1 < len(self.layers):  # the next layer's input: the sum in BF16
                    residual, x = ops.norm_add(residual, out, layer.post_mlp_norm, eps)
                else:  # the final norm's
                    residual, x = ops.norm_add_rmsnorm(
                        residual, out, layer.post_mlp_norm, self.final_norm, eps
                    )
            return x if batch.logit_rows is None else x[batch.logit_rows]
        if self.gemma:  # sandwich norms and a GeGLU: op by op
            for idx, layer in enumerate(self.layers):
                attention = (head(x, idx), kv_cache, idx, tables, seq_lens, starts, scale,
                             windows[idx])  # fmt: skip
                if cfg.attn_softcap is not None:  # Gemma 2's
                    attention += (cfg.attn_softcap,)
                attn = ops.paged_attention(*attention)
                out = ops.gemm(attn.reshape(num_tokens, -1), layer.o_proj)
                residual, x = ops.norm_add_rmsnorm(
                    residual, out, layer.post_attn_norm, layer.mlp_norm, eps
                )
                out = ops.gemm(ops.gelu_tanh_mul(ops.gemm(x, layer.gate_up_proj)), layer.down_proj)
                residual, x = ops.norm_add_rmsnorm(
                    residual, out, layer.post_mlp_norm, self._next_norm[idx], eps
                )
            return x if batch.logit_rows is None else x[batch.logit_rows]
        q = head(x, 0)
        if (
            all(layer.plain_head for layer in self.layers)
            and cfg.rope_layers is None
            and len(set(windows)) == 1
        ):
            # each layer from its attention on, with the next layer's head: the layers
            # after the first head together, maybe one kernel (attention_layers)
            last = len(self.layers) - 1
            layers = [(layer.o_proj, layer.gate_up_proj, layer.down_proj, layer.mlp_norm,
                       self._next_norm[idx], self.layers[idx + 1].qkv_proj if idx < last else None)
                      for idx, layer in enumerate(self.layers)]  # fmt: skip
            residual, x = ops.attention_layers(
                (q, kv_cache, 0, tables, seq_lens, starts, scale, windows[0]), layers, residual, eps,
                (positions, cos, sin, kv_cache, slots, num_heads),
            )  # fmt: skip
        else:  # a qkv bias, q and k norms, layers without RoPE or windows differing by layer:
            # the layers one at a time
            for idx, layer in enumerate(self.layers):
                # attention, then o_proj and down_proj, whose outputs go only into the residual
                # add and the next norm: the layer from its attention on, maybe one kernel
                # (attention_tail), with the next layer's head where it is bias-free
                # (attention_tail_qkv)
                attention = (q, kv_cache, idx, tables, seq_lens, starts, scale, windows[idx])
                tail = (layer.o_proj, layer.gate_up_proj, layer.down_proj, residual, layer.mlp_norm,
                        self._next_norm[idx], eps)  # fmt: skip
                following = self.layers[idx + 1] if idx + 1 < len(self.layers) else None
                if following is not None and following.plain_head:
                    qkv = (following.qkv_proj, *rope_args(idx + 1))
                    residual, q = ops.attention_tail_qkv(attention, tail, qkv)
                    continue
                residual, x = ops.attention_tail(attention, tail)
                if following is not None:
                    q = head(x, idx + 1)
        # x is now the final norm's output; only the rows that sample need the lm_head.
        return x if batch.logit_rows is None else x[batch.logit_rows]
