"""Issue 19's findings against a real `reprise serve` (a tiny synthetic model, NumPy):
each test fails on the daemon as it was before the fix it names."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from test_daemon import Daemon, Raw, recv, wait_idle

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.synth import synth_model
from reprise.daemon.serve.drain import Drain, next_step_kind
from reprise.ipc import Client, DaemonUnavailable, RequestError
from reprise.ipc.codec import encode
from reprise.ipc.framing import frame
from reprise.ipc.messages import (
    Cancel,
    Done,
    ErrorReply,
    Generate,
    Health,
    HealthReply,
    TokenChunk,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("trust") / "tiny")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("trustd"), tiny, "--max-message-bytes", str(2 << 20),
               "--max-logits-bytes", str(1 << 14))  # fmt: skip
    yield d
    d.stop()
    assert d.proc.returncode == 0


def dealer(address: str, routing_id: bytes | None) -> zmq.Socket:
    """What an attacker would use against a ZeroMQ ROUTER: a DEALER choosing its id
    (None: one that lets the ROUTER choose, as a plain DEALER client did)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(address)
    return sock


def libzmq_ids(count: int) -> list[bytes]:
    """The routing ids a libzmq ROUTER gives its first peers (0, then a counter seeded
    with 0x6b8b4567): the ids F1 claimed."""
    return [b"\0" + (0x6B8B4567 + k).to_bytes(4, "big") for k in range(count)]


def test_f1_peers_claiming_libzmq_ids_cannot_crash_the_daemon(daemon: Daemon) -> None:
    """A client setting the id the daemon's ROUTER would assign next aborted it inside
    libzmq (exit 134). Connections now have no client-chosen id: such a peer is a
    malformed connection, closed, and the daemon serves on."""
    with daemon.client() as client:
        before = client.stats()["num_requests_total"]
        attackers = [dealer(daemon.address, rid) for rid in libzmq_ids(8)]
        time.sleep(0.2)
        attackers.append(dealer(daemon.address, None))  # the ROUTER gave it a claimed id
        for sock in attackers:
            # NOTE: a DEALER's send blocks while it has no peer, and the daemon may
            # already have closed the connection: try, never wait.
            with contextlib.suppress(zmq.Again):
                sock.send(
                    encode(Generate(id="f1", token_ids=[1, 2], sampling={"max_tokens": 1})),
                    zmq.NOBLOCK,
                )
        with daemon.client() as late:  # connects after them, as the victim did
            # ignore_eos: the point is that it is served, not where a sampled text ends
            done = late.generate([1, 2, 3], max_tokens=2, ignore_eos=True)
            assert done.finish_reason == "length"
        time.sleep(0.5)
        assert not any(sock.poll(100) for sock in attackers)  # never a reply
        for sock in attackers:
            sock.close()
        assert daemon.proc.poll() is None
        stats = client.stats(check=True)
    assert stats["num_requests_total"] == before + 1  # only `late`'s generate ran
    assert stats["integrity"] == "ok"


