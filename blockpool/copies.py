"""Block copies the pool plans and the model runner executes.

The pool is bookkeeping only: when a decision moves bytes (an evicted device
block offloaded to a host slot, a host hit onboarded into a device block, the
shared tokens of a partially matching block copied into a fresh one), it
appends a `BlockCopy` to the step's list instead of copying. The engine hands
that list to the runner inside the step plan; the runner executes the copies
in list order before the forward pass, then the engine calls
`BlockPool.complete_copies()` to release the pins that kept both ends of each
copy in place.

The disk tier (disk.py) adds three kinds. A disk hit is read and checked when
the pool matches it (a damaged file is then a plain miss, before any token is
counted as cached), so its copy carries the block's checked bytes (`staged`)
and the runner only moves them into the device block. A block written to disk
is read from its device block or host slot by the runner, which hands the
bytes to the disk tier's writer thread with the key in `entry`.

NOTE: order matters and the list keeps it: an onboard issued after an offload
of the same slot must read what the offload wrote, and an offload (to the host
or to disk) of a block must read its old bytes before a later copy or the
forward writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .hashing import BlockHash, Namespace

CopyKind = Literal["offload", "onboard", "device", "disk_onboard", "device_to_disk", "host_to_disk"]
# The kinds whose two ends the pool pins until `complete_copies()`.
PINNED_KINDS: frozenset[str] = frozenset({"offload", "onboard", "disk_onboard"})
DISK_WRITE_KINDS: frozenset[str] = frozenset({"device_to_disk", "host_to_disk"})


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """The key a block file is stored under and confirmed against (disk.py)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_ids: tuple[int, ...] | None
    namespace: Namespace
    lineage: bytes  # the entry's, and its parent's (disk_format.py: lineage)
    parent_lineage: bytes


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One whole-block copy.

    offload:        device block `src` -> host slot `dst`
    onboard:        host slot `src` -> device block `dst`
    device:         device block `src` -> device block `dst`
    disk_onboard:   `staged` (a disk file's checked payload) -> device block `dst`
                    (a disk hit's new entry, or a partial match's fresh block)
    device_to_disk: device block `src` -> a file for `entry` (queued to the writer)
    host_to_disk:   host slot `src` -> a file for `entry` (queued to the writer)
    """

    kind: CopyKind
    src: int | None
    dst: int | None
    entry: DiskEntry | None = None
    # [num_layers, 2, num_kv_heads, block_size, head_dim], read-only; disk_onboard only
    staged: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def crosses_tiers(self) -> bool:
        return self.kind != "device"
