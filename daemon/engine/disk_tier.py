"""Opening the disk tier an engine's settings name (`disk_cache`, `disk_cache_gb`).

Guarantees: a tier is opened only with the model's fingerprint and a producer
string naming the backend, the device and this package's version, so its files
are matched only by an engine that would compute the same KV bytes; a bad disk
setting raises SettingError naming `disk_cache_gb`.
"""

from __future__ import annotations

import importlib.metadata
from typing import cast

from ...blockpool.disk import DiskTier
from ...blockpool.disk_config import DiskTierConfig
from ...cuda.kvcache import kv_cache_shape
from ..model.config import ModelConfig
from ..model.llama import LlamaModel
from .config import EngineConfig, SettingError


def open_disk_tier(
    settings: EngineConfig, config: ModelConfig, model: LlamaModel, fingerprint: bytes
) -> DiskTier | None:
    """The disk tier `settings.disk_cache` names, its index rebuilt from its files; a
    folder that turns out unusable (locked by another daemon, a read-only mount) gives
    a disabled tier and one warning."""
    if settings.disk_cache is None:
        return None
    if not fingerprint:
        raise ValueError("a disk cache needs the model fingerprint (model_fingerprint=...)")
    ops = model.ops
    device = "cpu"
    if ops.name == "cupy":
        from ...cuda.cupy_backend import CupyBackend
        from ...cuda.gemm_sm90_kernel import device_arch

        device = f"sm_{device_arch()}/{cast(CupyBackend, ops).kernel_choice}"
    try:
        version = importlib.metadata.version("reprise")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    shape = kv_cache_shape(
        1, config.num_layers, config.num_kv_heads, settings.block_size, config.head_dim
    )
    try:
        disk_config = DiskTierConfig(
            directory=settings.disk_cache,
            max_bytes=settings.disk_cache_bytes,
            block_shape=shape[1:],
            block_size=settings.block_size,
            model_fingerprint=fingerprint,
            # KV bytes are bit-identical per backend and device (DESIGN §4), and code
            # changes may change them: files of another producer never match.
            producer=f"{ops.name}/{device}/reprise {version}",
        )
    except ValueError as e:
        raise SettingError("disk_cache_gb", f"disk_cache_gb: {e}") from e
    return DiskTier.open(disk_config)
