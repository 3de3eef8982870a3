"""The KV events socket: the engine's block events, published as vLLM's subscribers read them.

One ZeroMQ PUB socket at `events_address` (none: events are dropped). Each loop turn's
events go out as one multipart message, numbered from 0 as vLLM numbers its batches
(ipc/kv_events.py). Subscribers cannot push work onto the daemon: a PUB socket reads
only their subscriptions, and a longer message drops their connection.
"""

from __future__ import annotations

import time

import zmq

from ...blockpool.events import KVEvent
from ...ipc.kv_events import KVEventLayout, batch_frames, encode_batch
from ...ipc.sockets import ipc_path, is_ipv6, prepare_ipc_path
from .status import Counters

# A subscriber sends us only its subscriptions, a topic each: longer messages get its
# connection dropped rather than buffered.
MAX_SUBSCRIPTION_BYTES = 4096


class EventPublisher:
    def __init__(self, address: str | None, layout: KVEventLayout, counters: Counters) -> None:
        self.address = address
        self.layout = layout
        self.counters = counters
        self.seq = 0  # the next batch's number
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None

    def bind(self) -> None:
        """Listen at the address (an ipc:// socket private to this user), if there is one."""
        if not self.address:
            return
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
        self._pub.setsockopt(zmq.IPV6, int(is_ipv6(self.address)))
        path = ipc_path(self.address)
        if path is not None:
            prepare_ipc_path(path, "--events")
        self._pub.bind(self.address)
        if path is not None:
            path.chmod(0o600)

    def publish(self, events: list[KVEvent]) -> None:
        if not events or self._pub is None:
            return
        payload = encode_batch(events, ts=time.time(), layout=self.layout)
        self._pub.send_multipart(batch_frames(self.seq, payload))
        self.seq += 1
        self.counters.num_events_published += len(events)

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close()
        self._ctx.term()
