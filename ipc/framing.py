"""Length-prefixed framing of the msgpack messages on a byte stream.

A frame is a 4-byte big-endian payload length, then the payload (one message
of `codec`). The decoder reads a frame's length before it keeps any of its
bytes, so what one connection can make its reader hold is bounded:

- a payload of at most `max_frame_bytes` is buffered until complete;
- a longer one, up to `max_skip_bytes`, is read and dropped as it arrives (its
  bytes are never kept) and reported once as `Oversize`, so the reader can
  answer it and the connection stays usable;
- a longer one still (or bytes that are not our framing at all, such as a
  ZeroMQ greeting, whose first byte is 0xFF) raises `FramingError`: the stream
  cannot be trusted to resynchronise, so the connection should be closed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER = struct.Struct(">I")
MAX_PAYLOAD_BYTES = (1 << 32) - 1  # what the header can say


class FramingError(ValueError):
    """The stream is not a sequence of frames this reader accepts."""


@dataclass(frozen=True, slots=True)
class Oversize:
    """A frame of `num_bytes` that was dropped unread (over `max_frame_bytes`)."""

    num_bytes: int


def frame(payload: bytes) -> bytes:
    """The wire form of one message."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"a frame holds at most {MAX_PAYLOAD_BYTES} bytes; got {len(payload)}")
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Turns the bytes of one connection, in whatever pieces they arrive, into frames.

    NOTE: `buffered_bytes` never exceeds `HEADER.size + max_frame_bytes`.
    """

    __slots__ = ("_buf", "_need", "_skip", "max_frame_bytes", "max_skip_bytes")

    def __init__(self, max_frame_bytes: int, max_skip_bytes: int | None = None) -> None:
        if max_skip_bytes is None:
            max_skip_bytes = max_frame_bytes
        if not 0 < max_frame_bytes <= max_skip_bytes <= MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"need 0 < max_frame_bytes <= max_skip_bytes <= {MAX_PAYLOAD_BYTES}; "
                f"got {max_frame_bytes} and {max_skip_bytes}"
            )
        self.max_frame_bytes = max_frame_bytes
        self.max_skip_bytes = max_skip_bytes
        self._buf = bytearray()
        self._need: int | None = None  # the payload length of the frame being read
        self._skip = 0  # bytes of an oversize frame still to drop

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | memoryview) -> list[bytes | Oversize]:
        """The frames `data` completes, in order. Raises FramingError (and is then
        unusable) on a length over `max_skip_bytes`."""
        out: list[bytes | Oversize] = []
        view = memoryview(data)
        while view:
            if self._skip:
                n = min(self._skip, len(view))
                self._skip -= n
                view = view[n:]
                continue
            if self._need is None:
                take = min(HEADER.size - len(self._buf), len(view))
                self._buf += view[:take]
                view = view[take:]
                if len(self._buf) < HEADER.size:
                    break
                (length,) = HEADER.unpack(self._buf)
                self._buf.clear()
                if length > self.max_skip_bytes:
                    raise FramingError(
                        f"a frame of {length} bytes; the limit is {self.max_frame_bytes}"
                    )
                if length > self.max_frame_bytes:
                    self._skip = length
                    out.append(Oversize(length))
                    continue
                if length == 0:
                    out.append(b"")
                    continue
                self._need = length
            take = min(self._need - len(self._buf), len(view))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self._need:
                out.append(bytes(self._buf))
                self._buf.clear()
                self._need = None
        return out
