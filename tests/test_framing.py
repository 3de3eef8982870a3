"""Length-prefixed frames on a byte stream (reprise.ipc.framing), without a daemon."""

from __future__ import annotations

import pytest

from reprise.ipc.framing import HEADER, FrameDecoder, FramingError, Oversize, frame


def test_frames_come_out_whole_whatever_the_pieces() -> None:
    payloads = [b"a", b"", b"hello" * 50, bytes(range(256))]
    stream = b"".join(frame(p) for p in payloads)
    for piece in (1, 3, 4, 7, len(stream)):
        decoder = FrameDecoder(max_frame_bytes=1024)
        out: list[object] = []
        for i in range(0, len(stream), piece):
            out += decoder.feed(stream[i : i + piece])
            assert decoder.buffered_bytes <= HEADER.size + 1024
        assert out == payloads, piece


def test_an_oversize_frame_is_dropped_unbuffered_and_the_stream_goes_on() -> None:
    decoder = FrameDecoder(max_frame_bytes=8, max_skip_bytes=100)
    big = frame(b"x" * 50)
    out = decoder.feed(big[:10])
    assert out == [Oversize(50)] and decoder.buffered_bytes == 0
    assert decoder.feed(big[10:] + frame(b"ok")) == [b"ok"]


def test_a_length_past_the_ceiling_or_a_zmq_greeting_is_refused() -> None:
    decoder = FrameDecoder(max_frame_bytes=8, max_skip_bytes=100)
    with pytest.raises(FramingError, match="101 bytes"):
        decoder.feed(HEADER.pack(101))
    zmtp_greeting = b"\xff" + bytes(8) + b"\x7f"  # what a ZeroMQ DEALER sends first
    with pytest.raises(FramingError):
        FrameDecoder(max_frame_bytes=1 << 20).feed(zmtp_greeting)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_frame_bytes"):
        FrameDecoder(max_frame_bytes=0)
    with pytest.raises(ValueError, match="max_skip_bytes"):
        FrameDecoder(max_frame_bytes=10, max_skip_bytes=5)
