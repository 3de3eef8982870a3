"""One msgpack codec for every message, keyed by the `type` tag. Never pickle.

`decode_request` is the daemon's only door: whatever bytes arrive, it returns
a validated request dataclass or raises `ProtocolError` with a stable code
(and the request's `id` when one could be read, so the client can match the
error to its request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import ml_dtypes
import msgpack
import numpy as np

from .messages import (
    PROTOCOL_VERSION,
    REPLY_TYPES,
    REQUEST_TYPES,
    ErrorReply,
    ProtocolError,
    Reply,
    Request,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


class TokenLogprobsLike(Protocol):
    """The engine's TokenLogprobs, as the codec reads it (ipc does not import the daemon)."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def rank(self) -> int: ...


# Caps on what msgpack may unpack from one message, so a hostile length field
# cannot make the daemon allocate much before validation runs.
_UNPACK_LIMITS = {
    "max_str_len": 1 << 22,
    "max_bin_len": 1 << 26,
    "max_array_len": 1 << 20,
    "max_map_len": 64,
    "max_ext_len": 0,
}


def encode(message: Request | Reply) -> bytes:
    """The wire form: a msgpack map of `v`, `type` and the message's fields."""
    body = {"v": PROTOCOL_VERSION, "type": message.TYPE}
    body.update({f.name: getattr(message, f.name) for f in dataclasses.fields(message)})
    return msgpack.packb(body, use_bin_type=True)


def _unpack_map(data: bytes) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises many kinds (ExtraData, ValueError, TypeError, ...)
        raise ProtocolError(
            "bad_message", f"not a msgpack message: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(body, dict):
        raise ProtocolError(
            "bad_message", f"a message must be a msgpack map; got {type(body).__name__}"
        )
    return body


def _build(body: dict[str, Any], types: dict[str, type]) -> Any:
    request_id = body.get("id") if isinstance(body.get("id"), str) else None
    if "v" not in body or "type" not in body:
        raise ProtocolError("bad_message", "a message needs `v` and `type`", request_id)
    version = body["v"]
    if isinstance(version, bool) or not isinstance(version, int) or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {version!r} is not supported; this daemon speaks {PROTOCOL_VERSION}",
            request_id,
        )
    tag = body["type"]
    if not isinstance(tag, str) or tag not in types:
        raise ProtocolError(
            "unknown_type", f"unknown message type {tag!r}; known: {sorted(types)}", request_id
        )
    cls = types[tag]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in body.items() if k not in ("v", "type")}
    unknown = sorted(str(k) for k in kwargs if k not in fields)
    if unknown:
        raise ProtocolError("bad_request", f"{tag}: unknown field(s) {unknown}", request_id)
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ProtocolError("bad_request", f"{tag}: missing field(s) {missing}", request_id)
    try:
        return cls(**kwargs)
    except ProtocolError as e:
        e.request_id = request_id
        raise


def decode_request(data: bytes) -> Request:
    """Bytes from a client -> a validated request, or ProtocolError."""
    return _build(_unpack_map(data), REQUEST_TYPES)


def decode_reply(data: bytes) -> Reply:
    """Bytes from the daemon -> a reply (the daemon is trusted; only the tag is checked).
    Fields this client does not know (a newer daemon's additions) are left out, so a
    reply gaining an optional field breaks no older client."""
    body = _unpack_map(data)
    tag = body.pop("type", None)
    body.pop("v", None)
    cls = REPLY_TYPES.get(tag)
    if cls is None:
        raise ProtocolError("bad_message", f"unknown reply type {tag!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in body.items() if k in known})


def error_bytes(code: str, message: str, request_id: str | None = None) -> bytes:
    return encode(ErrorReply(code=code, message=message, id=request_id))


def logits_to_wire(logits: np.ndarray) -> dict[str, Any]:
    """A float32 array as {"shape": [...], "data": raw little-endian bytes}."""
    array = np.ascontiguousarray(logits, dtype="<f4")
    return {"shape": list(array.shape), "data": array.tobytes()}


def logprobs_to_wire(
    logprobs: Sequence[TokenLogprobsLike], token_text: Callable[[int], str]
) -> list[dict[str, Any]]:
    """Per-token logprobs as plain maps, each token id with its text (`token_text`)."""
    return logprob_columns_to_wire(
        [lp.token_id for lp in logprobs],
        [lp.logprob for lp in logprobs],
        [lp.rank for lp in logprobs],
        [lp.top for lp in logprobs],
        token_text,
    )


def logprob_columns_to_wire(
    token_ids: Iterable[int],
    logprobs: Iterable[float],
    ranks: Iterable[int],
    tops: Iterable[Iterable[tuple[int, float]]],
    token_text: Callable[[int], str],
) -> list[dict[str, Any]]:
    """`logprobs_to_wire` of entries given as columns (an entry's top list as its (token id,
    logprob) pairs): what a long prompt's entries, held as arrays, go out as without an
    object made for each."""
    return [
        {
            "id": token_id,
            "token": token_text(token_id),
            "logprob": logprob,
            "rank": rank,
            "top": [[t, token_text(t), v] for t, v in top],
        }
        for token_id, logprob, rank, top in zip(token_ids, logprobs, ranks, tops, strict=True)
    ]


def prompt_table_to_wire(table: np.ndarray) -> dict[str, Any]:
    """A BF16 [num_virtual, hidden] table as Generate.prompt_table."""
    if table.dtype != BF16 or table.ndim != 2:
        raise ValueError(
            f"prompt_table must be a 2-d bfloat16 array; got {table.dtype} {list(table.shape)}"
        )
    array = np.ascontiguousarray(table).view("<u2")
    return {"shape": list(table.shape), "dtype": "bfloat16", "data": array.tobytes()}


def prompt_table_from_wire(wire: dict[str, Any]) -> np.ndarray:
    """Generate.prompt_table (already checked by the message) as a BF16 array (no copy)."""
    return np.frombuffer(wire["data"], dtype="<u2").view(BF16).reshape(wire["shape"])


def logits_from_wire(wire: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(wire["data"], dtype="<f4").reshape(wire["shape"]).astype(np.float32)
