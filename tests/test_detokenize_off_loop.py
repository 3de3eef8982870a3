"""Requests without stop strings are detokenized off the engine loop (issue 19): the
engine, with `detokenize=False`, ends them on the same token and with the same finish
reason, and the daemon's detokenizing thread streams the same text, chunk by chunk."""

from __future__ import annotations

import threading

import pytest

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.synth import synth_model
from reprise.daemon.serve.detokenize import Detokenizing


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = synth_model("tiny", tmp_path_factory.mktemp("detok") / "tiny")
    return Engine.from_pretrained(folder, backend="numpy", num_device_blocks=64)


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list, object]:
    request_id = engine.add_request(prompt, params)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs, engine.take_completion(request_id)


@pytest.mark.parametrize(
    "sampling",
    [
        {"max_tokens": 24, "temperature": 0},
        {"max_tokens": 24, "temperature": 1.0, "seed": 7, "skip_special_tokens": False},
        {"max_tokens": 24, "temperature": 1.0, "seed": 3, "stop_token_ids": [300, 301, 302]},
    ],
)
def test_same_tokens_finish_and_text_off_the_loop(engine: Engine, sampling: dict) -> None:
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")
    on_outputs, on = run(engine, prompt, SamplingParams(**sampling))
    off_outputs, off = run(engine, prompt, SamplingParams(**sampling, detokenize=False))
    assert off.token_ids == on.token_ids and off.finish_reason == on.finish_reason
    assert off.text == "" and [o.finish_reason for o in off_outputs] == [
        o.finish_reason for o in on_outputs
    ]
    text = Detokenizing(engine.tokenizer)
    chunks: list[str] = []
    whole: list[str] = []
    text.open(0, prompt, SamplingParams(**sampling).skip_special_tokens)
    for output in off_outputs:
        last = output.finish_reason is not None
        text.push(0, output.token_ids, last=last, then=chunks.append)
    text.close(0, then=whole.append)
    text.shutdown()
    assert chunks == [o.text_delta for o in on_outputs]
    assert whole == [on.text]


def test_stop_strings_need_the_text() -> None:
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_a_failing_reply_does_not_stop_the_thread(engine: Engine) -> None:
    text = Detokenizing(engine.tokenizer)
    ran = threading.Event()
    text.then(lambda: 1 / 0)
    text.then(ran.set)
    text.shutdown()
    assert ran.is_set()
