"""A reasoning model's thinking told apart from its answer (vLLM's `--reasoning-parser`):
a chat answer's thinking comes back as the message's `reasoning_content` (and
`reasoning`, vLLM's newer name), the rest as its `content`.

- "qwen3" (Qwen3, QwQ): the model opens its thinking with `<think>` and closes it with
  `</think>`; an answer that does not begin with `<think>` (Qwen3 with `enable_thinking:
  false`, whose prompt holds an empty pair) is all content.
- "deepseek_r1" (DeepSeek-R1 and its distills): the template opens `<think>` in the
  prompt, so the answer is thinking from its start (a `<think>` the model writes anyway
  is dropped) up to `</think>`.

Decided where vLLM's parsers differ between a whole and a streamed answer: thinking cut
short (no `</think>` before the end) is reasoning with no content in both, and text
before qwen3's `<think>` makes the answer all content.

Guarantee: streamed, `ReasoningStream` lets out no text before it knows which side it is
on, so the reasoning and content streamed join to `split`'s of the whole answer.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
THINK, END = "<think>", "</think>"


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for a side it does not have."""
    reasoning, content = _split(parser, text, final=True)
    return reasoning or None, content or None


def _split(parser: str, text: str, *, final: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of the answer so far; before the end (not `final`), a
    qwen3 answer that may still begin with `<think>` is neither yet, and the text that
    may begin `</think>` is held back."""
    head = text.lstrip()
    if head.startswith(THINK):
        body = head[len(THINK) :]
    elif parser == "deepseek_r1" and (final or not THINK.startswith(head)):
        body = text
    elif final or not THINK.startswith(head):  # qwen3, and no `<think>` can come
        return None, text
    else:
        return None, ""  # undecided: it may yet be `<think>`
    end = body.find(END)
    if end >= 0:
        return body[:end], body[end + len(END) :]
    if not final:  # hold back what may begin `</think>`
        for keep in range(min(len(END) - 1, len(body)), 0, -1):
            if END.startswith(body[-keep:]):
                body = body[:-keep]
                break
    return body, ""


class ReasoningStream:
    """One streamed answer's deltas, each as the (reasoning, content) pieces it lets out,
    which join to `split`'s of the whole answer."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = [0, 0]  # characters of the reasoning and of the content already out

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The new reasoning and content once `delta` is added (`final`: the answer ended)."""
        self.text += delta
        reasoning, content = _split(self.parser, self.text, final=final)
        pieces = []
        for i, whole in enumerate((reasoning or "", content)):
            pieces.append(whole[self.sent[i] :])
            self.sent[i] = max(self.sent[i], len(whole))
        return pieces[0], pieces[1]
