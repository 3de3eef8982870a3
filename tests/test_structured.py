"""Structured outputs (vLLM's structured_outputs): an answer held to a regex, a list of
choices, a grammar (Lark and GBNF), a JSON schema or any JSON object, on a tiny random
Llama and the NumPy backend (whose random logits would wander anywhere unmasked).

Each answer is checked by an independent reader (Python's `re`, `json`); each token is
the argmax (greedy) of its raw row with the tokens the grammar forbids at -inf, the mask
replayed by a fresh matcher; the request ends where the grammar admits nothing more;
tokens, logits and logprobs are bit-identical alone, batched with traffic, through the
padded decode path, reused and as an exact repeat; bad specs are refused in one line
before anything is queued, on the engine and on the wire."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_sampling_engine import PROMPTS, add_traffic, assert_identical, engine

from reprise.cuda.penalties import TokenMask, apply_token_mask_ref, mask_words
from reprise.daemon import Engine, SamplingParams, StructuredOutput
from reprise.daemon.engine.sampling import structured
from reprise.daemon.model.synth import synth_model
from reprise.ipc.client import generate_message
from reprise.ipc.codec import decode_request, encode
from reprise.ipc.messages import Generate, ProtocolError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    # llguidance's option (vLLM's disable_any_whitespace): a random model would otherwise
    # fill max_tokens with the whitespace JSON allows between tokens
    "x-guidance": {"whitespace_flexible": False},
}
WS = "[ \t\r\n]*"  # JSON's whitespace, which the grammar lets the model put between tokens
SCHEMA_RE = (
    rf"\{{{WS}\"name\"{WS}:{WS}\"[^\"\\\\]{{0,6}}\"{WS},{WS}\"age\"{WS}:{WS}(0|[1-9][0-9]?)"
    rf"({WS},{WS}\"tags\"{WS}:{WS}\[{WS}(\"[ab]\"({WS},{WS}\"[ab]\")?)?{WS}\])?{WS}\}}"
)

# (spec, a reader of the finished answer independent of llguidance)
CASES = {
    "regex": (StructuredOutput("regex", r"(yes|no)-[0-9]{3}"), r"(yes|no)-[0-9]{3}"),
    "choice": (StructuredOutput.choice(["red", "green", "blue"]), r"red|green|blue"),
    "lark": (
        StructuredOutput("grammar", 'start: "<" item item? item? ">"\nitem: "ab" | "c"'),
        r"<(ab|c){1,3}>",
    ),
    "gbnf": (StructuredOutput("grammar", 'root ::= "id=" [0-9] [0-9] ";"'), r"id=[0-9][0-9];"),
    "json": (StructuredOutput("json", json.dumps(SCHEMA)), SCHEMA_RE),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("structured") / "tiny")


def params(spec: StructuredOutput, **kw: object) -> SamplingParams:
    kw = {"max_tokens": 60, "temperature": 0, "return_logits": True, **kw}
    return SamplingParams(structured=spec, **kw)  # type: ignore[arg-type]


def replayed_masks(eng: Engine, spec: StructuredOutput, tokens: list[int]) -> list[np.ndarray]:
    """The mask of each token's position, from a fresh matcher fed the tokens before it."""
    grammar = eng.grammars.start(spec)
    masks = []
    for token in tokens:
        masks.append(grammar.mask().copy())
        grammar.accept(token)
    return masks


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_the_answer_is_in_the_grammar_and_ends_with_it(
    tiny: Path, name: str, temperature: float
) -> None:
    spec, pattern = CASES[name]
    eng = engine(tiny)
    for prompt in PROMPTS:
        done = eng.generate(prompt, params(spec, temperature=temperature, seed=7))
        assert done.finish_reason == "stop", (name, done.text)  # the grammar ended it
        assert re.fullmatch(pattern, done.text, flags=re.DOTALL), (name, done.text)
        if name == "json":
            answer = json.loads(done.text)
            assert set(answer) >= {"name", "age"} and isinstance(answer["age"], int)
        free = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=temperature, seed=7))
        assert not re.fullmatch(pattern, free.text, flags=re.DOTALL)  # the mask did it


