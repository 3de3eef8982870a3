"""KV events are kept only when asked for (`kv_events`, as vLLM's
enable_kv_cache_events): an engine nobody takes events from makes none, so no list
grows with every block stored or moved, and a tier move builds no event objects; with
it on, the same traffic gives the events as before; a server that publishes events
needs an engine that keeps them."""

from __future__ import annotations

from pathlib import Path

import pytest

from reprise.blockpool.events import BlockRemoved, BlockStored
from reprise.blockpool.index import CacheIndex
from reprise.daemon.engine.config import EngineConfig, SettingError
from reprise.daemon.engine.engine import Engine
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.model.synth import synth_model
from reprise.daemon.serve.server import Server
from reprise.daemon.serve.settings import ServerConfig

BS = 16
ONE = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("events-opt-in") / "tiny")


def traffic(engine: Engine) -> int:
    """Three 5-block prompts through a 12-block pool with a host tier: the first is
    pushed to the host tier by the other two, then comes back (moves both ways).
    Returns the host hits of its return."""
    prompts = [[3 + i + 7 * j for i in range(5 * BS + 3)] for j in range(3)]
    for prompt in prompts:
        engine.generate(prompt, ONE)
    return engine.generate(prompts[0], ONE).host_cached_tokens


def engine_of(tiny: Path, **kwargs) -> Engine:
    return Engine.from_pretrained(
        tiny, backend="numpy", block_size=BS, num_device_blocks=12, num_host_blocks=32, **kwargs
    )


def test_off_by_default_no_event_is_made(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[object] = []
    original = CacheIndex._stored_event

    def counted(self: CacheIndex, block):  # type: ignore[no-untyped-def]
        made.append(block)
        return original(self, block)

    monkeypatch.setattr(CacheIndex, "_stored_event", counted)
    engine = engine_of(tiny)
    assert not engine.settings.kv_events and engine.events is None
    assert traffic(engine) > 0  # the moves this test is about happened
    assert made == [] and engine.take_events() == []

    kept = engine_of(tiny, kv_events=True)
    assert traffic(kept) > 0
    events = kept.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    # 4 prompts of 5 full blocks registered, each a BlockStored, and the moves between the
    # tiers a BlockStored and a BlockRemoved each: events were made and kept
    assert len(made) == len(stored) > 4 * 5
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    assert kept.take_events() == []  # taken once


def test_the_setting_is_a_bool(tiny: Path) -> None:
    with pytest.raises(SettingError, match="kv_events must be a bool") as info:
        EngineConfig(kv_events="yes")  # type: ignore[arg-type]
    assert info.value.flag == "--kv-events"


def test_a_server_that_publishes_events_needs_an_engine_that_keeps_them(
    tiny: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    config = ServerConfig(address=f"ipc://{folder}/d.sock", events_address=f"ipc://{folder}/e.sock")
    with pytest.raises(ValueError, match="kv_events=True"):
        Server(engine_of(tiny), config)
    Server(engine_of(tiny, kv_events=True), config)  # built, not bound: nothing to close
    Server(engine_of(tiny), ServerConfig(address=config.address))  # no events: no need
