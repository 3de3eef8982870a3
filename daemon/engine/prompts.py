"""A request's prompt, checked: its token ids (from text by the tokenizer, or given),
each one the model or a prompt table can take, in a length the context holds; and the
same check done ahead of the engine loop (`PreparedPrompt`).

Guarantees:
- `prompt_ids` takes a string or a list or tuple of integers (what Python takes as an
  index: ints and their subclasses, NumPy integers; bools not) and returns the ids as
  plain ints, as a list and as an int64 array, or raises ValueError with one line
  saying what was wrong and what is allowed.
- A `PreparedPrompt` (`Engine.prepare_prompt`, safe on any thread) holds that check's
  result, the ids as block keys encode them, and, for a prompt without prompt-table
  ids, the keys of its full blocks under one namespace. An engine takes it only from
  itself (`checked_by`), and takes its keys only for a request of that namespace and no
  prompt table (`keys_for`); otherwise it computes them as for any prompt. So a
  prepared prompt gets the same keys, blocks and bits as the prompt itself: what moves
  off the loop is only work, never a decision.
- `split_batch` tells a batch of prompts from one prompt of ids, and pairs each
  prompt with its SamplingParams.
"""

from __future__ import annotations

import array as pyarray
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from ...blockpool.hashing import BlockHash, Namespace
from ..model.tokenizer import Tokenizer
from .params import SamplingParams

Prompt = str | list[int]
MAX_TOKEN_ID = 1 << 31  # token ids, prompt-table ids too, are int32 on the device


def prompt_ids(
    prompt: Prompt,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    max_model_len: int,
    keep_last: int | None = None,
) -> tuple[list[int], np.ndarray]:
    """The prompt's ids, as a list of plain ints and as an int64 array; with `keep_last`
    (vLLM's truncate_prompt_tokens), its last `keep_last` only, before the length check."""
    array: np.ndarray | None
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        array = np.asarray(ids, dtype=np.int64)
    elif (array := _id_array(prompt)) is not None:
        # ids >= vocab are prompt-table ids, checked by check_prompt_table
        if ((array < 0) | (array >= MAX_TOKEN_ID)).any():
            bad = [int(t) for t in prompt if not 0 <= t < MAX_TOKEN_ID]
            raise ValueError(
                f"prompt token ids must be in [0, {vocab_size}), or from {vocab_size} up to "
                f"select prompt_table rows; got {bad[:5]}"
            )
        ids = array.tolist()  # plain ints, whatever integer type came in
    else:
        raise ValueError(
            f"prompt must be a string or a list of token ids; got {type(prompt).__name__}"
        )
    if keep_last is not None and len(ids) > keep_last:
        ids, array = ids[-keep_last:], array[-keep_last:]
    if not ids:
        raise ValueError("prompt is empty; it must hold at least one token")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens; the context holds {max_model_len}, "
            f"so a prompt may have at most {max_model_len - 1}"
        )
    return ids, array


def _id_array(prompt: object) -> np.ndarray | None:
    """A list or tuple of ints (NumPy integers too, bools not) as an int64 array, else
    None. One C pass converts and checks the types (`struct.pack`'s "q" takes exactly
    what has `__index__`: no floats, strings or NumPy bools; about a third of
    `array.array`'s time on a 4k prompt); Python bools pass it as 0 and 1, so only a
    prompt holding a 0 or a 1 is scanned for them. A prompt it refuses is told apart by
    `array.array` (not integers, or an id past int64, which gives an array with it out of
    range, -1, for the range check to name)."""
    if not isinstance(prompt, list | tuple):
        return None
    try:
        array = np.frombuffer(struct.pack(f"={len(prompt)}q", *prompt), dtype=np.int64)
    except struct.error:
        try:
            array = np.frombuffer(pyarray.array("q", prompt), dtype=np.int64)
        except TypeError:
            return None
        except OverflowError:
            array = np.asarray([t if -(1 << 63) <= t < 1 << 63 else -1 for t in prompt], np.int64)
    if (array <= 1).any() and any(type(t) is bool for t in prompt):
        return None
    return array


@dataclass(frozen=True, slots=True, eq=False)
class PreparedPrompt:
    """A prompt checked by one engine ahead of `add_request` (module docstring)."""

    ids: tuple[int, ...]
    array: np.ndarray  # int64, read-only
    id_bytes: bytes  # the ids as block keys encode them (hashing.encode_ids)
    namespace: Namespace  # the namespace `keys` were computed under
    keys: tuple[BlockHash, ...]  # of the prompt's full blocks; () with prompt-table ids
    owner: object  # the engine that checked it

    def checked_by(self, engine: object) -> PreparedPrompt:
        """This prompt, if `engine` prepared it (another engine's vocabulary, context or
        model may differ); ValueError otherwise."""
        if self.owner is not engine:
            raise ValueError("a prepared prompt is taken only by the engine that prepared it")
        return self

    def keys_for(self, namespace: Namespace, has_prompt_table: bool) -> list[BlockHash]:
        """The full blocks' keys for a request of `namespace` (a fresh list, which the
        request's own key memo extends); none for another namespace or with a prompt
        table, whose extra ids enter the keys."""
        if has_prompt_table or namespace != self.namespace:
            return []
        return list(self.keys)


def split_batch(
    prompt: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
) -> tuple[list[Prompt], list[SamplingParams], bool]:
    """`generate`'s prompts, the SamplingParams of each (one for all, the defaults for
    None, else one per prompt: ValueError when the counts differ), and whether
    `prompt` was a batch."""
    # a batch's items are prompts, a prompt's are ids: the first item says which (a
    # scan of every item, as the prompt's own check makes, would cost a 4k-token
    # prompt a second pass); a list mixing the two is refused either way
    is_batch = (
        isinstance(prompt, list | tuple)
        and bool(prompt)
        and isinstance(prompt[0], str | list | tuple | PreparedPrompt)
    )
    prompts = cast("list[Prompt]", list(prompt) if is_batch else [prompt])  # as is_batch says
    if params is None or isinstance(params, SamplingParams):
        param_list = [params or SamplingParams()] * len(prompts)
    else:
        param_list = list(params)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
    return prompts, param_list, is_batch
