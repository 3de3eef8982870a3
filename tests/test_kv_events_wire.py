"""KV events on the wire decode with a decoder written from vLLM's schema (issue 24).

The decoder below is vLLM's field list (`vllm/distributed/kv_events.py`: msgspec
structs, `tag=True`, `omit_defaults=True`) declared as msgspec structs, so a batch
that today's vLLM subscribers and KV-aware routers would refuse fails here too.
The legacy layout is checked against vLLM's older `array_like=True` structs.
Prompt-table blocks carry their extra ids in `extra_keys`, text blocks none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from reprise.blockpool.events import AllBlocksCleared, BlockRemoved, BlockStored
from reprise.cuda.dtypes import BF16
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.engine.prompt_table import row_extra_id
from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.synth import synth_model
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
    extra_keys: list[tuple[Any, ...] | None] | None = None
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
    extra_keys: list[tuple[Any, ...] | None] | None = None


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


BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("kvwire") / "tiny")


def _stored(engine: Engine, layout: str) -> list:
    payload = encode_batch(engine.take_events(), ts=0.0, layout=layout)  # type: ignore[arg-type]
    batch = msgspec.msgpack.decode(payload, type=VllmBatch if layout == "vllm" else LegacyBatch)
    return [e for e in batch.events if type(e).__name__.endswith("BlockStored")]


@pytest.mark.parametrize("layout", ["vllm", "vllm-legacy"])
def test_prompt_table_blocks_carry_their_extra_ids_and_text_blocks_none(tiny, layout) -> None:
    config = ModelConfig.from_dir(tiny)
    v = config.vocab_size
    rng = np.random.default_rng(5)
    table = rng.standard_normal((3, config.hidden_size)).astype(BF16)
    engine = Engine.from_pretrained(
        tiny, backend="numpy", block_size=BS, num_device_blocks=64, kv_events=True
    )
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.take_events()

    # Table rows then text: block 0 is all table rows, block 1 mixes, block 2 is text.
    prompt = [v, v + 1, v + 2, v, v + 1, 7, 8, 9, 1, 2, 3, 4, 5]
    engine.generate(prompt, params, prompt_table=table)
    derived = [row_extra_id(table[r]) for r in range(3)]
    extra = [derived[t - v] if t >= v else 0 for t in prompt]
    stored = _stored(engine, layout)
    assert [e.token_ids for e in stored] == [prompt[i : i + BS] for i in range(0, 12, BS)]
    assert [e.extra_keys for e in stored] == [[tuple(extra[0:4])], [tuple(extra[4:8])], None]

    # A text request: no extra keys on any block.
    engine.generate([11, 12, 13, 14, 15, 16, 17, 18, 19], params)
    stored = _stored(engine, layout)
    assert len(stored) == 2 and all(e.extra_keys is None for e in stored)

    # A salted prompt-table request: hashes only, neither token ids nor extra keys.
    engine.generate([v + 2, v, 40, 41, 42], params, prompt_table=table, cache_salt="tenant")
    stored = _stored(engine, layout)
    assert len(stored) == 1 and stored[0].token_ids == [] and stored[0].extra_keys is None


def test_an_event_without_extra_keys_leaves_the_field_out() -> None:
    h = bytes(32)
    text = msgspec.msgpack.decode(
        encode_batch([BlockStored([h], None, [1, 2, 3, 4], 4, None, "GPU")], ts=0.0)
    )
    assert "extra_keys" not in text["events"][0]
    table = BlockStored([h], None, [9, 9, 1, 2], 4, None, "GPU", extra_keys=[(7, 7, 0, 0)])
    wire = msgspec.msgpack.decode(encode_batch([table], ts=0.0))["events"][0]
    assert wire["extra_keys"] == [[7, 7, 0, 0]]
    legacy = msgspec.msgpack.decode(encode_batch([table], ts=0.0, layout="vllm-legacy"))
    assert legacy[1][0][-2:] == [None, [[7, 7, 0, 0]]]


class OldLegacyBlockStored(_Legacy, tag="BlockStored"):
    """vLLM's first array layout, before lora_name and extra_keys."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


def test_a_legacy_decoder_from_before_extra_keys_reads_what_it_knows() -> None:
    event = BlockStored([bytes(32)], None, [9, 9, 1, 2], 4, None, "GPU", extra_keys=[(7, 7, 0, 0)])
    payload = msgspec.msgpack.decode(encode_batch([event], ts=0.0, layout="vllm-legacy"))
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(payload[1][0]), type=OldLegacyBlockStored)
    assert old.token_ids == [9, 9, 1, 2] and old.block_size == 4


@pytest.mark.parametrize("layout", ["vllm", "vllm-legacy"])
def test_disk_events_decode_with_vllms_schema(tiny, layout, tmp_path: Path) -> None:
    """A disk tier's events (written blocks, prompt-table blocks with their extra ids, a
    restart's announcement) decode as vLLM's, medium "DISK"."""
    config = ModelConfig.from_dir(tiny)
    v = config.vocab_size
    table = np.random.default_rng(6).standard_normal((2, config.hidden_size)).astype(BF16)
    settings = dict(
        backend="numpy", block_size=BS, num_device_blocks=64, disk_cache=str(tmp_path),
        kv_events=True,
    )  # fmt: skip
    engine = Engine.from_pretrained(tiny, **settings)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = [v, v + 1, 7, 8, 1, 2, 3, 4, 5]
    engine.generate(prompt, params, prompt_table=table)
    while engine.has_work():
        engine.step()
    engine.close()
    written = [e for e in _stored(engine, layout) if e.medium == "DISK"]
    extra = [row_extra_id(table[0]), row_extra_id(table[1]), 0, 0]
    assert [e.token_ids for e in written] == [prompt[0:4], prompt[4:8]]
    assert [e.extra_keys for e in written] == [[tuple(extra)], None]

    again = Engine.from_pretrained(tiny, **settings)
    announced = _stored(again, layout)
    assert [(e.medium, e.token_ids, e.extra_keys) for e in announced] == [
        (e.medium, e.token_ids, e.extra_keys) for e in written
    ]
    again.close()
