"""The daemon detokenizes off the engine loop (issue 19): the engine runs every request
with `detokenize=False` and no stop strings, ending it on token ids alone, and the
daemon's detokenizing thread makes the text, applies the stop strings and has the loop
cancel a request one ends. Tokens, text, deltas and finish reasons are those of
`Engine.generate` with the same stop strings, in process and through a real daemon."""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_daemon import BLOCK_SIZE, Daemon, wait_idle

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.synth import synth_model
from reprise.daemon.serve.detokenize import Detokenizing
from reprise.ipc import Done, TokenChunk

PROMPT_TEXT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("detok") / "tiny")


@pytest.fixture(scope="module")
def engine(tiny: Path) -> Engine:
    # the daemon's block size: logits are bit-identical for a given one (DESIGN §4)
    return Engine.from_pretrained(tiny, backend="numpy", num_device_blocks=64,
                                  block_size=BLOCK_SIZE)  # fmt: skip


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
        {
            "max_tokens": 24,
            "temperature": 0,
            "stop_token_ids": [300],
            "logit_bias": {300: 9.0},
            "skip_special_tokens": False,
        },
        {
            "max_tokens": 24,
            "temperature": 0,
            "stop_token_ids": [300],
            "logit_bias": {300: 9.0},
            "include_stop_str_in_output": True,
        },
    ],
)
def test_same_tokens_finish_and_text_off_the_loop(engine: Engine, sampling: dict) -> None:
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    on_outputs, on = run(engine, prompt, SamplingParams(**sampling))
    off_outputs, off = run(engine, prompt, SamplingParams(**sampling, detokenize=False))
    assert off.token_ids == on.token_ids and off.finish_reason == on.finish_reason
    assert off.text == "" and [o.finish_reason for o in off_outputs] == [
        o.finish_reason for o in on_outputs
    ]
    text = Detokenizing(engine.tokenizer)
    chunks: list[str] = []
    ends: list[object] = []
    text.open(0, prompt, SamplingParams(**sampling).skip_special_tokens)
    for output in off_outputs:
        text.push(0, output.token_ids, finish_reason=output.finish_reason,
                  then=lambda delta, n: chunks.append(delta), stop_token=output.stop_token)  # fmt: skip
    text.close(0, then=ends.append)
    text.shutdown()
    assert chunks == [o.text_delta for o in on_outputs]
    assert [e.text for e in ends] == [on.text] and not ends[0].stopped


def stop_cases(engine: Engine) -> list[tuple[str, list[int], dict]]:
    """Stop-string requests built from what the tiny model says without them (its text is
    byte noise: many tokens add no text, some complete two characters at once)."""
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    base = {"max_tokens": 24, "temperature": 0}
    outputs, plain = run(engine, prompt, SamplingParams(**base))
    deltas = [o.text_delta for o in outputs]
    # a token that completes two characters or more, after some text: a stop ending on
    # its first character ends inside the token's text
    mid = next(i for i, d in enumerate(deltas) if len(d) >= 2 and "".join(deltas[:i]))
    before = "".join(deltas[:mid])
    mid_stop = before[-1:] + deltas[mid][0]
    # a seed whose first token brings text: a stop on it ends at the first token
    for seed in range(200):
        first_params = {"max_tokens": 8, "temperature": 1.0, "seed": seed}
        first_outputs, _ = run(engine, prompt, SamplingParams(**first_params))
        if first_outputs[0].text_delta:
            break
    first_stop = first_outputs[0].text_delta[0]
    text = plain.text
    assert len(text) >= 4, text
    four = text[-4:]
    never = "stop strings never found"
    assert never not in text
    return [
        ("mid_token", prompt, {**base, "stop": [mid_stop]}),
        ("first_token", prompt, {**first_params, "stop": [first_stop, never]}),
        # overlapping: one begins earlier but ends later; the earliest found wins
        ("overlap_ends_first", prompt, {**base, "stop": [four, four[1:3]]}),
        ("overlap_begins_first", prompt, {**base, "stop": [four[1:], four[:3]]}),
        ("never_found", prompt, {**base, "stop": [never]}),
        ("never_found_held_back", prompt, {**base, "stop": [text[-2:] + "\x00never"]}),
        # a stop and max_tokens on the same token: the stop string wins
        ("stop_and_length", prompt, {**base, "max_tokens": mid + 1, "stop": [mid_stop]}),
        # a stop token id and a stop string on the same token: the token id wins (no cut)
        ("stop_id_and_string", prompt,
         {**base, "stop": [mid_stop], "stop_token_ids": [plain.token_ids[mid]]}),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cases(engine: Engine) -> list[tuple[str, list[int], dict]]:
    return stop_cases(engine)


def test_stop_strings_off_the_loop_match_the_engine(engine: Engine, cases: list) -> None:
    """The thread's chunks (text and the tokens they carry), its final text and where it
    stops equal the engine's own stop-string handling, delta by delta, with the stop
    string cut off or kept (include_stop_str_in_output); the stop reason is the stop
    string, or the stop token id that ended it."""
    stopped = 0
    for (name, prompt, sampling), include in itertools.product(cases, (False, True)):
        params = SamplingParams(**sampling, include_stop_str_in_output=include)
        on_outputs, on = run(engine, prompt, params)
        text = Detokenizing(engine.tokenizer)
        chunks: list[tuple[str, list[int]]] = []
        ends: list = []
        request_id = engine.add_request(prompt, replace(params, stop=[], detokenize=False))
        text.open(request_id, prompt, params.skip_special_tokens, params.stop,
                  include_stop=include)  # fmt: skip
        while engine.has_work():
            for o in engine.step():
                then = functools.partial(_collect, chunks, o.token_ids)
                text.push(request_id, o.token_ids, finish_reason=o.finish_reason, then=then,
                          stop_token=o.stop_token)  # fmt: skip
            if request_id in _wait_stopped(text):  # as the loop: cancel it in the engine
                engine.cancel(request_id)
        off = engine.take_completion(request_id)
        text.close(request_id, then=ends.append)
        text.shutdown()
        [end] = ends
        assert [d for d, _ in chunks] == [o.text_delta for o in on_outputs], name
        assert [ids for _, ids in chunks] == [o.token_ids for o in on_outputs], name
        assert end.text == on.text, name
        assert off.token_ids[: end.num_tokens] == on.token_ids, name
        assert ("stop" if end.stopped else off.finish_reason) == on.finish_reason, name
        stopped += end.stopped
        assert end.stopped == (name not in ("never_found", "never_found_held_back",
                                            "stop_id_and_string")), name  # fmt: skip
        if end.stopped:
            assert end.stop_string == on.stop_reason and on.stop_reason in params.stop
            assert on.text.endswith(on.stop_reason) == include, name
        elif name == "stop_id_and_string":
            assert on.stop_reason == on.token_ids[-1] and on.finish_reason == "stop"
        else:
            assert on.stop_reason is None and off.stop_reason is None, name
    assert stopped >= 10


def _collect(chunks: list, token_ids: list[int], delta: str, num_tokens: int) -> None:
    chunks.append((delta, token_ids[:num_tokens]))


def _wait_stopped(text: Detokenizing) -> list[int]:
    """What the thread stopped, once it has caught up (the test, unlike the loop, waits)."""
    caught_up = threading.Event()
    text.then(caught_up.set)
    caught_up.wait(10)
    return text.take_stopped()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("detokd"), tiny)
    yield d
    d.stop()
    assert d.proc.returncode == 0


