"""A real `reprise serve` process on a real ipc:// socket (NumPy backend, default model),
driven through raw framed connections, the Client and the CLI."""

from __future__ import annotations

import itertools
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reprise.daemon.model.tokenizer import Tokenizer
from reprise.ipc import Client, DaemonUnavailable, Done, RequestError, TokenChunk
from reprise.ipc.codec import decode_reply
from reprise.ipc.framing import FrameDecoder, frame
from reprise.ipc.messages import ErrorReply, HealthReply, TokenizeReply
from reprise.ipc.sockets import socket_target

pytestmark = pytest.mark.model

BLOCK_SIZE = 16
# ~40 tokens: two full blocks of 16 that a repeat finds again.
LONG_PROMPT = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the old wooden "
    "fence near the river, and the farmer counts his sheep one by one before the rain."
)
REPRISE = str(Path(sys.executable).parent / "reprise")


class Daemon:
    """A `reprise serve` subprocess with a NOTIFY_SOCKET we read."""

    def __init__(self, tmp: Path, model_dir: Path, *extra: str) -> None:
        self.address = f"ipc://{tmp}/d.sock"
        self.events_address = f"ipc://{tmp}/ev.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp / "notify.sock"))
        self.notify.settimeout(0.5)
        self.log = (tmp / "serve.log").open("w+")
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(tmp / "notify.sock"),
            "WATCHDOG_USEC": "400000",
        }
        env.pop("REPRISE_SOCKET", None)
        cmd = [
            sys.executable, "-m", "reprise.cli.main", "serve",
            "--model", str(model_dir), "--backend", "numpy",
            "--socket", self.address, "--events", self.events_address,
            "--block-size", str(BLOCK_SIZE), "--num-device-blocks", "96",
            "--max-model-len", "256", "--max-tokens-cap", "64",
            *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.notices: list[str] = []
        self._reader = threading.Thread(target=self._read_notices, daemon=True)
        self._reader.start()
        self.wait_notice("READY=1", timeout_s=120)

    def _read_notices(self) -> None:
        while True:  # like systemd: read every notice as it comes
            try:
                self.notices.extend(self.notify.recv(4096).decode().split("\n"))
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_notice(self, state: str, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while state not in self.notices:
            if time.monotonic() > deadline or (state == "READY=1" and self.proc.poll() is not None):
                self.log.seek(0)
                raise AssertionError(f"no {state} from the daemon; log:\n{self.log.read()[-3000:]}")
            time.sleep(0.05)

    def client(self, timeout_s: float = 120) -> Client:
        return Client(self.address, timeout_s=timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.notify.close()
        self.log.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon"), default_model_dir, "--max-message-bytes", "65536")
    yield d
    d.stop()
    assert d.proc.returncode == 0


class Raw:
    """One connection to the daemon speaking its framing by hand, for what a Client
    would never send."""

    def __init__(self, address: str) -> None:
        family, target = socket_target(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.connect(target)
        self.decoder = FrameDecoder(1 << 30)
        self.frames: deque[bytes] = deque()
        self.closed = False  # the daemon closed the connection

    def send(self, payload: bytes) -> None:
        self.sock.sendall(frame(payload))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def poll(self, timeout_ms: int) -> bool:
        """Whether a frame (or the end of the connection) came within `timeout_ms`."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self.frames and not self.closed:
            remaining = deadline - time.monotonic()
            if remaining < 0 or not select.select([self.sock], [], [], remaining)[0]:
                return False
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                data = b""
            self.closed = not data
            self.frames.extend(self.decoder.feed(data))  # type: ignore[arg-type]
        return True

    def recv_payload(self, timeout_s: float = 60) -> bytes:
        assert self.poll(int(timeout_s * 1000)), "no reply from the daemon"
        assert self.frames, "the daemon closed the connection"
        return self.frames.popleft()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def raw(daemon: Daemon) -> Iterator[Raw]:
    conn = Raw(daemon.address)
    yield conn
    conn.close()


def recv(conn: Raw, timeout_s: float = 60) -> object:
    return decode_reply(conn.recv_payload(timeout_s))


def wait_idle(client: Client, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats(check=True)
        if stats["num_requests"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_repeat_prompt_is_cached_and_events_agree(daemon: Daemon) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.events_address)
    time.sleep(0.3)  # the slow-joiner window of PUB/SUB
    with daemon.client() as client:
        before = client.stats()
        first = client.generate(LONG_PROMPT, max_tokens=2, temperature=0, cache_salt="events")
        second = client.generate(LONG_PROMPT, max_tokens=2, temperature=0, cache_salt="events")
        after = wait_idle(client)
    assert first.prompt_tokens == second.prompt_tokens >= 2 * BLOCK_SIZE + 1
    assert first.cached_tokens == 0
    assert second.cached_tokens == (second.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.token_ids == first.token_ids
    reused = after["reused_blocks"] - before["reused_blocks"]
    assert reused == second.cached_tokens // BLOCK_SIZE
    assert after["used_blocks"] == 0 and after["integrity"] == "ok"

    # Mirror the pool's device index from the events; it must match the cached_blocks gauge.
    findable: set[bytes] = set()
    seqs = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        seqs.append(int.from_bytes(seq, "big"))
        batch = msgpack.unpackb(payload)  # vLLM's current layout: maps tagged by "type"
        assert isinstance(batch["ts"], float)
        for event in batch["events"]:
            if event["type"] == "BlockStored" and event["medium"] == "GPU":
                assert event["block_size"] == BLOCK_SIZE
                assert event["token_ids"] == []  # a salted request's events carry hashes only
                findable.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved" and event["medium"] == "GPU":
                findable.difference_update(event["block_hashes"])
            elif event["type"] == "AllBlocksCleared":
                findable.clear()
    sub.close()
    ctx.term()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert len(findable) == after["cached_blocks"] > 0


def test_exact_repeat_serves_every_prompt_token_from_the_cache(daemon: Daemon) -> None:
    """A prompt of two full blocks sent again: every token cached, the first token from
    the stored logits row (test_exact_repeat.py has the bit-identity checks)."""
    prompt = list(range(1000, 1000 + 2 * BLOCK_SIZE))
    with daemon.client() as client:
        first = client.generate(prompt, max_tokens=2, temperature=0, cache_salt="exact")
        before = wait_idle(client)
        second = client.generate(prompt, max_tokens=2, temperature=0, cache_salt="exact")
        after = wait_idle(client)
    assert first.cached_tokens == 0
    assert second.cached_tokens == second.prompt_tokens == len(prompt)
    assert second.token_ids == first.token_ids
    assert after["exact_repeats"] == before["exact_repeats"] + 1
    assert after["prefill_tokens_computed"] == before["prefill_tokens_computed"]
    assert after["logits_cache_entries"] >= 1


def test_sockets_are_private_to_the_user(daemon: Daemon) -> None:
    for address in (daemon.address, daemon.events_address):
        path = Path(address.removeprefix("ipc://"))
        assert path.is_socket() and path.stat().st_mode & 0o777 == 0o600, oct(path.stat().st_mode)


def test_two_salts_share_nothing(daemon: Daemon) -> None:
    with daemon.client() as client:
        client.generate(LONG_PROMPT, max_tokens=1, temperature=0, cache_salt="tenant-a")
        again = client.generate(LONG_PROMPT, max_tokens=1, temperature=0, cache_salt="tenant-a")
        other = client.generate(LONG_PROMPT, max_tokens=1, temperature=0, cache_salt="tenant-b")
    assert again.cached_tokens > 0
    assert other.cached_tokens == 0


def test_stream_yields_chunks_then_done(daemon: Daemon) -> None:
    with daemon.client() as client:
        items = list(client.stream("Hello", max_tokens=4, temperature=0, return_logits=True))
    chunks, done = items[:-1], items[-1]
    assert isinstance(done, Done) and all(isinstance(c, TokenChunk) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert "".join(c.text for c in chunks) == done.text
    assert done.logits is not None and done.logits["shape"][0] == len(done.token_ids)


def test_n_choices_stream_apart_by_index_and_share_the_prefill(daemon: Daemon) -> None:
    kw = {"max_tokens": 4, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    with daemon.client() as client:
        items = list(client.stream(LONG_PROMPT, n=3, cache_salt="choices", **kw))
        dones = client.generate(LONG_PROMPT, n=3, cache_salt="choices-again", **kw)
        alone = client.generate(LONG_PROMPT, cache_salt="choices-alone", **{**kw, "seed": 7})
        stats = wait_idle(client)
    assert isinstance(items[-1], Done)
    streamed = {item.index: item for item in items if isinstance(item, Done)}
    assert sorted(streamed) == [0, 1, 2]
    for index, done in streamed.items():
        chunks = [c for c in items if isinstance(c, TokenChunk) and c.index == index]
        assert [t for c in chunks for t in c.token_ids] == done.token_ids
        assert "".join(c.text for c in chunks) == done.text
    full = (streamed[0].prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert [streamed[i].cached_tokens for i in range(3)] == [0, full, full]  # one prefill
    assert isinstance(dones, list) and [d.index for d in dones] == [0, 1, 2]
    assert [d.token_ids for d in dones] == [streamed[i].token_ids for i in range(3)]
    assert alone.token_ids == streamed[2].token_ids  # choice 2 draws with seed 5 + 2
    assert len({tuple(d.token_ids) for d in dones}) > 1
    assert stats["used_blocks"] == 0 and stats["integrity"] == "ok"


def test_cancel_ends_every_choice_and_frees_their_blocks(daemon: Daemon) -> None:
    conn = Raw(daemon.address)
    try:
        conn.send(msgpack.packb({"v": 1, "type": "generate", "id": "many", "prompt": LONG_PROMPT,
                                 "sampling": {"max_tokens": 64, "ignore_eos": True, "n": 3}}))  # fmt: skip
        assert isinstance(recv(conn), TokenChunk)
        conn.send(msgpack.packb({"v": 1, "type": "cancel", "id": "many"}))
        dones: list[Done] = []
        while len(dones) < 3:
            reply = recv(conn)
            assert isinstance(reply, TokenChunk | Done), reply
            if isinstance(reply, Done):
                dones.append(reply)
    finally:
        conn.close()
    assert sorted(d.index for d in dones) == [0, 1, 2]
    assert {d.finish_reason for d in dones} == {"cancelled"}
    with daemon.client() as client:
        stats = wait_idle(client)
    assert stats["used_blocks"] == 0 and stats["integrity"] == "ok"


def test_cli_generate_n_prints_every_choice(daemon: Daemon) -> None:
    import json

    cmd = [REPRISE, "generate", "Hello", "--max-tokens", "3", "--temperature", "1",
           "--seed", "4", "-n", "2", "--socket", daemon.address]  # fmt: skip
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120, check=True)
    choices = json.loads(out.stdout)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(len(c["token_ids"]) <= 3 and c["text"] for c in choices)
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert text.stdout == "".join(c["text"] + "\n" for c in choices)  # seeded: the same again
    assert text.stderr.count("[choice ") == 2


def _bad_inputs() -> list[tuple[bytes, str]]:
    def pack(**body: object) -> bytes:
        return msgpack.packb(body, use_bin_type=True)

    gen = {"v": 1, "type": "generate", "id": "g"}
    return [
        (os.urandom(64), "bad_message"),
        (pack(v=1, type="health")[:-2], "bad_message"),
        (pack(**gen, prompt=["not", "ids"]), "bad_request"),
        (pack(v=1, type="teleport"), "unknown_type"),
        (pack(v=99, type="health"), "unsupported_version"),
        (pack(v=1, type="generate", prompt="x"), "bad_request"),
        (pack(**gen, prompt="x", sampling={"temperature": -1}), "bad_request"),
        (pack(**gen, prompt="x", sampling={"top_p": 0}), "bad_request"),
        (pack(**gen, prompt="x", sampling={"max_tokens": 10_000}), "bad_request"),
        (pack(**gen, token_ids=[10**9]), "bad_request"),
        (pack(**gen, prompt="x" * 100_000), "too_large"),
        (pack(**gen, token_ids=[1] * 300), "prompt_too_long"),
        (pack(v=1, type="cancel", id="nobody"), "not_found"),
        (pack(**gen, prompt="x", queue_priority="high"), "bad_request"),
        (pack(**gen, prompt="x", queue_priority=2**40), "bad_request"),
        # structured outputs: a spec of the wrong shape, and one that does not compile
        # (refused on a tokenizing thread, where the daemon compiles it)
        (pack(**gen, prompt="x", sampling={"structured": ["regex"]}), "bad_request"),
        (pack(**gen, prompt="x", sampling={"structured": ["regex", "[a-"]}), "bad_request"),
        (pack(**gen, prompt="x", sampling={"structured": ["json", '{"type": 5}']}), "bad_request"),
    ]


# ids by index, not by the bytes: the first input is fresh random bytes each run, and test
# workers (pytest-xdist) must collect the same ids
@pytest.mark.parametrize(
    ("data", "code"), _bad_inputs(), ids=[f"{i}-{code}" for i, (_, code) in enumerate(_bad_inputs())]
)
def test_bad_input_gets_an_error_and_the_daemon_serves_on(
    daemon: Daemon, raw: Raw, data: bytes, code: str
) -> None:
    raw.send(data)
    reply = recv(raw)
    assert isinstance(reply, ErrorReply), reply
    assert reply.code == code, reply
    with daemon.client() as client:
        assert client.generate("Hi", max_tokens=1).finish_reason == "length"


def test_frames_past_the_size_limits(daemon: Daemon) -> None:
    # Over max_message_bytes: dropped unread as it arrives, answered, the connection
    # serves on; a length past the hard ceiling (4x) cannot be skipped: one error, closed.
    conn = Raw(daemon.address)
    conn.send(b"x" * 100_000)
    reply = recv(conn)
    assert isinstance(reply, ErrorReply) and reply.code == "too_large", reply
    assert "(max_message_bytes)" in reply.message  # the error names its setting
    conn.send(b"")  # an empty frame is an empty message
    reply = recv(conn)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_message", reply
    conn.send(msgpack.packb({"v": 1, "type": "health"}))
    assert isinstance(recv(conn), HealthReply)
    conn.send_bytes((1 << 31).to_bytes(4, "big"))
    reply = recv(conn)
    assert isinstance(reply, ErrorReply) and reply.code == "too_large", reply
    assert conn.poll(10_000) and conn.closed and not conn.frames
    conn.close()
    with daemon.client() as client:
        assert client.health().status == "ok"


_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=50_000), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(-(2**31), 2**31), max_size=2),
)
_fields = ["id", "prompt", "messages", "token_ids", "sampling", "cache_salt", "priority",
           "queue_priority", "stream", "return_logits", "check", "bogus"]  # fmt: skip
_sampling = st.dictionaries(
    st.sampled_from(
        ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "x"]
    ),
    _junk,
    max_size=3,
)
_message = st.fixed_dictionaries(
    {
        "v": st.one_of(st.just(1), _junk),
        "type": st.one_of(st.sampled_from(["generate", "cancel", "stats", "health"]), _junk),
    },
    optional={
        "id": st.one_of(st.text(min_size=1, max_size=6), _junk),
        "prompt": st.one_of(st.text(max_size=12), _junk),
        "token_ids": st.one_of(st.lists(st.integers(0, 49_000), max_size=6), _junk),
        "sampling": st.one_of(_sampling, _junk),
        **{f: _junk for f in _fields[4:]},
    },
)
_payload = st.one_of(
    st.binary(max_size=64),
    _message.map(lambda m: msgpack.packb(m, use_bin_type=True)),
    _message.map(lambda m: msgpack.packb(m, use_bin_type=True)[:-1]),
)


@settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=_payload)
def test_fuzz_never_breaks_the_daemon(daemon: Daemon, raw: Raw, payload: bytes) -> None:
    raw.send(payload)
    try:  # a valid generate would run: stop it at once
        body = msgpack.unpackb(payload)
        if isinstance(body, dict) and isinstance(body.get("id"), str):
            raw.send(msgpack.packb({"v": 1, "type": "cancel", "id": body["id"]}))
    except Exception:
        pass
    raw.send(msgpack.packb({"v": 1, "type": "health"}))
    while True:  # every reply decodes, none is "internal", and the health probe answers
        reply = recv(raw)
        assert not (isinstance(reply, ErrorReply) and reply.code == "internal"), reply
        if isinstance(reply, HealthReply):
            break


def test_after_fuzz_the_pool_is_clean(daemon: Daemon) -> None:
    with daemon.client() as client:
        stats = wait_idle(client)
    assert stats["used_blocks"] == 0
    assert stats["integrity"] == "ok"


@pytest.mark.parametrize("n", [1, 3])
def test_client_vanishing_mid_stream_cancels_its_request(daemon: Daemon, n: int) -> None:
    with daemon.client() as observer:
        before = observer.stats()["num_disconnect_cancels"]
        conn = Raw(daemon.address)
        conn.send(msgpack.packb({"v": 1, "type": "generate", "id": "gone", "prompt": LONG_PROMPT,
                                 "sampling": {"max_tokens": 64, "ignore_eos": True, "n": n}}))  # fmt: skip
        assert isinstance(recv(conn), TokenChunk)
        conn.close()
        stats = wait_idle(observer)
    assert stats["num_disconnect_cancels"] == before + 1
    assert stats["num_requests"] == 0 and stats["used_blocks"] == 0


def test_32_concurrent_clients_each_get_one_answer(daemon: Daemon) -> None:
    results: dict[tuple[int, int], list[object]] = {}

    def work(i: int) -> None:
        with daemon.client() as client:
            for j in range(2):
                try:
                    out: object = client.generate(f"Count to {i} and {j}:", max_tokens=2)
                except RequestError as e:
                    out = e
                results.setdefault((i, j), []).append(out)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 64
    assert all(len(v) == 1 for v in results.values())
    assert all(isinstance(v[0], Done) for v in results.values())


def test_tokenize_gives_the_ids_a_generate_would_and_detokenize_their_text(
    daemon: Daemon, default_model_dir: Path
) -> None:
    """Tokenize answers the ids a generate of the same prompt uses (text, and chat
    messages through the template: the same count as the generate's prompt_tokens),
    detokenize their text; bad ids get bad_request, and on one connection a tokenize's
    reply comes under its own id beside a stream's."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with daemon.client() as client:
        ids = client.tokenize(LONG_PROMPT)
        chat_ids = client.tokenize(messages)
        assert ids == tokenizer.encode(LONG_PROMPT)
        assert client.generate(LONG_PROMPT, max_tokens=1).prompt_tokens == len(ids)
        assert client.generate(messages, max_tokens=1).prompt_tokens == len(chat_ids)
        assert client.detokenize(ids) == LONG_PROMPT
        assert client.detokenize(chat_ids) == tokenizer.decode(chat_ids)
        assert "<|im_start|>" not in client.detokenize(chat_ids, skip_special_tokens=True)
        assert client.detokenize([]) == "" and client.tokenize("") == []
        for bad in ([-1], [5, 10**9]):
            with pytest.raises(RequestError, match=r"token_ids must be in \[0, 49152\)") as info:
                client.detokenize(bad)
            assert info.value.code == "bad_request"
        assert client.health().status == "ok"
    raw = Raw(daemon.address)  # a connection of its own: no other test's replies on it
    raw.send(msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt": "Hello",
                            "sampling": {"max_tokens": 3}, "stream": True}))  # fmt: skip
    raw.send(msgpack.packb({"v": 1, "type": "tokenize", "id": "t", "prompt": "Hello"}))
    replies: list[object] = []
    while not (any(isinstance(r, Done) for r in replies)
               and any(isinstance(r, TokenizeReply) for r in replies)):  # fmt: skip
        replies.append(recv(raw))
    raw.close()
    tokenized = [r for r in replies if isinstance(r, TokenizeReply)]
    assert len(tokenized) == 1 and tokenized[0].id == "t"
    assert tokenized[0].token_ids == tokenizer.encode("Hello")
    assert all(getattr(r, "id", None) == "g" for r in replies if r is not tokenized[0])


def test_cli_generate_json(daemon: Daemon) -> None:
    import json

    out = subprocess.run(
        [REPRISE, "generate", "Hello", "--max-tokens", "3", "--json", "--socket", daemon.address],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert set(result) >= {
        "text",
        "token_ids",
        "prompt_tokens",
        "cached_tokens",
        "ttft_ms",
        "finish_reason",
    }
    assert len(result["token_ids"]) <= 3
    stats = subprocess.run(
        [REPRISE, "stats", "--json"], env={**os.environ, "REPRISE_SOCKET": daemon.address},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "used_blocks" in json.loads(stats.stdout)


def test_cli_chat_turns_reuse_the_conversation(daemon: Daemon) -> None:
    """`reprise chat` on stdin: each turn resends the conversation, whose earlier
    turns are found in the cache."""
    out = subprocess.run(
        [REPRISE, "chat", "--socket", daemon.address, "--max-tokens", "6", "--salt", "chat",
         "--system", "You are terse. " * 4],
        input="Name a colour.\nName another one.\nAnd a third.\n\n",
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cached = [
        (int(c), int(p)) for c, p in re.findall(r"reused (\d+) of (\d+) prompt tokens", out.stderr)
    ]
    assert len(cached) == 3, out.stderr
    assert cached[0][0] == 0
    for (_, before), (now, total) in itertools.pairwise(cached):
        # the last turn's prompt is this one's prefix: its full blocks are found again
        assert total > before and now >= (before // BLOCK_SIZE - 1) * BLOCK_SIZE and now > 0
    assert out.stdout.count("you> ") >= 3


def test_cli_without_a_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/none.sock"
    for args in (["stats"], ["generate", "hi"]):
        out = subprocess.run(
            [REPRISE, *args, "--socket", address], capture_output=True, text=True, timeout=60
        )
        assert out.returncode != 0
        assert address in out.stderr and "reprise serve" in out.stderr
    with pytest.raises(DaemonUnavailable, match="reprise serve"), Client(address) as client:
        client.health()


def test_sigterm_drains_and_exits_zero(tmp_path: Path, default_model_dir: Path) -> None:
    # --cuda-graphs on NumPy: the padded decode steps, their "graphs" captured at start-up
    d = Daemon(tmp_path, default_model_dir, "--max-queue", "2", "--drain-timeout", "4",
               "--cuda-graphs")  # fmt: skip
    try:
        d.wait_notice("WATCHDOG=1", timeout_s=5)
        d.log.seek(0)
        started = d.log.read()
        assert "backend numpy; KV pool of" in started
        assert "decode graphs captured for batch sizes 1,2 in" in started  # up to --max-queue
        sock = Raw(d.address)
        # r0 runs two choices, which fill --max-queue 2: r1 is refused
        for i, n in enumerate((2, 1)):
            sock.send(msgpack.packb({"v": 1, "type": "generate", "id": f"r{i}", "prompt": "Tell me a story",
                                     "stream": False, "sampling": {"max_tokens": 64, "ignore_eos": True, "n": n}}))  # fmt: skip
        busy = recv(sock)
        assert isinstance(busy, ErrorReply) and (busy.code, busy.id) == ("busy", "r1")
        assert "max_queue" in busy.message
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        d.wait_notice("STOPPING=1")
        sock.send(msgpack.packb({"v": 1, "type": "generate", "id": "late", "prompt": "x"}))
        finals = []
        try:
            while not sock.closed:  # every reply until the daemon hangs up
                if sock.poll(60_000) and sock.frames:
                    finals.append(decode_reply(sock.frames.popleft()))
                elif not sock.closed:
                    raise AssertionError("no reply within 60 s")
        except AssertionError:
            d.proc.send_signal(signal.SIGUSR1)  # the daemon dumps its stacks into the log
            time.sleep(1)
            d.log.seek(0)
            raise AssertionError(
                f"no final replies; daemon exit code {d.proc.poll()}; log:\n{d.log.read()[-4000:]}"
            ) from None
        late = [f for f in finals if f.id == "late"]
        assert len(late) == 1 and isinstance(late[0], ErrorReply)
        assert late[0].code == "shutting_down"
        # r0 ends once: both choices' Dones, or an error (after any choice that finished)
        r0 = [f for f in finals if f.id == "r0"]
        errors = [f for f in r0 if isinstance(f, ErrorReply)]
        if errors:
            assert r0[-1] is errors[0] and len(errors) == 1 and len(r0) <= 2, r0
            assert errors[0].code == "shutting_down"
        else:
            assert sorted(f.index for f in r0) == [0, 1], r0
        assert len(finals) == len(late) + len(r0)
        assert d.proc.wait(timeout=30) == 0
        sock.close()
    finally:
        d.stop()
