"""Prompts are tokenized off the engine loop (issue 19, F7): while one request's prompt
is stuck in the tokenizer, a stream already running keeps getting its tokens, and a
request that arrives after it is answered (the tokenizing threads are several). A
daemon in process, its tokenizing step held on an event: were prompts tokenized on the
loop, the stream would stop until that prompt's tokenizing is let go; were they
tokenized on one thread, the later request would wait behind it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from test_daemon import BLOCK_SIZE

from reprise.daemon import Engine
from reprise.daemon.model.synth import synth_model
from reprise.daemon.serve.server import Server, ServerConfig
from reprise.ipc import Client, Done, TokenChunk
from reprise.ipc.client import RequestError

STUCK = "this prompt's tokenizing is held"


def test_a_prompt_stuck_in_the_tokenizer_does_not_hold_the_loop(tmp_path: Path) -> None:
    model = synth_model("tiny", tmp_path / "tiny")
    engine = Engine.from_pretrained(model, backend="numpy", num_device_blocks=64,
                                    block_size=BLOCK_SIZE)  # fmt: skip
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    address = f"ipc://{folder}/d.sock"
    server = Server(engine, ServerConfig(address=address))
    entered, release = threading.Event(), threading.Event()
    tokenize = server.checks.prompt_ids

    def held(request):  # type: ignore[no-untyped-def]
        if request.prompt == STUCK:
            entered.set()
            release.wait(60)
        return tokenize(request)

    server.checks.prompt_ids = held  # type: ignore[method-assign]
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    stuck: list[Done] = []
    try:
        deadline = time.monotonic() + 60
        while not (folder / "d.sock").exists():
            assert time.monotonic() < deadline and serving.is_alive()
            time.sleep(0.05)

        def ask_stuck() -> None:
            with Client(address, timeout_s=60) as client:
                stuck.append(client.generate(STUCK, max_tokens=2, temperature=0))

        waiting = threading.Thread(target=ask_stuck, daemon=True)
        with Client(address, timeout_s=20) as client:
            chunks = client.stream([5, 6, 7, 8], max_tokens=64, temperature=0, ignore_eos=True)
            assert isinstance(next(chunks), TokenChunk)  # running
            waiting.start()
            assert entered.wait(30), "the held prompt never reached the tokenizer"
            got = 0
            for reply in chunks:  # each within the client's 20 s, or DaemonUnavailable
                assert isinstance(reply, TokenChunk), reply
                got += len(reply.token_ids)
                if got >= 16:
                    break
            chunks.close()
            later = client.generate("Arrived after the stuck one", max_tokens=2, temperature=0)
        assert later.finish_reason in ("length", "stop") and len(later.token_ids) >= 1
        assert got >= 16 and not release.is_set() and not stuck
        release.set()
        waiting.join(30)
        assert len(stuck) == 1 and stuck[0].finish_reason in ("length", "stop")
    finally:
        release.set()
        server.stop.set()
        serving.join(60)
    assert not serving.is_alive()


def test_the_admission_work_on_the_prompt_alone_is_done_off_the_loop(tmp_path: Path) -> None:
    """The engine's checks and block keys of a prompt (Engine.prepare_prompt) run on a
    tokenizing thread, the loop hands the engine the prepared prompt, and what it gets
    is what the prompt would: a repeat under the same salt is cached, one under another
    salt is not, and a prompt the engine refuses is refused with the usual reply."""
    model = synth_model("tiny", tmp_path / "tiny")
    engine = Engine.from_pretrained(model, backend="numpy", num_device_blocks=64,
                                    block_size=BLOCK_SIZE, max_model_len=256)  # fmt: skip
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    address = f"ipc://{folder}/d.sock"
    server = Server(engine, ServerConfig(address=address))
    prepared_on: list[str] = []
    given: list[type] = []
    prepare, add_choices = engine.prepare_prompt, engine.add_choices

    def recording_prepare(*args, **kwargs):  # type: ignore[no-untyped-def]
        prepared_on.append(threading.current_thread().name)
        return prepare(*args, **kwargs)

    def recording_add(prompt, *args, **kwargs):  # type: ignore[no-untyped-def]
        given.append(type(prompt))
        return add_choices(prompt, *args, **kwargs)

    engine.prepare_prompt = recording_prepare  # type: ignore[method-assign]
    engine.add_choices = recording_add  # type: ignore[method-assign]
    serving = threading.Thread(target=server.run, daemon=True, name="loop")
    serving.start()
    try:
        deadline = time.monotonic() + 60
        while not (folder / "d.sock").exists():
            assert time.monotonic() < deadline and serving.is_alive()
            time.sleep(0.05)
        ids = list(range(7, 7 + 3 * BLOCK_SIZE + 5))
        with Client(address, timeout_s=30) as client:
            first = client.generate(ids, max_tokens=2, temperature=0, cache_salt="a")
            again = client.generate(ids, max_tokens=2, temperature=0, cache_salt="a")
            other = client.generate(ids, max_tokens=2, temperature=0, cache_salt="b")
            text = client.generate("Some text to prepare", max_tokens=2, temperature=0)
            vocab = engine.config.vocab_size
            with pytest.raises(RequestError) as refused:  # a table id, with no table
                client.generate([5, vocab + 3], max_tokens=2, temperature=0)
        assert isinstance(first, Done) and isinstance(again, Done) and isinstance(other, Done)
        assert (first.cached_tokens, again.cached_tokens, other.cached_tokens) == (
            0, 3 * BLOCK_SIZE, 0,
        )  # fmt: skip
        assert again.token_ids == first.token_ids == other.token_ids
        assert isinstance(text, Done) and len(text.token_ids) >= 1
        assert refused.value.code == "bad_request" and "prompt_table" in str(refused.value)
        assert len(prepared_on) == 5 and all(n.startswith("tokenize") for n in prepared_on)
        # table ids pass the prompt's own checks: add_choices refuses it, on the loop
        assert [kind.__name__ for kind in given] == ["PreparedPrompt"] * 5
    finally:
        server.stop.set()
        serving.join(60)
    assert not serving.is_alive()
