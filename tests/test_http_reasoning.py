"""`serve --reasoning-parser` through HTTP (the default model, NumPy backend): a chat
answer held by a regex to think first (`<think>...</think>` then text, as Qwen3 writes
it) comes back with its thinking as reasoning_content and the rest as content, whole and
streamed alike; separate_reasoning false, completions and the Responses API as vLLM's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
from http_support import served  # noqa: E402

pytestmark = pytest.mark.model

MODEL = "smol"
THINKING = {"structured_outputs": {"regex": "<think>[a-z ]{8,40}</think>[A-Za-z ]{4,30}"}}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator:
    with served(tmp_path_factory.mktemp("reasoning"), default_model_dir,
                "--served-model-name", MODEL, "--reasoning-parser", "qwen3") as d:  # fmt: skip
        yield d.openai()


def ask(api, **kw):
    return api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think, then answer: hi?"}],
        max_tokens=60, temperature=0, **kw,
    )  # fmt: skip


def test_the_thinking_comes_apart_whole_and_streamed(api) -> None:
    raw = ask(api, extra_body={**THINKING, "separate_reasoning": False}).choices[0].message
    assert raw.content.startswith("<think>") and "</think>" in raw.content
    assert raw.model_extra.get("reasoning_content") is None
    thought, answer = raw.content.removeprefix("<think>").split("</think>")
    message = ask(api, extra_body=THINKING).choices[0].message
    assert message.model_extra["reasoning_content"] == thought == message.model_extra["reasoning"]
    assert message.content == answer
    chunks = list(ask(api, stream=True, extra_body=THINKING))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    # no delta carries both sides of the tag: the thinking comes before any content
    sides = [bool(d.content) for d in deltas if d.content or d.model_extra.get("reasoning_content")]
    assert sides == sorted(sides) and sides[0] is False and sides[-1] is True


def test_completions_keep_the_text_and_responses_give_a_reasoning_item(api) -> None:
    done = api.completions.create(model=MODEL, prompt="Think:", max_tokens=30, temperature=0,
                                  extra_body=THINKING)  # fmt: skip
    assert done.choices[0].text.startswith("<think>")  # completions are not parsed
    message = ask(api, extra_body=THINKING).choices[0].message
    for stream in (False, True):
        kw = {"model": MODEL, "input": "Think, then answer: hi?", "max_output_tokens": 60,
              "temperature": 0, "extra_body": THINKING}  # fmt: skip
        if stream:
            events = list(api.responses.create(**kw, stream=True))
            r = events[-1].response
        else:
            r = api.responses.create(**kw)
        reasoning, text = r.output
        assert reasoning.type == "reasoning"
        assert reasoning.content[0].text == message.model_extra["reasoning_content"]
        assert text.type == "message" and r.output_text == message.content
