"""KV events on the wire decode with a decoder written from vLLM's schema (issue 24).

The decoder below is vLLM's field list (`vllm/distributed/kv_events.py`: msgspec
structs, `tag=True`, `omit_defaults=True`) declared as msgspec structs, so a batch
that today's vLLM subscribers and KV-aware routers would refuse fails here too.
The legacy layout is checked against vLLM's older `array_like=True` structs.
"""

from __future__ import annotations

import msgspec
import pytest

from reprise.blockpool.events import AllBlocksCleared, BlockRemoved, BlockStored
from reprise.ipc.kv_events import batch_frames, check_layout, encode_batch

Hash = bytes | int


class _Event(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class VllmBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


class _Legacy(msgspec.Struct, tag=True, array_like=True):
    pass


class LegacyBlockStored(_Legacy, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None


class LegacyBlockRemoved(_Legacy, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None


class LegacyAllBlocksCleared(_Legacy, tag="AllBlocksCleared"):
    pass


class LegacyBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


def _events() -> list:
    h1, h2, h3 = (bytes([i]) * 32 for i in (1, 2, 3))
    return [
        BlockStored([h1, h2], None, list(range(8)), 4, None, "GPU", None),
        BlockStored([h3], h2, [9, 9, 9, 9], 4, None, "CPU", "adapter-a"),
        BlockRemoved([h1], "GPU"),
        AllBlocksCleared(),
    ]


def test_the_default_layout_decodes_with_vllms_current_schema() -> None:
    events = _events()
    batch = msgspec.msgpack.decode(encode_batch(events, ts=12.5), type=VllmBatch)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    stored, stored2, removed, cleared = batch.events
    assert isinstance(stored, VllmBlockStored) and isinstance(removed, VllmBlockRemoved)
    assert isinstance(cleared, VllmAllBlocksCleared)
    assert stored.block_hashes == events[0].block_hashes and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.medium == "GPU"
    assert stored2.parent_block_hash == events[1].parent_block_hash
    assert (stored2.lora_name, stored2.medium) == ("adapter-a", "CPU")
    assert removed.block_hashes == events[2].block_hashes and removed.medium == "GPU"


def test_the_default_layout_is_maps_that_the_legacy_decoder_refuses() -> None:
    payload = encode_batch(_events(), ts=1.0)
    assert isinstance(msgspec.msgpack.decode(payload), dict)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(payload, type=LegacyBatch)


def test_the_legacy_layout_decodes_with_vllms_array_schema() -> None:
    events = _events()
    payload = encode_batch(events, ts=3.0, layout="vllm-legacy")
    batch = msgspec.msgpack.decode(payload, type=LegacyBatch)
    assert [type(e).__name__ for e in batch.events] == [
        "LegacyBlockStored",
        "LegacyBlockStored",
        "LegacyBlockRemoved",
        "LegacyAllBlocksCleared",
    ]
    assert batch.events[0].token_ids == list(range(8)) and batch.events[1].lora_name == "adapter-a"
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(payload, type=VllmBatch)


def test_batches_are_numbered_from_zero() -> None:
    topic, seq, payload = batch_frames(0, b"x")
    assert (topic, int.from_bytes(seq, "big"), payload) == (b"", 0, b"x")
    assert int.from_bytes(batch_frames(7, b"")[1], "big") == 7


def test_an_unknown_layout_is_refused_by_name() -> None:
    assert check_layout("vllm-legacy") == "vllm-legacy"
    with pytest.raises(ValueError, match="vllm, vllm-legacy; got 'v2'"):
        check_layout("v2")
