"""vLLM's reasoning parsers (daemon/serve/reasoning_parsers.py): a whole answer split into
its thinking and its content, and the same answer streamed in any pieces giving the same
two texts (no piece of a tag ever let out on the wrong side)."""

from __future__ import annotations

import random

import pytest

from reprise.daemon.serve.reasoning_parsers import PARSERS, ReasoningStream, split


@pytest.mark.parametrize(
    ("parser", "text", "want"),
    [
        ("qwen3", "<think>plan</think>answer", ("plan", "answer")),
        ("qwen3", "\n<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
        ("qwen3", "no thinking at all", (None, "no thinking at all")),
        ("qwen3", "text first <think>x</think>y", (None, "text first <think>x</think>y")),
        ("qwen3", "<think>cut short by max_tokens", ("cut short by max_tokens", None)),
        ("qwen3", "<think></think>only content", (None, "only content")),
        ("qwen3", "<think>all thought</think>", ("all thought", None)),
        ("qwen3", "", (None, None)),
        ("deepseek_r1", "plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", "<think>plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", "never closed", ("never closed", None)),
        ("deepseek_r1", "</think>content", (None, "content")),
        ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_a_whole_answer_splits(parser: str, text: str, want: tuple) -> None:
    assert split(parser, text) == want


PIECES = ["<think>", "</think>", "<", "</", "</th", "<thi", "think", ">", " ", "\n", "plan",
          "answer", "a<b", "x"]  # fmt: skip


@pytest.mark.parametrize("parser", PARSERS)
def test_streamed_pieces_join_to_the_whole_split(parser: str) -> None:
    """Random answers from tag pieces and words, cut into random chunks: the reasoning
    and content streamed join to split's, and none is let out on the wrong side."""
    rng = random.Random(parser)
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        stream, got = ReasoningStream(parser), ["", ""]
        at = 0
        while at < len(text):
            step = rng.randint(1, 4)
            for i, piece in enumerate(stream.push(text[at : at + step])):
                got[i] += piece
            at += step
        for i, piece in enumerate(stream.push("", final=True)):
            got[i] += piece
        reasoning, content = split(parser, text)
        assert got == [reasoning or "", content or ""], (text, got)