@pytest.mark.parametrize("stream", [True, False])
def test_stop_strings_through_the_daemon_match_engine_generate(
    engine: Engine, cases: list, daemon: Daemon, stream: bool
) -> None:
    """Through a real daemon, streaming or not: the same tokens, text (and the chunks'
    text joined), finish reason and usage as Engine.generate; the tokens the engine
    computed past a stop are never sent, and no block is left held."""
    with daemon.client() as client:
        for name, prompt, sampling in cases:
            on = engine.generate(prompt, SamplingParams(**sampling))
            if stream:
                replies = list(client.stream(prompt, **sampling))
                done = replies[-1]
                chunks = replies[:-1]
                assert all(isinstance(c, TokenChunk) for c in chunks), name
                assert "".join(c.text for c in chunks) == on.text, name
                assert [t for c in chunks for t in c.token_ids] == on.token_ids, name
            else:
                done = client.generate(prompt, **sampling)
            assert isinstance(done, Done), name
            assert done.token_ids == on.token_ids and done.text == on.text, name
            assert done.finish_reason == on.finish_reason, name
        stats = wait_idle(client)
    assert stats["used_blocks"] == 0 and stats["integrity"] == "ok"


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


def test_eos_is_no_stop_reason_a_stop_token_id_is(engine: Engine) -> None:
    """vLLM's stop_reason: None when eos ended the answer (or max_tokens did), the token
    id when a stop_token_ids token did, eos included once ignore_eos makes it one."""
    eos = min(engine.stop_token_ids)
    forced = {"max_tokens": 4, "temperature": 0.0, "logit_bias": {eos: 100.0}}
    _, by_eos = run(engine, [5, 6, 7], SamplingParams(**forced))
    assert by_eos.token_ids == [eos] and by_eos.finish_reason == "stop"
    assert by_eos.stop_reason is None
    listed = SamplingParams(**forced, stop_token_ids=[eos])  # eos is eos, listed or not
    assert run(engine, [5, 6, 7], listed)[1].stop_reason is None
    ignored = SamplingParams(**forced, stop_token_ids=[eos], ignore_eos=True)
    _, by_id = run(engine, [5, 6, 7], ignored)
    assert by_id.token_ids == [eos] and by_id.stop_reason == eos
    _, long = run(engine, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert long.finish_reason == "length" and long.stop_reason is None


def test_a_stop_tokens_text_is_left_out(engine: Engine) -> None:
    """vLLM's rule: the token (eos or a stop token id) that ends an answer adds no text,
    unless include_stop_str_in_output; eos's text with skip_special_tokens off too."""
    token = next(t for t in range(40, 250) if engine.tokenizer.decode([t]).strip().isalnum())
    piece = engine.tokenizer.decode([token])
    forced = {"max_tokens": 8, "temperature": 0.0, "logit_bias": {token: 100.0}}
    _, plain = run(engine, [5, 6, 7], SamplingParams(**forced))
    assert plain.token_ids == [token] * 8 and plain.text.endswith(piece)  # no stop: kept
    _, stopped = run(engine, [5, 6, 7], SamplingParams(**forced, stop_token_ids=[token]))
    assert stopped.token_ids == [token] and stopped.text == "" and stopped.finish_reason == "stop"
    kept = SamplingParams(**forced, stop_token_ids=[token], include_stop_str_in_output=True)
    assert run(engine, [5, 6, 7], kept)[1].text == piece
    eos = min(engine.stop_token_ids)
    by_eos = {"max_tokens": 4, "temperature": 0.0, "logit_bias": {eos: 100.0},
              "skip_special_tokens": False}  # fmt: skip
    assert engine.tokenizer.decode([eos], skip_special_tokens=False)
    _, ended = run(engine, [5, 6, 7], SamplingParams(**by_eos))
    assert ended.token_ids == [eos] and ended.text == ""
