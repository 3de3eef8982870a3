"""Block copies the pool plans and the model runner executes.

The pool is bookkeeping only: when a decision moves bytes (an evicted device
block offloaded to a host slot, a host hit onboarded into a device block, the
shared tokens of a partially matching block copied into a fresh one), it
appends a `BlockCopy` to the step's list instead of copying. The engine hands
that list to the runner inside the step plan; the runner executes the copies
in list order before the forward pass, then the engine calls
`BlockPool.complete_copies()` to release the pins that kept both ends of each
copy in place.

NOTE: order matters and the list keeps it: an onboard issued after an offload
of the same slot must read what the offload wrote, and an offload of a device
block must read its old bytes before a later copy or the forward writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CopyKind = Literal["offload", "onboard", "device"]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One whole-block copy.

    offload: device block `src` -> host slot `dst`
    onboard: host slot `src` -> device block `dst`
    device:  device block `src` -> device block `dst`
    """

    kind: CopyKind
    src: int
    dst: int

    @property
    def crosses_tiers(self) -> bool:
        return self.kind != "device"
