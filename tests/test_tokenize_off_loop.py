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

from test_daemon import BLOCK_SIZE

from reprise.daemon import Engine
from reprise.daemon.model.synth import synth_model
from reprise.daemon.serve.server import Server, ServerConfig
from reprise.ipc import Client, Done, TokenChunk

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
