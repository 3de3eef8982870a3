"""The wire protocol without a daemon: codec round trips and the validation of every field."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import msgpack
import numpy as np
import pytest

from reprise.daemon.serve.service import Notifier
from reprise.ipc.codec import (
    decode_reply,
    decode_request,
    encode,
    logits_from_wire,
    logits_to_wire,
)
from reprise.ipc.messages import (
    Cancel,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorReply,
    Generate,
    Health,
    ProtocolError,
    StatsRequest,
    TokenChunk,
    Tokenize,
    TokenizeReply,
)
from reprise.ipc.sockets import check_address, client_address, prepare_ipc_path, server_address


def pack(**body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def code_of(data: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_request(data)
    return info.value.code


@pytest.mark.parametrize(
    "message",
    [
        Generate(id="r1", prompt="hi", sampling={"max_tokens": 3, "temperature": 0.5}),
        Generate(
            id="r2",
            messages=[{"role": "user", "content": "hi"}],
            cache_salt="a",
            priority=90,
            queue_priority=-3,
        ),
        Generate(id="r3", token_ids=[1, 2, 3], stream=False, return_logits=True),
        Cancel(id="r1"),
        StatsRequest(check=True),
        Health(),
        Tokenize(id="t1", prompt="hi"),
        Tokenize(id="t2", messages=[{"role": "user", "content": "hi"}]),
        Detokenize(id="d1", token_ids=[1, 2], skip_special_tokens=True),
    ],
)
def test_requests_round_trip(message: object) -> None:
    assert decode_request(encode(message)) == message  # type: ignore[arg-type]


def test_replies_round_trip() -> None:
    logits = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    done = Done("x", "length", "ab", [1, 2], 4, 0, 0, 1.5, 9.0, logits_to_wire(logits))
    back = decode_reply(encode(done))
    assert isinstance(back, Done) and back.token_ids == [1, 2]
    assert back.logits is not None
    np.testing.assert_array_equal(logits_from_wire(back.logits), logits)
    for reply in (TokenChunk("x", [5], "a"), ErrorReply("busy", "full", "x"),
                  TokenizeReply("t", [3, 4]), DetokenizeReply("d", "ab")):  # fmt: skip
        assert decode_reply(encode(reply)) == reply


def test_logprobs_travel_with_chunks_and_done() -> None:
    from reprise.daemon.engine.sampling.logprobs import TokenLogprobs
    from reprise.ipc.codec import logprobs_to_wire

    lps = [TokenLogprobs(7, -0.25, ((7, -0.25), (3, -1.5)), 1), TokenLogprobs(3, -2.0, (), 4)]
    wire = logprobs_to_wire(lps, lambda t: f"<{t}>")
    assert wire[0] == {"id": 7, "token": "<7>", "logprob": -0.25, "rank": 1,
                       "top": [[7, "<7>", -0.25], [3, "<3>", -1.5]]}  # fmt: skip
    chunk = TokenChunk("x", [7], "a", wire[:1])
    assert decode_reply(encode(chunk)) == chunk
    # a newer daemon's field this client does not know is left out
    newer = msgpack.packb({"v": 1, "type": "chunk", "id": "x", "token_ids": [7], "text": "a",
                           "from_the_future": 1})  # fmt: skip
    assert decode_reply(newer) == TokenChunk("x", [7], "a")
    done = Done("x", "length", "ab", [7, 3], 4, 0, 0, 1.5, 9.0, None, wire)
    assert decode_reply(encode(done)).logprobs == wire
    sampling = {"logprobs": 20, "presence_penalty": 0.5, "frequency_penalty": -1,
                "repetition_penalty": 1.1, "min_p": 0.05}  # fmt: skip
    request = Generate(id="g", prompt="x", sampling=sampling)
    assert decode_request(encode(request)) == request
    with pytest.raises(ProtocolError, match=r"sampling\.logprobs"):
        Generate(id="g", prompt="x", sampling={"logprobs": "all"})


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\xc1garbage", "bad_message"),
        (pack(v=1, type="health")[:-3], "bad_message"),  # truncated
        (msgpack.packb([1, 2]), "bad_message"),  # not a map
        (pack(type="health"), "bad_message"),  # no version
        (pack(v=2, type="health"), "unsupported_version"),
        (pack(v="1", type="health"), "unsupported_version"),
        (pack(v=1, type="nope"), "unknown_type"),
        (pack(v=1, type=7), "unknown_type"),
        (pack(v=1, type="generate", prompt="x"), "bad_request"),  # no id
        (pack(v=1, type="generate", id="a"), "bad_request"),  # no prompt
        (pack(v=1, type="generate", id="a", prompt="x", token_ids=[1]), "bad_request"),
        (pack(v=1, type="generate", id="a", prompt=5), "bad_request"),
        (pack(v=1, type="generate", id="a", token_ids=[1, "2"]), "bad_request"),
        (pack(v=1, type="generate", id="a", token_ids=[True]), "bad_request"),
        (pack(v=1, type="generate", id="a", messages=[]), "bad_request"),
        (pack(v=1, type="generate", id="a", messages=[{"role": "user"}]), "bad_request"),
        (pack(v=1, type="generate", id="a", prompt="x", extra=1), "bad_request"),
        (
            pack(v=1, type="generate", id="a", prompt="x", sampling={"max_tokens": "3"}),
            "bad_request",
        ),
        (pack(v=1, type="generate", id="a", prompt="x", sampling={"bogus": 1}), "bad_request"),
        (
            pack(v=1, type="generate", id="a", prompt="x", sampling={"top_p": float("nan")}),
            "bad_request",
        ),
        (pack(v=1, type="generate", id="a", prompt="x", priority=101), "bad_request"),
        (pack(v=1, type="generate", id="a", prompt="x", stream=1), "bad_request"),
        (pack(v=1, type="generate", id="", prompt="x"), "bad_request"),
        (pack(v=1, type="generate", id="a" * 129, prompt="x"), "bad_request"),
        (pack(v=1, type="cancel", id=3), "bad_request"),
        (pack(v=1, type="tokenize", id="t"), "bad_request"),  # no prompt
        (pack(v=1, type="tokenize", id="t", prompt="x", messages=[]), "bad_request"),
        (pack(v=1, type="tokenize", id="t", messages=[{"role": "user"}]), "bad_request"),
        (pack(v=1, type="tokenize", prompt="x"), "bad_request"),  # no id
        (pack(v=1, type="tokenize", id="t", token_ids=[1]), "bad_request"),
        (pack(v=1, type="detokenize", id="d", token_ids=[1, "2"]), "bad_request"),
        (pack(v=1, type="detokenize", id="d"), "bad_request"),
        (pack(v=1, type="detokenize", id="d", token_ids=[1], skip_special_tokens=1), "bad_request"),
        (pack(v=1, type="stats", check="yes"), "bad_request"),
    ],
)
def test_bad_messages_get_codes(data: bytes, code: str) -> None:
    assert code_of(data) == code


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"prompt": "x", "sampling": {"seed": 1 << 64}}, "sampling.seed must fit in 64 bits"),
        ({"token_ids": [1, -(1 << 63) - 1]}, "token_ids[] must fit in 64 bits"),
        ({"prompt": "x", "queue_priority": 1 << 70}, "queue_priority must fit in 64 bits"),
        ({"prompt": "x", "sampling": {"stop_token_ids": [1 << 64]}}, "stop_token_ids[] must fit"),
        ({"prompt": "x", "sampling": {"stop": ["a", 3]}}, "sampling.stop[] must be str"),
        ({"prompt": "a\ud800"}, "prompt is not valid Unicode: a lone surrogate at character 1"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content is not valid"),
        ({"prompt": "x", "sampling": {"stop": ["\ud800"]}}, "sampling.stop[] is not valid Unicode"),
        ({"prompt": "x", "cache_salt": "\udc80"}, "cache_salt is not valid Unicode"),
    ],
)
def test_a_request_msgpack_cannot_carry_is_refused_as_it_is_made(fields: dict, says: str) -> None:
    """Integers past 64 bits and strings with lone surrogates (Python and JSON hold them,
    UTF-8 and msgpack do not) are bad_request when the message is made, on the client's
    side, not an exception of msgpack's when it is sent (the HTTP front end answers 400)."""
    with pytest.raises(ProtocolError) as info:
        Generate(id="a", **fields)
    assert info.value.code == "bad_request" and says in info.value.message, info.value.message


