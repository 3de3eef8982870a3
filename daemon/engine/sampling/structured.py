"""Structured outputs (vLLM's `structured_outputs`, OpenAI's `response_format`): an
answer held to a JSON schema, to any JSON object, to a regular expression, to one of a
list of strings, or to a grammar (Lark, or llama.cpp's GBNF), by keeping each step's
logits row to the tokens the grammar allows next. llguidance (PyPI) compiles the
grammar and computes each mask; the sampler applies it (penalties.TokenMask).

Guarantees:
- `StructuredOutput` is checked on construction (the kind, the spec's size and form);
  `Grammars.compile` refuses a spec llguidance cannot compile (ValueError, one line),
  before the request is queued.
- A token is drawn only from the tokens the grammar allows at its position, so the
  answer's tokens spell a prefix of a string of the grammar; the request ends ("stop")
  as soon as the grammar admits nothing more, or when the model ends it where the
  grammar accepts (an end-of-text token is allowed there only).
- The mask depends on the request's spec and its own tokens alone, so structured
  requests stay bit-identical batched, reused and as exact repeats; the logits and
  logprobs returned stay the raw model's.
- Every resource a spec can make the engine spend is bounded: the spec's size
  (MAX_SPEC_CHARS), a grammar's lexer (_MAX_LEXER_STATES: about 40 MB at most by
  llguidance's documented 1-2 KB a state), each mask's work (llguidance's default fuel:
  about 15 ms of host time at most by its documented rates), and the
  compiled grammars kept (MAX_COMPILED, least recently used dropped first).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....cuda.penalties import mask_words

log = logging.getLogger("reprise.engine")

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65_536  # a schema, regex, grammar or list of choices, as text
MAX_COMPILED = 64  # compiled grammars an engine keeps for reuse (n choices, repeats)
_MAX_LEXER_STATES = 20_000  # about 40 MB of lexer a grammar (llguidance's default: 250,000)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's answer must be: `kind` one of KINDS, and its `spec`:

    - "json": a JSON schema, as JSON text;
    - "json_object": any JSON object (spec "");
    - "regex": a regular expression the whole answer matches (Rust regex syntax);
    - "choice": one of a list of strings, the list as JSON text (`choice([...])`);
    - "grammar": a Lark grammar or a llama.cpp GBNF grammar (`root ::= ...`)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"structured output kind must be one of {', '.join(KINDS)}; got {self.kind!r:.40}"
            )
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string; got {self.spec!r:.40}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured output spec may have at most {MAX_SPEC_CHARS} characters; "
                f"got {len(self.spec)}"
            )
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("structured output json_object takes no spec (any JSON object)")
        elif not self.spec:
            raise ValueError(f"structured output {self.kind} needs a spec; got an empty one")
        if self.kind == "json":
            schema = _json(self.spec, "json schema")
            if not isinstance(schema, dict | bool):
                raise ValueError(f"json schema must be a JSON object; got {self.spec!r:.60}")
        if self.kind == "choice":
            options = _json(self.spec, "choice")
            if not (
                isinstance(options, list)
                and options
                and all(isinstance(o, str) and o for o in options)
            ):
                raise ValueError(
                    f"choice must be a non-empty list of non-empty strings; got {self.spec!r:.60}"
                )

    @classmethod
    def choice(cls, options: Iterable[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def of(cls, value: object) -> StructuredOutput:
        """A StructuredOutput, or the wire's [kind, spec] as one (ValueError otherwise)."""
        if isinstance(value, StructuredOutput):
            return value
        if (
            isinstance(value, list | tuple)
            and len(value) == 2
            and all(isinstance(v, str) for v in value)
        ):
            return cls(value[0], value[1])
        raise ValueError(
            f"structured must be [kind, spec] (two strings; kind one of {', '.join(KINDS)}); "
            f"got {value!r:.60}"
        )

    def to_wire(self) -> list[str]:
        return [self.kind, self.spec]

    def validate(self) -> None:
        """ValueError (one line) unless llguidance compiles this spec; needs no vocabulary,
        so a front end can refuse a bad spec before it reaches the engine."""
        import llguidance

        if error := llguidance.LLMatcher.validate_grammar(self.grammar_text()):
            raise ValueError(f"structured output {self.kind}: {_first_line(error)}")

    def grammar_text(self) -> str:
        """llguidance's grammar of this spec (ValueError if it cannot be read)."""
        import llguidance

        matcher = llguidance.LLMatcher
        try:
            if self.kind == "json":
                return matcher.grammar_from_json_schema(self.spec)
            if self.kind == "json_object":
                return matcher.grammar_from_json_schema('{"type": "object"}')
            if self.kind == "regex":
                return matcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                options = json.loads(self.spec)
                return matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options)))
            return llguidance.grammar_from("grammar", self.spec)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"structured output {self.kind}: {_first_line(e)}") from None


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON: {_first_line(e)}") from None


def _first_line(error: object) -> str:
    """An error's message as one line of at most 300 characters."""
    text = " ".join(str(error).split())
    return text[:300] if text else type(error).__name__