def test_f2_a_connection_never_receives_another_connections_replies(daemon: Daemon) -> None:
    """While a victim streams a salted request, attackers claim the ids libzmq would
    have given it, and another connection reuses its request id (the only id left on
    the wire) to generate and to cancel: the victim gets all its tokens and its Done,
    the attackers only their own replies, and no block leaks."""
    with daemon.client() as reference:
        expected = reference.generate([5, 6, 7], max_tokens=24, temperature=0, ignore_eos=True)
    request = Generate(id="victim", token_ids=[5, 6, 7], cache_salt="secret", stream=True,
                       sampling={"max_tokens": 24, "temperature": 0, "ignore_eos": True})  # fmt: skip
    victim = Raw(daemon.address)
    victim.send(encode(request))
    first = recv(victim)
    assert isinstance(first, TokenChunk) and first.id == "victim"
    attackers = [dealer(daemon.address, rid) for rid in libzmq_ids(4)]
    thief = Raw(daemon.address)
    thief.send(encode(Cancel(id="victim")))
    thief.send(encode(Generate(id="victim", token_ids=[9, 9], sampling={"max_tokens": 2},
                               stream=False)))  # fmt: skip
    stolen = [recv(thief), recv(thief)]
    assert isinstance(stolen[0], ErrorReply) and stolen[0].code == "not_found", stolen
    assert isinstance(stolen[1], Done) and stolen[1].token_ids != expected.token_ids[:2]
    replies = [first]
    while not isinstance(replies[-1], Done):
        replies.append(recv(victim))
    done = replies[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert done.token_ids == expected.token_ids
    assert [t for r in replies[:-1] for t in r.token_ids] == expected.token_ids
    assert not thief.poll(300) and not any(sock.poll(10) for sock in attackers)
    for sock in attackers:
        sock.close()
    victim.close()
    thief.close()
    with daemon.client() as client:
        stats = wait_idle(client)
    assert stats["used_blocks"] == 0 and stats["integrity"] == "ok"


def test_f5_a_burst_of_bad_frames_is_answered_one_by_one(daemon: Daemon) -> None:
    """ZeroMQ kept and echoed every extra frame of a message (1.3 GB). Now a message is
    one length-prefixed frame: 200 bad frames and a request in one write get 200 errors
    and a Done; a frame claiming 4 GiB is refused from its length, nothing buffered."""
    conn = Raw(daemon.address)
    request = encode(Generate(id="f5", token_ids=[1, 2], sampling={"max_tokens": 1}, stream=False))
    conn.send_bytes(b"".join(frame(b"x" * 1024) for _ in range(200)) + frame(request))
    replies = [recv(conn, timeout_s=30) for _ in range(201)]
    assert all(isinstance(r, ErrorReply) and r.code == "bad_message" for r in replies[:200])
    assert isinstance(replies[200], Done)
    conn.send_bytes(b"\xff\xff\xff\xff")
    reply = recv(conn)
    assert isinstance(reply, ErrorReply) and reply.code == "too_large", reply
    assert conn.poll(10_000) and conn.closed
    conn.close()


def test_f3_connections_past_the_limit_are_refused_and_the_others_served(
    tmp_path: Path, tiny: Path
) -> None:
    """Past 1,024 connections the daemon aborted ("Too many open files"). With
    --max-connections 4: a fifth gets one `busy` error and is closed at once, the four
    are still served, and a connection freed makes room for a new one."""
    d = Daemon(tmp_path, tiny, "--max-connections", "4")
    try:
        held = [Raw(d.address) for _ in range(4)]
        for conn in held:  # each is accepted and served
            conn.send(encode(Health()))
            assert isinstance(recv(conn), HealthReply)
        refused = [Raw(d.address) for _ in range(3)]
        for conn in refused:
            reply = recv(conn)
            assert isinstance(reply, ErrorReply) and reply.code == "busy", reply
            assert "max_connections" in reply.message
            assert conn.poll(5_000) and conn.closed
            conn.close()
        for conn in held:
            conn.send(encode(Generate(id="g", token_ids=[1, 2], sampling={"max_tokens": 2},
                                      stream=False)))  # fmt: skip
            assert isinstance(recv(conn), Done)
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the daemon notices the close on its next turn
            with d.client() as client:
                try:
                    stats = client.stats()
                    break
                except (RequestError, DaemonUnavailable):  # still full: busy, or closed
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
        assert stats["num_connections_refused"] >= 3 and stats["num_connections"] == 4
        for conn in held:
            conn.close()
    finally:
        d.stop()
    assert d.proc.returncode == 0


def test_f6_returned_logits_are_bounded(daemon: Daemon) -> None:
    with daemon.client() as client:
        with pytest.raises(RequestError, match="max_logits_bytes") as e:
            client.generate([1, 2, 3], max_tokens=64, return_logits=True)
        assert e.value.code == "bad_request"
        vocab = client.health().vocab_size
        done = client.generate([1, 2, 3], max_tokens=(1 << 14) // (4 * vocab), return_logits=True)
        assert done.logits is not None


def test_f7_a_prompt_too_big_for_the_context_is_refused_before_tokenizing(daemon: Daemon) -> None:
    with daemon.client(timeout_s=60) as client:
        start = time.perf_counter()
        with pytest.raises(RequestError, match="bytes of text") as e:
            client.generate("a " * (1 << 19), max_tokens=1)  # 1 MiB of text
        refused_s = time.perf_counter() - start
        assert e.value.code == "prompt_too_long"
        start = time.perf_counter()
        client.generate("hello", max_tokens=1)
        served_s = time.perf_counter() - start
    # tokenizing 1 MiB takes most of a second here; the check reads its length only
    assert refused_s < 0.5 + 5 * served_s, (refused_s, served_s)


def test_stop_strings_are_bounded_in_count_and_length(daemon: Daemon) -> None:
    with daemon.client() as client:
        with pytest.raises(RequestError, match="max_stop_strings"):
            client.generate("hi", max_tokens=1, stop=[f"s{i}" for i in range(17)])
        with pytest.raises(RequestError, match="max_stop_chars"):
            client.generate("hi", max_tokens=1, stop=["x" * 257])
        assert client.generate("hi", max_tokens=1, stop=["x" * 256] * 16).finish_reason


def test_stop_string_bounds_are_settings(tmp_path: Path, tiny: Path) -> None:
    """--max-stop-strings and --max-stop-chars set the bounds, and the refusal names them."""
    d = Daemon(tmp_path, tiny, "--max-stop-strings", "2", "--max-stop-chars", "8")
    try:
        with d.client() as client:
            with pytest.raises(RequestError, match=r"stop: at most 2 stop strings \(max_stop_strings\)"):
                client.generate("hi", max_tokens=1, stop=["a", "b", "c"])
            with pytest.raises(RequestError, match=r"8 characters \(max_stop_chars\)"):
                client.generate("hi", max_tokens=1, stop=["x" * 9])
            assert client.generate("hi", max_tokens=1, stop=["x" * 8] * 2).finish_reason
    finally:
        d.stop()
    assert d.proc.returncode == 0


def serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    """`reprise serve` with a model folder that does not exist: a refusal that names the
    socket came before any model was loaded."""
    return subprocess.run(
        [sys.executable, "-m", "reprise.cli.main", "serve", "--model", "/nonexistent/model",
         "--backend", "numpy", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    return lines[-1]


def test_f4_a_socket_folder_others_can_enter_is_refused_before_loading(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o700)
    loose.chmod(0o777)
    line = one_line(serve_fails("--socket", f"ipc://{loose}/r.sock"))
    assert str(loose) in line and "chmod 700" in line and "777" in line
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    line = one_line(serve_fails("--socket", f"ipc://{private}/r.sock"))
    assert "nonexistent" in line  # the socket was fine: it got as far as the model


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a folder to another user")
def test_f4_a_socket_folder_another_user_owns_is_refused_before_loading(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    line = one_line(serve_fails("--socket", f"ipc://{theirs}/r.sock"))
    assert str(theirs) in line and "uid 65534" in line


def test_a_busy_socket_is_refused_before_loading(daemon: Daemon) -> None:
    line = one_line(serve_fails("--socket", daemon.address))
    assert "already listening" in line


def test_abstract_sockets_are_refused_before_loading() -> None:
    line = one_line(serve_fails("--socket", "ipc://@reprise-test"))
    assert "abstract" in line and "ipc:///PATH" in line


def test_ipv6_loopback_serves_and_every_socket_file_goes_on_exit(
    tmp_path: Path, tiny: Path
) -> None:
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        port = probe.getsockname()[1]
    d = Daemon(tmp_path, tiny)  # ipc:// with a KV events socket beside it
    events = Path(d.events_address.removeprefix("ipc://"))
    try:
        address = f"tcp://[::1]:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(tiny),
             "--backend", "numpy", "--socket", address, "--max-model-len", "256"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            with Client(address, timeout_s=120) as client:
                deadline = time.monotonic() + 120
                while True:  # a Client does not wait for a daemon that is not listening yet
                    try:
                        client.health()
                        break
                    except DaemonUnavailable:
                        assert proc.poll() is None and time.monotonic() < deadline
                        time.sleep(0.2)
                assert client.generate("hi", max_tokens=2, temperature=0).finish_reason
        finally:
            proc.terminate()
            assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
        assert events.exists()
    finally:
        d.stop()
    assert d.proc.returncode == 0
    assert not Path(d.address.removeprefix("ipc://")).exists() and not events.exists()


def test_f3_the_daemon_raises_its_open_file_limit_to_the_hard_limit() -> None:
    """Each connection holds a descriptor: serve raises its soft limit to the hard one
    (the unit sets LimitNOFILE=65536), not the 1,024 a shell may start it with."""
    code = (
        "import resource as r; from reprise.daemon.serve.service import raise_fd_limit; "
        "hard = r.getrlimit(r.RLIMIT_NOFILE)[1]; r.setrlimit(r.RLIMIT_NOFILE, (64, hard)); "
        "print(raise_fd_limit(), *r.getrlimit(r.RLIMIT_NOFILE))"
    )
    now, soft, hard = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert now == soft == hard and int(soft) > 64
    unit = (Path(__file__).resolve().parents[1] / "packaging/systemd/reprise.service").read_text()
    assert "LimitNOFILE=65536" in unit and "ProtectHome=read-only" in unit


@pytest.mark.model
def test_f8_sigterm_during_a_long_prefill_exits_0_within_10_s(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """The default model on NumPy, a 2,000-token prompt in the middle of its prefill:
    SIGTERM gives the request a final reply and exits 0 within 10 s (issue 19, F8). Its
    prefill cannot finish within the drain (--drain-timeout, 5 s by default), so it is
    cancelled as soon as the step in progress ends; when that step itself runs past the
    deadline (a 256-token step took 18 s at a load of 8 on 2 cores), the drain's thread
    answers and exits without it (daemon/serve/drain.py). Every socket file is gone."""
    d = Daemon(tmp_path, default_model_dir, "--max-model-len", "4096", "--num-device-blocks", "256")
    try:
        with d.client(timeout_s=60) as client:
            prompt = list(range(1000, 3000))
            stream = client.stream(prompt, max_tokens=4)
            replies: list[object] = []
            reader = threading.Thread(target=lambda: replies.extend(_drain(stream)), daemon=True)
            reader.start()
            time.sleep(2.0)  # inside the prefill (about 18 s of it on this backend)
            start = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            code = d.proc.wait(timeout=30)
            took = time.monotonic() - start
            reader.join(timeout=10)
    finally:
        d.stop()
    assert code == 0 and took <= 10, (code, took)
    assert replies and isinstance(replies[-1], RequestError) and replies[-1].code == "shutting_down"
    assert not Path(d.address.removeprefix("ipc://")).exists()
    assert not Path(d.events_address.removeprefix("ipc://")).exists()


@pytest.mark.model
def test_f8_a_step_running_past_the_drain_deadline_is_not_waited_for(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """One step holds the whole 2,000-token prefill (--max-batched-tokens 2048: many
    seconds on NumPy), so the step running at SIGTERM outlasts the drain (2 s here): the
    drain's thread answers the request with its final reply, removes the socket files
    and exits 0 without waiting for the step."""
    d = Daemon(tmp_path, default_model_dir, "--max-model-len", "4096", "--num-device-blocks",
               "256", "--max-batched-tokens", "2048", "--drain-timeout", "2")  # fmt: skip
    try:
        with d.client(timeout_s=60) as client, Client(d.address, timeout_s=5) as probe:
            stream = client.stream(list(range(1000, 3000)), max_tokens=4)
            replies: list[object] = []
            reader = threading.Thread(target=lambda: replies.extend(_drain(stream)), daemon=True)
            reader.start()
            deadline = time.monotonic() + 30
            while probe.stats()["step_running_s"] is None:
                assert time.monotonic() < deadline, "the long step never started"
                time.sleep(0.05)
            start = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            code = d.proc.wait(timeout=60)
            took = time.monotonic() - start
            reader.join(timeout=10)
        d.log.seek(0)
        log = d.log.read()
    finally:
        d.stop()
    assert code == 0 and took <= 2 + 0.5 + 2 + 3, (code, took, log[-2000:])
    assert "ran past the drain deadline" in log, log[-2000:]
    assert replies and isinstance(replies[-1], RequestError) and replies[-1].code == "shutting_down"
    assert not Path(d.address.removeprefix("ipc://")).exists()
    assert not Path(d.events_address.removeprefix("ipc://")).exists()


def test_f8_the_drain_cancels_what_cannot_finish_and_starts_no_step_past_the_deadline(
    tiny: Path,
) -> None:
    """The drain's two rules (daemon/serve/drain.py), on a real engine's scheduler: a
    request in prefill whose rest needs more steps (of the step budget, each as long as
    the last prefill step) than fit before the deadline is hopeless, a decoding one never
    is; and no step starts when the last one of its kind would carry it past the
    deadline."""
    engine = Engine.from_pretrained(tiny, backend="numpy", num_device_blocks=64, block_size=16,
                                    max_num_batched_tokens=16)  # fmt: skip
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    short = engine.add_request([5, 6, 7, 8, 9], params)
    long = engine.add_request(list(range(1, 201)), params)
    engine.step()  # the short prompt whole, and 11 tokens of the long one
    assert [s.num_pending_tokens for s in engine.scheduler.running] == [1, 189]
    now = time.monotonic()
    drain = Drain(deadline=now + 5.0)
    assert drain.hopeless(engine.scheduler, now, 1.0) == [long]  # 12 steps of 1 s: no
    assert drain.hopeless(engine.scheduler, now, 0.4) == []  # 12 steps of 0.4 s fit
    assert drain.hopeless(engine.scheduler, now, None) == []  # no step timed yet
    assert drain.hopeless(engine.scheduler, now, 100.0) == [long]  # decoding: runs on
    assert next_step_kind(engine.scheduler) == "prefill"
    assert drain.step_fits(now, 4.9) and drain.step_fits(now, None)
    assert not drain.step_fits(now, 5.1) and not drain.step_fits(now + 5.0, None)
    while engine.scheduler.running[-1].num_pending_tokens > 1:
        engine.step()
    assert next_step_kind(engine.scheduler) == "decode"
    assert drain.hopeless(engine.scheduler, now, 100.0) == []
    engine.cancel(long)
    engine.cancel(short)
    engine.take_completion(long)
    engine.take_completion(short)
    engine.pool.check_integrity()


def _drain(stream: Iterator[object]) -> list[object]:
    out: list[object] = []
    try:
        out.extend(stream)
    except RequestError as e:
        out.append(e)
    return out


def test_one_json_log_line_per_finished_request(tmp_path: Path, tiny: Path) -> None:
    """serve --log-format json: every line one JSON object with time, level and logger,
    and each finished request one line with its id, tokens, reuse and timings (issue 21)."""
    d = Daemon(tmp_path, tiny, "--log-format", "json", "--log-level", "info")
    try:
        with d.client() as client:
            client.generate("hello there", max_tokens=3, temperature=0, request_id="req-1")
    finally:
        d.stop()
    d_log = (tmp_path / "serve.log").read_text().splitlines()
    lines = [json.loads(line) for line in d_log if line.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    [done] = [line for line in lines if line.get("request_id") == "req-1"]
    assert done["level"] == "info" and done["logger"] == "reprise.server"
    assert done["finish_reason"] == "length" and done["generated_tokens"] == 3
    assert done["prompt_tokens"] > 0 and done["cached_tokens"] == 0
    assert 0 <= done["ttft_ms"] <= done["total_ms"]