def test_the_widest_integers_msgpack_carries_are_taken() -> None:
    for request in (
        Generate(id="a", prompt="x", sampling={"seed": (1 << 64) - 1}),
        Generate(id="a", token_ids=[-(1 << 63), (1 << 64) - 1]),
    ):
        assert decode_request(encode(request)) == request


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"messages": None, "prompt": "x", "chat_options": {}}, "chat_options go with messages"),
        ({"chat_options": {"add_generation_prompt": 1}}, "chat_options.add_generation_prompt"),
        ({"chat_options": {"continue_final_message": True}}, "needs add_generation_prompt false"),
        ({"chat_options": {"echo": True}}, "unknown field(s) 'echo'"),
        ({"chat_options": {"kwargs": []}}, "chat_options.kwargs must be dict"),
        ({"chat_options": {"kwargs": {"tools": 1}}}, "cannot set tools"),
        ({"chat_options": {"kwargs": {"a-b": 1}}}, "must be identifiers"),
        ({"chat_options": {"kwargs": {f"k{i}": i for i in range(33)}}}, "at most 32"),
        (
            {"messages": CHAT[:1],
             "chat_options": {"add_generation_prompt": False, "continue_final_message": True}},
            "the last message to be the assistant's; it is 'user''s",
        ),
    ],
)  # fmt: skip
def test_chat_options_are_checked_as_the_message_is_made(fields: dict, says: str) -> None:
    """vLLM's chat options on the wire (Generate.chat_options, Tokenize's alike)."""
    fields = {"messages": CHAT, **fields}
    for kind in (Generate, Tokenize):
        with pytest.raises(ProtocolError) as info:
            kind(id="a", **fields)
        assert info.value.code == "bad_request" and says in info.value.message, info.value.message
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "kwargs": {"enable_thinking": False, "who": ["a", 1]}}  # fmt: skip
    for request in (Generate(id="a", messages=CHAT, chat_options=options),
                    Tokenize(id="a", messages=CHAT, chat_options=options)):  # fmt: skip
        assert decode_request(encode(request)) == request