class Grammar:
    """One request's place in its grammar: the mask of its next token, and its tokens
    taken in as they are drawn."""

    __slots__ = ("_eos_ids", "_matcher", "_num_words", "ended")

    def __init__(self, matcher: Any, num_words: int, eos_ids: list[int]) -> None:
        """`num_words`: ceil(vocab / 32), the mask's width (llguidance's own mask from
        `compute_bitmask` may hold a word more)."""
        self._matcher = matcher
        self._num_words = num_words
        self._eos_ids = eos_ids
        self.ended = False  # the grammar admits nothing more (or failed): the request ends

    def mask(self) -> np.ndarray:
        """[ceil(vocab / 32)] uint32: bit t % 32 of word t // 32 set when token t may come
        next. A grammar that fails here (a limit hit) keeps the end-of-text tokens alone,
        and the request ends after this token."""
        return self._checked(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32))

    def _checked(self, words: np.ndarray) -> np.ndarray:
        """llguidance's mask `words` cut to the vocabulary's, or the end-of-text tokens
        alone if the matcher failed computing it."""
        if self._matcher.is_error():
            self._fail("computing the next token's mask")
            words = np.zeros(self._num_words, np.uint32)
            for token in self._eos_ids:
                words[token >> 5] |= np.uint32(1 << (token & 31))
        return words[: self._num_words]

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces next (the only one each's mask allows,
        so each is drawn, unless another tokenizing of the same text is allowed too)."""
        if self.ended or limit < 1:
            return []
        return list(self._matcher.compute_ff_tokens()[:limit])

    def taken(self, tokens: list[int]) -> list[int]:
        """The longest start of `tokens` the grammar takes from its place."""
        if self.ended or not tokens:
            return []
        return tokens[: self._matcher.validate_tokens(tokens)]

    def masks_with_draft(self, draft: list[int]) -> np.ndarray:
        """[len(draft) + 1, ceil(vocab / 32)] uint32: the next token's mask, then the mask
        after each draft token in turn (a draft the grammar takes: `forced` or `taken`);
        the grammar's place is unchanged."""
        # every bit set where llguidance writes nothing (past a token it would refuse:
        # rows no sample is kept from)
        words = np.full((len(draft) + 1, self._num_words), 0xFFFFFFFF, np.uint32)
        _executor().unsafe_compute_mask_ptr_with_draft_token(
            [(self._matcher, 0, list(draft))], words.ctypes.data, words.strides[0], len(words)
        )
        for row in words:
            row[:] = self._checked(row)
        return words

    def accept(self, token: int) -> None:
        """Take in a drawn token; `ended` when the grammar admits nothing after it."""
        if self.ended:
            return
        if not self._matcher.consume_token(token):
            self._fail(f"taking token {token}")
        elif self._matcher.is_stopped():
            self.ended = True

    def _fail(self, doing: str) -> None:
        log.warning(
            "structured output failed %s (%s); the answer ends here",
            doing,
            _first_line(self._matcher.get_error()),
        )
        self.ended = True


def fill_masks(grammars: list[Grammar], words: np.ndarray) -> None:
    """Row i of `words` ([len(grammars), ceil(vocab / 32)] uint32, C-contiguous) becomes
    grammars[i]'s next mask (`Grammar.mask`); more than one are computed in parallel, on
    llguidance's own threads (its executor: 80 % of the CPUs, up to 32), straight into
    `words`."""
    if len(grammars) == 1:
        words[0] = grammars[0].mask()
        return
    assert words.dtype == np.uint32 and words.flags.c_contiguous, (words.dtype, words.flags)
    targets = [(g._matcher, i) for i, g in enumerate(grammars)]
    _executor().unsafe_compute_mask_ptr(targets, words.ctypes.data, words.strides[0], len(grammars))
    for i, grammar in enumerate(grammars):
        words[i] = grammar._checked(words[i])


_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


class Grammars:
    """An engine's structured-output compiler: its vocabulary for llguidance (built on
    first use, about 0.2 s for 49,152 tokens) and the grammars it compiled, kept for reuse.
    Safe on any thread."""

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Iterable[int]
    ) -> None:
        """`tokenizer_json`: the model's tokenizer as tokenizers' JSON, asked for on
        first use."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_ids = sorted(t for t in eos_ids if t < vocab_size)
        self._tokenizer: Any = None
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos_ids
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec` (an llguidance matcher at its start), from the
        cache or compiled now; ValueError naming what is wrong if it does not compile."""
        with self._lock:
            if (matcher := self._compiled.get(spec)) is not None:
                self._compiled.move_to_end(spec)
                return matcher
        import llguidance

        tokenizer = self._llg_tokenizer()
        limits = llguidance.LLParserLimits(max_lexer_states=_MAX_LEXER_STATES, verbose_errors=False)
        matcher = llguidance.LLMatcher(tokenizer, spec.grammar_text(), log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"structured output {spec.kind}: {_first_line(matcher.get_error())}")
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def start(self, spec: StructuredOutput) -> Grammar:
        """A fresh Grammar of `spec` for one request (ValueError as `compile`)."""
        return Grammar(self.compile(spec).deep_copy(), mask_words(self._vocab_size), self._eos_ids)
