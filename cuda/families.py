"""Every kernel family once: its `.cu` source, the launchers that run its kernels and
the NumPy twins that define what they compute (DESIGN §5).

Launchers and twins are named "module:function" within this package, resolved only
on request (`resolve`), so this module imports nothing of ours and anything may import
it. Guarantee (tests/test_kernel_families.py): the table names every `.cu` file of
this folder exactly once, and every launcher and twin it names exists.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).parent


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # the source is <name>.cu; kernels.module(name) compiles it
    launchers: tuple[str, ...]  # "module:function": check inputs, launch its kernels
    twins: tuple[str, ...]  # "module:function": the NumPy references

    @property
    def source(self) -> Path:
        return KERNEL_DIR / f"{self.name}.cu"


FAMILIES: tuple[Family, ...] = (
    Family(
        "activation",
        ("launchers:silu_mul", "launchers:gelu_tanh_mul", "launchers:softcap"),
        ("activation:silu_mul_ref", "activation:gelu_tanh_mul_ref", "activation:softcap_ref"),
    ),
    Family("attention", ("attention_kernel:paged_attention",), ("attention:paged_attention_ref",)),
    Family(
        "attention_tc",
        ("attention_tc_kernel:paged_attention_tc",),
        ("attention:paged_attention_ref",),
    ),
    Family("bias", ("launchers:add_bias",), ("bias:add_bias_ref",)),
    Family(
        "decode_block",
        ("decode_block_kernel:decode_tail",),
        ("decode_block:decode_tail_ref",),
    ),
    Family("embedding", ("launchers:embed",), ("embedding:embed_ref",)),
    Family(
        "gemm",
        ("gemm_kernel:gemm", "gemm_kernel:grouped_gemm"),
        ("gemm:gemm_ref", "moe:moe_gemm_ref"),
    ),
    Family("gemm_sm90", ("gemm_sm90_kernel:gemm_sm90",), ("gemm:gemm_ref",)),
    Family(
        "kvcache",
        ("launchers:kv_write", "launchers:rope_kv_write"),
        ("kvcache:kv_write_ref", "kvcache:rope_kv_write_ref"),
    ),
    Family(
        "moe",
        ("moe_kernel:moe_route", "moe_kernel:moe_gather", "moe_kernel:moe_combine"),
        ("moe:moe_route_ref", "moe:moe_gather_ref", "moe:moe_combine_ref"),
    ),
    Family(
        "rmsnorm",
        (
            "launchers:rmsnorm",
            "launchers:add_rmsnorm",
            "launchers:norm_add_rmsnorm",
            "launchers:norm_add",
            "launchers:head_rmsnorm",
        ),
        (
            "rmsnorm:rmsnorm_ref",
            "rmsnorm:add_rmsnorm_ref",
            "rmsnorm:norm_add_rmsnorm_ref",
            "rmsnorm:norm_add_ref",
            "rmsnorm:head_rmsnorm_ref",
        ),
    ),
    Family(
        "penalties",
        (
            "penalties_kernel:apply_penalties",
            "penalties_kernel:add_logit_bias",
            "penalties_kernel:apply_token_mask",
        ),
        (
            "penalties:penalize_ref",
            "penalties:add_logit_bias_ref",
            "penalties:apply_token_mask_ref",
        ),
    ),
    Family("rope", ("launchers:rope",), ("rope:rope_ref",)),
    Family(
        "sampling",
        ("launchers:argmax", "launchers:sample", "launchers:philox_uniform"),
        ("sampling:argmax_ref", "sampling:sample_ref", "sampling:uniform"),
    ),
)
_BY_NAME = {family.name: family for family in FAMILIES}


def family(name: str) -> Family:
    """The family of `cuda/<name>.cu`; unknown names raise ValueError listing the known."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"no kernel family {name!r}; the families are {', '.join(_BY_NAME)}"
        ) from None


def resolve(ref: str) -> Callable[..., Any]:
    """The function a "module:function" reference of the table names."""
    module, _, function = ref.partition(":")
    return getattr(importlib.import_module(f".{module}", __package__), function)