def test_error_carries_the_request_id_when_readable() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(pack(v=1, type="generate", id="mine", prompt=5))
    assert info.value.request_id == "mine"


def test_addresses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("REPRISE_SOCKET", raising=False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert server_address() == f"ipc://{tmp_path}/reprise/reprise.sock"
    assert client_address() == f"ipc://{tmp_path}/reprise/reprise.sock"
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/reprise")
    assert server_address() == "ipc:///run/reprise/reprise.sock"
    monkeypatch.setenv("REPRISE_SOCKET", "tcp://127.0.0.1:5555")
    assert server_address() == client_address() == "tcp://127.0.0.1:5555"
    assert client_address("ipc:///x") == "ipc:///x"
    check_address("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="loopback"):
        check_address("tcp://0.0.0.0:1")
    with pytest.raises(ValueError, match="ipc://"):
        check_address("http://x")


def test_a_socket_folder_is_made_but_not_the_folders_above_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A chosen path gets only its own folder (700); a missing folder above it is refused
    with the flag and that folder named. The default path's folders are all made: its
    runtime folder may not exist yet (here systemd's RUNTIME_DIRECTORY)."""
    monkeypatch.delenv("REPRISE_SOCKET", raising=False)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "run" / "reprise"))
    prepare_ipc_path(tmp_path / "own" / "d.sock")
    assert (tmp_path / "own").stat().st_mode & 0o777 == 0o700
    line = f"--events ipc://{tmp_path}/a/b/e.sock: no folder {tmp_path}/a; reprise makes only"
    with pytest.raises(RuntimeError, match=re.escape(line)):
        prepare_ipc_path(tmp_path / "a" / "b" / "e.sock", "--events")
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeError, match="cannot make the socket folder"):
        prepare_ipc_path(tmp_path / "file" / "d.sock")
    default = Path(server_address().removeprefix("ipc://"))
    assert default == tmp_path / "run" / "reprise" / "reprise.sock"
    prepare_ipc_path(default)
    assert default.parent.stat().st_mode & 0o777 == 0o700


