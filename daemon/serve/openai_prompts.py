"""A /v1/completions prompt: text, token ids, a batch of either, or embeddings.

`prompt_batch` reads OpenAI's `prompt` (a string, a list of token ids, or a batch of
1 to MAX_BATCH of either) and `one_prompt` a single one; `prompt_embeds` reads vLLM's
`prompt_embeds` as the BF16 prompt table the daemon takes (Generate.prompt_table).
Each raises ApiError (400) naming the parameter; the ids and the table's width are
checked against the model by the daemon.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from ...cuda.dtypes import BF16
from .openai_errors import bad
from .openai_errors import is_a as _is

MAX_BATCH = 64  # prompts one /v1/completions request may give (each runs as a request)


def one_prompt(prompt: object) -> str | list[int]:
    """One prompt: a string or a list of token ids (a batch of one too)."""
    batch = prompt_batch(prompt)
    if len(batch) > 1:
        raise bad("prompt", "must be one prompt here (a string or a list of token ids)")
    return batch[0]


def prompt_batch(
    prompt: object, param: str = "prompt", most: int = MAX_BATCH
) -> list[str | list[int]]:
    """OpenAI's `prompt` (or /v1/embeddings' `input`, named by `param`): a string, a list
    of token ids, or a batch (a list of 1 to `most` of either)."""
    if prompt is None:
        raise bad(param, "is required")
    if isinstance(prompt, str) or is_token_ids(prompt):
        return [prompt]  # type: ignore[list-item]
    if (
        isinstance(prompt, list)
        and 1 <= len(prompt) <= most
        and all(isinstance(p, str) or is_token_ids(p) for p in prompt)
    ):
        return prompt
    raise bad(param, "must be a string, a list of token ids, or a batch of 1 to "
              f"{most} of either")  # fmt: skip


def is_token_ids(value: object) -> bool:
    """A non-empty list of integers (bools are no token ids)."""
    return isinstance(value, list) and bool(value) and all(_is(t, int) for t in value)


NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format
EMBEDS_FORMS = (
    "a base64 string of an .npy file holding a 2-d [rows, hidden] array of bfloat16 "
    "(ml_dtypes, or its uint16 bit patterns) or float32 (rounded to bfloat16), or an "
    'object {"data": base64 of raw little-endian bfloat16, "shape": [rows, hidden]}'
)


def prompt_embeds(value: object) -> np.ndarray:
    """vLLM's `prompt_embeds` (one prompt's [rows, hidden] embeddings) as a BF16 table,
    or a 400 naming `prompt_embeds`. vLLM takes a base64 `torch.save`d tensor; with no
    torch here we take an .npy file or raw BF16 with its shape (EMBEDS_FORMS)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # a batch of one, as vLLM accepts a list
    if isinstance(value, str):
        raw = _base64("prompt_embeds", value)
        if raw.startswith(ZIP_MAGIC):
            raise bad("prompt_embeds", "torch.save'd tensors are not supported (no torch "
                      f"here); send {EMBEDS_FORMS}")  # fmt: skip
        if not raw.startswith(NPY_MAGIC):
            raise bad("prompt_embeds", f"is not an .npy file; send {EMBEDS_FORMS}")
        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise bad("prompt_embeds", f"cannot read the .npy file: {e}") from None
        if array.dtype.str == "<f4":
            table = array.astype(BF16)  # round to nearest even, as vLLM casts to the model's
        elif array.dtype.str in ("<u2", "|V2"):  # ml_dtypes' bfloat16 reads back as |V2
            table = np.ascontiguousarray(array).view(BF16)
        else:
            raise bad("prompt_embeds", f"the .npy array is {array.dtype.str}; it must be "
                      "bfloat16 (|V2 from ml_dtypes, or <u2 bit patterns) or <f4")  # fmt: skip
    elif isinstance(value, dict):
        if set(value) - {"data", "shape", "dtype"} or not {"data", "shape"} <= set(value):
            raise bad("prompt_embeds", "an object must have data and shape (and optionally "
                      f"dtype: bfloat16); got {sorted(value)}")  # fmt: skip
        if value.get("dtype", "bfloat16") != "bfloat16":
            raise bad("prompt_embeds", f"dtype must be bfloat16; got {value['dtype']!r:.40}")
        shape = value["shape"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(_is(d, int) for d in shape)):
            raise bad("prompt_embeds", f"shape must be [rows, hidden]; got {shape!r:.60}")
        if not isinstance(value["data"], str):
            raise bad("prompt_embeds", "data must be a base64 string")
        raw = _base64("prompt_embeds", value["data"])
        rows, hidden = shape
        if rows < 1 or hidden < 1 or len(raw) != 2 * rows * hidden:
            raise bad("prompt_embeds", f"data holds {len(raw)} bytes; shape {shape} needs "
                      f"{2 * max(rows, 0) * max(hidden, 0)} (2 per bfloat16, rows and hidden "
                      ">= 1)")  # fmt: skip
        table = np.frombuffer(raw, dtype="<u2").view(BF16).reshape(rows, hidden)
    else:
        raise bad("prompt_embeds", f"must be {EMBEDS_FORMS}")
    if table.ndim != 2 or 0 in table.shape:
        raise bad("prompt_embeds", f"must be 2-d [rows, hidden], non-empty; got shape "
                  f"{list(table.shape)}")  # fmt: skip
    return np.ascontiguousarray(table)


def _base64(param: str, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, "is not valid base64") from None
