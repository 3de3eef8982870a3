"""A prompt of ids is taken as plain ints (NumPy integers too, bools not), each in
[0, 2**31), in one C pass; anything else is refused with one line saying what was
wrong and what is allowed."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.daemon.engine.prompts import MAX_TOKEN_ID, prompt_ids

VOCAB, MAX_LEN = 1000, 64


def ids_of(prompt):  # type: ignore[no-untyped-def]
    return prompt_ids(prompt, None, vocab_size=VOCAB, max_model_len=MAX_LEN)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "prompt",
    [
        [5, True],
        [0, 1, False],  # bools hide among ids that equal them
        (True,),
        [5, 1.0],
        [5, "7"],
        [5, b"7"],
        [5, None],
        [5, np.bool_(True)],
        [5, np.float32(2)],
        [5, [6]],
    ],
)
def test_other_element_types_are_refused(prompt) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="must be a string or a list of token ids"):
        ids_of(prompt)


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        ([5, -1], [-1]),
        ([5, MAX_TOKEN_ID], [MAX_TOKEN_ID]),
        ([5, 2**63, 6], [2**63]),  # past int64: the conversion's overflow, named all the same
        ([5, 2**64 + 1], [2**64 + 1]),
        ([5, np.uint64(2**63)], [2**63]),
        ([-(2**63) - 1, 7, -3], [-(2**63) - 1, -3]),
    ],
)
def test_ids_out_of_range_are_named(prompt, named) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="token ids must be in") as info:
        ids_of(prompt)
    assert str(info.value).endswith(f"got {named}")


def test_integers_of_any_type_become_plain_ints(rng: np.random.Generator) -> None:
    values = [*rng.integers(0, MAX_TOKEN_ID, 40).tolist(), 0, 1]
    kinds = [int, np.int64, np.int32, np.uint16, np.uint64, np.int8]
    top = {kind: MAX_TOKEN_ID if kind is int else int(np.iinfo(kind).max) for kind in kinds}
    prompt = [kind(v % top[kind]) for v, kind in zip(values, kinds * 7, strict=False)]
    for given in (prompt, tuple(prompt)):
        ids, array = ids_of(given)
        assert ids == [int(t) for t in prompt] and {type(t) for t in ids} == {int}
        assert array.dtype == np.int64 and array.tolist() == ids


def test_integer_subclasses_are_ids_too() -> None:
    """What Python takes as an index is an id (an IntEnum member, a 0-d NumPy integer
    array), as a plain int; a bool is not, whatever it subclasses."""
    import enum

    class Token(enum.IntEnum):
        BOS = 1
        FIVE = 5

    ids, array = ids_of([Token.FIVE, np.array(7), 9])
    assert ids == [5, 7, 9] and {type(t) for t in ids} == {int} and array.tolist() == ids
    with pytest.raises(ValueError, match="list of token ids"):
        ids_of([Token.BOS, True])
