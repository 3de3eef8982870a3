"""The HTTP front end's errors in OpenAI's shape, and the daemon's error codes' statuses.

`api_error` turns whatever a route meets (a daemon's error reply, a message refused
before it is sent, an unreachable daemon) into an ApiError naming, where it can,
the request body's parameter at fault; anything else is a 500 that is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from ...ipc.client import DaemonUnavailable, RequestError
from ...ipc.messages import SAMPLING_FIELDS, Generate, ProtocolError

log = logging.getLogger("reprise.http")


class ApiError(Exception):
    """An error reply in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES: ClassVar[dict[int, str]] = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
             503: "service_unavailable"}  # fmt: skip

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


# The daemon's error codes -> HTTP status.
STATUS_OF_CODE = {
    "bad_request": 400,
    "bad_message": 400,
    "too_large": 413,
    # 400 with OpenAI's code, as OpenAI and vLLM answer a prompt past the context
    "prompt_too_long": 400,
    "busy": 429,
    "shutting_down": 503,
    "duplicate_id": 409,
    "internal": 500,
}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_parameter")


def renamed(e: ApiError, names: Mapping[str, str]) -> ApiError:
    """`e`, naming the body's own parameter where it names another (`names`: the name in
    `e` -> the body's), in its param and the first mention in its message."""
    if e.param is not None:
        head, bracket, rest = e.param.partition("[")
        if head in names:
            e.message = e.message.replace(head, names[head], 1)
            e.param = names[head] + bracket + rest
    return e


def is_a(value: object, *types: type) -> bool:
    """`value` is one of `types`, a bool counting as one only when bool is among them."""
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


# The daemon's error codes whose HTTP code is OpenAI's own name for them.
OPENAI_CODE = {"prompt_too_long": "context_length_exceeded"}


def too_large(num_bytes: int, limit: int) -> ApiError:
    return ApiError(413, f"the body has {num_bytes} bytes; the limit is {limit}",
                    code="too_large")  # fmt: skip


def api_error(e: BaseException, *, embeds: bool = False) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError | ProtocolError):
        status, param, message = STATUS_OF_CODE.get(e.code, 500), _param_named(e.message), e.message
        if embeds and param == "prompt_table":  # the table the daemon checked is prompt_embeds
            param, message = "prompt_embeds", f"prompt_embeds (as the prompt table): {message}"
        return ApiError(status, message, param=param, code=OPENAI_CODE.get(e.code, e.code))
    if isinstance(e, DaemonUnavailable):
        return ApiError(503, "the daemon is not serving yet (or has stopped)",
                        code="unavailable")  # fmt: skip
    log.error("internal error in the HTTP layer: %r", e)
    return ApiError(500, f"internal error: {type(e).__name__}", code="internal")


# The request's fields a daemon message may start with, and their names in OpenAI's body.
_PARAMS = {name: name for name in (*SAMPLING_FIELDS, *Generate.__dataclass_fields__)
           if name not in ("id", "sampling")}  # fmt: skip
_PARAMS.update(token_ids="prompt", queue_priority="priority")


def _param_named(message: str) -> str | None:
    """The parameter a daemon message names first, by its name in the request body
    ("top_p must be ..." -> "top_p", "sampling.stop_token_ids[] must ..." ->
    "stop_token_ids", "token_ids[] must ..." -> "prompt"); None if it names none."""
    word = message.split(" ", 1)[0].removeprefix("sampling.").rstrip(":")
    return _PARAMS.get(word.split("[", 1)[0].split(".", 1)[0])
