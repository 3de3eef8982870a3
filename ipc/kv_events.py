"""KV events on the wire: the batches the daemon publishes on its `--events` PUB socket.

Two layouts, both vLLM's, so a KV-aware router written for vLLM reads ours:

- `vllm` (the default): today's vLLM (`vllm/distributed/kv_events.py`, msgspec
  structs with `tag=True`): a batch is a msgpack map `{"ts", "events",
  "data_parallel_rank"}` and each event a map whose `"type"` names its class,
  then its fields by name: `BlockStored {block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name}`, `BlockRemoved
  {block_hashes, medium}`, `AllBlocksCleared {}`. `BlockStored` adds `extra_keys`
  when a block's key holds extra ids (prompt tables): one entry per block, that
  block's per-token extra ids as an array, or nil for a block keyed without them.
  Fields that carry a default in vLLM's schema and hold it here (`extra_keys` of a
  text-only event, `group_idx`, ...) are left out, as msgspec's `omit_defaults`
  leaves them out, so a decoder reads them as null.
- `vllm-legacy`: vLLM's older `array_like` layout, for routers pinned to it: a batch
  is `[ts, [event, ...]]` and each event a tagged array, fields in declaration
  order (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
  `["AllBlocksCleared"]`). Trailing fields follow when they hold something:
  `lora_name`, then `extra_keys` (the array-like vLLM releases that had both put
  them there; a decoder from before them reads only the fields it knows).

Salted namespaces' events carry hashes only: no token ids and no extra keys.
`medium` is "GPU" (device tier) or "CPU" (host tier), as vLLM names them, or "DISK"
(the disk tier), as SGLang's and Dynamo's events name a disk tier; vLLM's schema
takes any string there.

Each batch goes out as the multipart message `[topic, sequence, payload]`, the
sequence an 8-byte big-endian counter from 0, as vLLM's publisher numbers them.
Block hashes are the raw 32-byte keys (vLLM's `ExternalBlockHash` is bytes or int).
"""

from __future__ import annotations

from typing import Literal, get_args

import msgpack

from ..blockpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

KVEventLayout = Literal["vllm", "vllm-legacy"]
KV_EVENT_LAYOUTS: tuple[str, ...] = get_args(KVEventLayout)


def check_layout(layout: str) -> KVEventLayout:
    """`layout` if it is one of KV_EVENT_LAYOUTS, else a ValueError naming the choices."""
    if layout not in KV_EVENT_LAYOUTS:
        raise ValueError(
            f"KV event layout must be one of {', '.join(KV_EVENT_LAYOUTS)}; got {layout!r}"
        )
    return layout  # type: ignore[return-value]


def encode_batch(events: list[KVEvent], *, ts: float, layout: KVEventLayout = "vllm") -> bytes:
    """The msgpack payload of one batch of events, oldest first, in `layout`."""
    if layout == "vllm":
        body: object = {
            "ts": ts,
            "events": [_event_map(e) for e in events],
            "data_parallel_rank": 0,
        }
    else:
        body = [ts, [_event_array(e) for e in events]]
    return msgpack.packb(body, use_bin_type=True)


def batch_frames(seq: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
    """The multipart message of batch number `seq` (0, 1, ...)."""
    return [topic, seq.to_bytes(8, "big"), payload]


def _event_map(event: KVEvent) -> dict[str, object]:
    if isinstance(event, BlockStored):
        wire: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            wire["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        return wire
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def _event_array(event: KVEvent) -> list[object]:
    if isinstance(event, BlockStored):
        wire: list[object] = [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
        ]
        if event.lora_name is not None or event.extra_keys is not None:
            wire.append(event.lora_name)
        if event.extra_keys is not None:
            wire.append([None if k is None else list(k) for k in event.extra_keys])
        return wire
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]