def test_clients_refuse_a_user_socket_folder_others_control(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A client's default socket folder must be ours and writable by no one else, or a
    squatter's socket there would receive our prompts (F4 on the client side)."""
    monkeypatch.delenv("REPRISE_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = tmp_path / "reprise"
    folder.mkdir(mode=0o700)
    assert client_address() == f"ipc://{folder}/reprise.sock"
    folder.chmod(0o750)  # a named group may enter, as the systemd unit's folder
    assert client_address() == f"ipc://{folder}/reprise.sock"
    folder.chmod(0o777)
    with pytest.raises(RuntimeError, match=f"{folder} is owned by you with mode 777"):
        client_address()
    assert client_address("ipc:///elsewhere/r.sock") == "ipc:///elsewhere/r.sock"  # chosen
    folder.chmod(0o700)
    if os.getuid() == 0:  # only root can give a folder away
        os.chown(folder, 65534, 65534)
        with pytest.raises(RuntimeError, match="owned by uid 65534"):
            client_address()


def test_notifier_speaks_sd_notify(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        monkeypatch.setenv("WATCHDOG_USEC", "2000000")
        notifier = Notifier()
        assert notifier.watchdog_interval_s == 1.0
        notifier.notify("READY=1")
        notifier.ping_watchdog()
        notifier.ping_watchdog()  # within the interval: not sent
        notifier.notify("STOPPING=1")
        got = [sock.recv(256) for _ in range(3)]
    assert got == [b"READY=1", b"WATCHDOG=1", b"STOPPING=1"]


def test_notifier_is_silent_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    notifier = Notifier()
    assert notifier.watchdog_interval_s is None
    notifier.notify("READY=1")
    notifier.ping_watchdog()


def test_serve_config_file(tmp_path: Path) -> None:
    import click

    from reprise.cli.serve import load_config

    good = tmp_path / "good.toml"
    good.write_text(
        'block-size = 16\nsocket = "ipc:///tmp/x.sock"\ndrain_timeout = 5\n'
        "memory-fraction = 0.5\nreuse = false\n"
    )
    assert load_config(good) == {
        "block_size": 16,
        "socket": "ipc:///tmp/x.sock",
        "drain_timeout": 5,
        "memory_fraction": 0.5,
        "reuse": False,
    }
    for text in ("reuse = 1\n", "block-size = true\n"):
        (tmp_path / "bad-type.toml").write_text(text)
        with pytest.raises(click.ClickException, match="must be a"):
            load_config(tmp_path / "bad-type.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("block-size = 'big'\n")
    with pytest.raises(click.ClickException, match="block-size"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("colour = 1\n")
    with pytest.raises(click.ClickException, match="unknown option"):
        load_config(unknown)


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0])
def test_server_config_refuses_a_drain_timeout_that_is_not_finite_seconds(seconds: float) -> None:
    from reprise.daemon.serve.settings import ServerConfig

    with pytest.raises(ValueError, match="drain_timeout_s must be a finite number of seconds"):
        ServerConfig(address="ipc:///x/y.sock", drain_timeout_s=seconds)


def test_free_form_json_is_checked_to_its_leaves() -> None:
    """Template variables and a tool's parameters are free-form JSON: an integer past 64
    bits or a lone surrogate anywhere in them (map keys too) is bad_request naming the field,
    as a top-level field's would be; nested values the wire carries pass."""
    from reprise.ipc.messages import ProtocolError, check_chat_options, check_tools

    check_chat_options({"kwargs": {"x": [1, {"y": -(2**63), "z": "ok"}], "b": True}})
    with pytest.raises(ProtocolError, match=r"chat_options\.kwargs must fit in 64 bits"):
        check_chat_options({"kwargs": {"x": [1, {"y": 2**70}]}})
    with pytest.raises(ProtocolError, match=r"chat_options\.kwargs is not valid Unicode"):
        check_chat_options({"kwargs": {"x": {"\ud800": 1}}})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    check_tools([tool])
    tool["function"]["parameters"] = {"properties": {"a": {"maxItems": 2**64}}}
    with pytest.raises(ProtocolError, match=r"tools\[0\]\.function\.parameters must fit"):
        check_tools([tool])
