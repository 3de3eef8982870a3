"""The HTTP front end's errors in OpenAI's shape, and the daemon's error codes' statuses."""

from __future__ import annotations

from typing import Any, ClassVar


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


def is_a(value: object, *types: type) -> bool:
    """`value` is one of `types`, a bool counting as one only when bool is among them."""
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


# The daemon's error codes whose HTTP code is OpenAI's own name for them.
OPENAI_CODE = {"prompt_too_long": "context_length_exceeded"}
