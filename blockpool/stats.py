"""Block pool statistics, with TensorRT-LLM's KvCacheStats meanings.

`BlockPool.stats()` returns a snapshot: gauges (the pool now) and counters
(totals since the pool was made; `BlockPool.clear()` does not reset them).
The engine adds its own prefill token counts next to `as_dict()`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class PoolCounters:
    """The running totals the pool keeps; see `KVCacheStats` for each meaning."""

    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    evictions: int = 0
    host_offloads: int = 0
    host_onboards: int = 0
    host_hits: int = 0
    host_evictions: int = 0
    partial_hits: int = 0
    disk_hits: int = 0


@dataclass(slots=True)
class KVCacheStats:
    # Gauges.
    max_blocks: int  # device blocks in the pool
    free_blocks: int  # device blocks no request holds (blank or cached): allocatable now
    used_blocks: int  # max_blocks - free_blocks
    tokens_per_block: int  # the block size
    cached_blocks: int  # device blocks findable by their digest (held or free)
    host_max_blocks: int  # host slots (0 without a host tier)
    host_cached_blocks: int  # host slots findable by their digest
    # Counters.
    alloc_total_blocks: int  # blocks given to requests: alloc_new_blocks + reused_blocks
    alloc_new_blocks: int  # blocks handed out by allocate(), to be computed
    reused_blocks: int  # full blocks served by match() from either tier
    missed_blocks: int  # full blocks looked up by match() and not served
    hit_rate: float  # reused / (reused + missed); 0.0 before any lookup
    evictions: int  # cached device blocks taken for reuse (offloaded or dropped)
    host_offloads: int  # device blocks copied to the host tier on eviction
    host_onboards: int  # host blocks copied back into a device block
    host_hits: int  # blocks match() served from the host tier (each one onboarded)
    host_evictions: int  # cached host slots taken for another offload
    partial_hits: int  # find_partial() calls that found a block
    disk_hits: int  # blocks match() served from the disk tier (each one onboarded)
    # The disk tier (all 0 without one; see disk.py's stats()).
    disk_enabled: int = 0  # 1 while the tier serves; 0 after one warning disabled it
    disk_blocks: int = 0  # block files indexed
    disk_bytes: int = 0  # their size
    disk_writes: int = 0  # block files written
    disk_writes_dropped: int = 0  # writes not done: the writer's queue was full, or closing
    disk_evictions: int = 0  # files removed to keep the size bound
    disk_corrupt_removed: int = 0  # damaged, truncated or foreign files found, never served
    disk_stale_bytes: int = 0  # other layouts' files in the directory, counted in its bound
    disk_stale_removed: int = 0  # of those, files removed to keep the bound

    @classmethod
    def from_counters(
        cls,
        counters: PoolCounters,
        *,
        max_blocks: int,
        free_blocks: int,
        tokens_per_block: int,
        cached_blocks: int,
        host_max_blocks: int,
        host_cached_blocks: int,
        disk: dict[str, int | bool] | None = None,
    ) -> KVCacheStats:
        lookups = counters.reused_blocks + counters.missed_blocks
        return cls(
            max_blocks=max_blocks,
            free_blocks=free_blocks,
            used_blocks=max_blocks - free_blocks,
            tokens_per_block=tokens_per_block,
            cached_blocks=cached_blocks,
            host_max_blocks=host_max_blocks,
            host_cached_blocks=host_cached_blocks,
            alloc_total_blocks=counters.alloc_new_blocks + counters.reused_blocks,
            hit_rate=counters.reused_blocks / lookups if lookups else 0.0,
            **asdict(counters),
            **{name: int(disk[name]) for name in _DISK_FIELDS if disk is not None},
        )

    def as_dict(self) -> dict[str, int | float]:
        """The stats as one flat dict, field names as keys."""
        return asdict(self)


_DISK_FIELDS = (
    "disk_enabled",
    "disk_blocks",
    "disk_bytes",
    "disk_writes",
    "disk_writes_dropped",
    "disk_evictions",
    "disk_corrupt_removed",
    "disk_stale_bytes",
    "disk_stale_removed",
)