@pytest.mark.parametrize("name", ["regex", "json"])
def test_each_greedy_token_is_the_argmax_of_its_masked_raw_row(tiny: Path, name: str) -> None:
    spec = CASES[name][0]
    eng = engine(tiny)
    done = eng.generate(PROMPTS[0], params(spec, logprobs=2))
    rows = np.stack(done.logits)
    vocab = rows.shape[1]
    masks = replayed_masks(eng, spec, done.token_ids)
    masked = rows.copy()
    apply_token_mask_ref(masked, TokenMask(np.stack(masks)))
    assert [int(t) for t in np.argmax(masked, axis=1)] == done.token_ids
    allowed = np.unpackbits(np.stack(masks).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    assert allowed.sum(axis=1).min() < vocab  # the grammar did narrow the rows
    assert any(int(np.argmax(rows[i])) != t for i, t in enumerate(done.token_ids))
    # the logprobs are the raw rows', not the masked ones'
    for row, lp in zip(rows, done.logprobs, strict=True):
        shifted = row.astype(np.float64) - row.max()
        want = shifted[lp.token_id] - np.log(np.exp(shifted).sum())
        assert lp.logprob == pytest.approx(want, abs=1e-4)


def test_bits_are_the_same_alone_batched_padded_reused_and_repeated(tiny: Path) -> None:
    specs = [CASES["json"][0], CASES["regex"][0], CASES["lark"][0]]
    kinds = [{"logprobs": 3}, {"temperature": 0.8, "seed": 11}, {"temperature": 0.9, "seed": 2}]
    prompts = [PROMPTS[0][:32], PROMPTS[1][:32], PROMPTS[1][:48]]  # whole blocks
    want = [
        engine(tiny, enable_reuse=False).generate(p, params(s, **k))
        for p, s, k in zip(prompts, specs, kinds, strict=True)
    ]
    eng = engine(tiny, cuda_graphs=True)
    for _ in range(2):  # computed, then each an exact repeat
        traffic = add_traffic(eng, lambda i, rng: {})
        ids = [eng.add_request(p, params(s, **k)) for p, s, k in zip(prompts, specs, kinds, strict=True)]  # fmt: skip
        while eng.has_work():
            eng.step()
        assert_identical([eng.take_completion(r) for r in ids], want)
        for r in traffic:
            eng.take_completion(r)
    assert eng.runner.decode is not None and eng.runner.decode.steps > 0
    assert eng.stats()["exact_repeats"] >= 3  # ours, and the traffic's whole-block prompts


def test_masks_computed_in_parallel_are_each_grammars_own(tiny: Path) -> None:
    """fill_masks (llguidance's threads, for a step with several structured rows) gives
    each row the mask its grammar gives alone, step after step."""
    eng = engine(tiny)
    specs = [CASES[name][0] for name in sorted(CASES)]
    alone = [eng.grammars.start(spec) for spec in specs]
    together = [eng.grammars.start(spec) for spec in specs]
    rng = np.random.default_rng(3)
    for _ in range(4):
        words = np.empty((len(specs), mask_words(eng.config.vocab_size)), np.uint32)
        structured.fill_masks(together, words)
        want = np.stack([g.mask() for g in alone])
        assert np.array_equal(words, want)
        for row, a, b in zip(want, alone, together, strict=True):
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            token = int(rng.choice(allowed))  # any token the grammar allows here
            a.accept(token)
            b.accept(token)


def test_n_choices_each_hold_to_the_grammar(tiny: Path) -> None:
    spec, pattern = CASES["gbnf"]
    outs = engine(tiny).generate(PROMPTS[0], params(spec, temperature=1.0, seed=3, n=4))
    assert len(outs) == 4 and len({o.text for o in outs}) > 1
    assert all(re.fullmatch(pattern, o.text) for o in outs)


def test_a_grammar_that_accepts_and_goes_on_ends_at_eos_or_max_tokens(tiny: Path) -> None:
    """`[a-c]+` accepts after each letter: eos is allowed there (and ends it), and with
    ignore_eos an eos drawn ends it too (the grammar takes nothing after eos)."""
    eng = engine(tiny)
    spec = StructuredOutput("regex", "[a-c]+")
    eos = sorted(eng.stop_token_ids)
    up, down = dict.fromkeys(eos, 100.0), dict.fromkeys(eos, -100.0)
    done = eng.generate(PROMPTS[0], params(spec, max_tokens=6, logit_bias=up))
    assert done.finish_reason == "stop" and re.fullmatch("[a-c]", done.text)  # then eos
    assert len(done.token_ids) == 2 and done.token_ids[-1] in eos
    held = eng.generate(PROMPTS[0], params(spec, max_tokens=6, min_tokens=4, logit_bias=up))
    assert re.fullmatch("[a-c]{4}", held.text) and held.finish_reason == "stop"
    capped = eng.generate(PROMPTS[0], params(spec, max_tokens=5, logit_bias=down))
    assert capped.finish_reason == "length" and re.fullmatch("[a-c]{5}", capped.text)
    ignoring = eng.generate(PROMPTS[0], params(spec, max_tokens=6, ignore_eos=True, logit_bias=up))
    assert ignoring.finish_reason == "stop" and ignoring.token_ids[-1] in eos


def test_a_failing_grammar_keeps_eos_alone_and_ends_the_answer(tiny: Path) -> None:
    class Failing:  # an llguidance matcher whose limits ran out on the second mask
        def __init__(self) -> None:
            self.calls = 0

        def compute_bitmask(self) -> bytes:
            self.calls += 1
            return (b"\xff" if self.calls == 1 else b"\x00") * 4 * 32

        def is_error(self) -> bool:
            return self.calls > 1

        def get_error(self) -> str:
            return "step_lexer_fuel exhausted"

        def consume_token(self, token: int) -> bool:
            return True

        def is_stopped(self) -> bool:
            return False

    eng = engine(tiny)
    eos = sorted(eng.stop_token_ids)
    grammar = structured.Grammar(Failing(), 32, eos)
    assert grammar.mask().tolist() == [0xFFFFFFFF] * 32 and not grammar.ended
    words = grammar.mask()
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == eos and grammar.ended


def test_the_compiled_grammars_kept_are_bounded(tiny: Path, monkeypatch) -> None:
    monkeypatch.setattr(structured, "MAX_COMPILED", 3)
    eng = engine(tiny)
    for i in range(5):
        eng.grammars.compile(StructuredOutput("regex", f"x{{{i}}}"))
    assert len(eng.grammars._compiled) == 3


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (["yaml", "a: 1"], "kind must be one of json, json_object, regex, choice, grammar"),
        (["regex", ""], "structured output regex needs a spec"),
        (["json_object", "{}"], "json_object takes no spec"),
        (["json", "{not json"], "json schema is not valid JSON"),
        (["json", "[1, 2]"], "json schema must be a JSON object"),
        (["choice", "[]"], "choice must be a non-empty list of non-empty strings"),
        (["choice", '["a", 3]'], "choice must be a non-empty list"),
        (["regex", "x" * 70_000], "at most 65536 characters"),
        ("json", r"structured must be \[kind, spec\]"),
        (["json"], r"structured must be \[kind, spec\]"),
    ],
)
def test_a_bad_spec_is_refused_on_construction(spec: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SamplingParams(structured=spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutput("regex", "[a-z"), "structured output regex: .*unclosed character class"),
        (StructuredOutput("json", '{"type": "strong"}'), "structured output json: .*strong"),
        (StructuredOutput("grammar", "start: foo"), "structured output grammar: .*foo"),
        (StructuredOutput("grammar", "root ::= [a-"), "structured output grammar"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_before_it_is_queued(
    tiny: Path, spec: StructuredOutput, says: str
) -> None:
    eng = engine(tiny)
    with pytest.raises(ValueError, match=says) as refused:
        eng.add_request(PROMPTS[0], SamplingParams(structured=spec))
    assert "\n" not in str(refused.value)
    assert not eng.has_work() and eng.pool.num_free_blocks == eng.pool.num_blocks


def test_the_wire_carries_a_spec_and_refuses_a_bad_one() -> None:
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    message = generate_message("hi", stream=False, structured=spec)
    back = decode_request(encode(message))
    assert isinstance(back, Generate) and back.sampling["structured"] == ["json", spec.spec]
    assert SamplingParams(**back.sampling).structured == spec
    for bad, says in [("json", "sampling.structured must be"), (["json", 3], r"sampling.structured\[\]")]:  # fmt: skip
        with pytest.raises(ProtocolError, match=says):
            Generate(id="x", prompt="hi", sampling={"structured": bad})
