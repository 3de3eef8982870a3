"""A request's sampling settings (SamplingParams), validated on construction: a bad
value fails here, naming the field and the allowed range, before anything runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .bad_words import check_bad_words
from .structured import StructuredOutput

MAX_SEED = 2**64
MAX_LOGPROBS = 20  # top alternatives a token may return, as OpenAI's and vLLM's
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_CHOICES = 16  # `n`: completions one request may ask for
MAX_ABS_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100], as OpenAI's
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one request may bias
MAX_ALLOWED_TOKEN_IDS = 32768  # tokens one request's allowed_token_ids may name


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings of one request, validated on construction.

    temperature 0 is greedy (ties go to the lowest id). `seed` keys a
    counter-based generator with the token position, so a seeded request
    draws the same tokens whatever it is batched with; without a seed the
    engine picks one at random per request.

    Penalties (OpenAI's and vLLM's semantics) change the logits row before
    temperature, top-k, top-p and the greedy argmax: `repetition_penalty` (> 0, 1 =
    off) divides a positive logit, or multiplies a negative one, of every token seen
    in the prompt or the output; `frequency_penalty` and `presence_penalty` (in
    [-2, 2], 0 = off) subtract `frequency * count + presence` from the logit of every
    token generated `count > 0` times.

    `logprobs` (None = off; 0 to 20) returns, with each token, its log-probability
    and that many most likely alternatives. As vLLM's default, these are the raw
    model's: log_softmax of the logits row the token was drawn from, before
    penalties and temperature.

    `prompt_logprobs` (None = off; 0 up to the engine's max_prompt_logprobs) returns,
    with the completion, each prompt token's log-probability given the tokens before
    it (the first token's is None) and that many most likely tokens there, for cached
    and computed prompt tokens alike (prompt_logprobs.py).

    `min_p` (vLLM's; in [0, 1], 0 = off) keeps only the tokens whose probability, after
    temperature, is at least min_p times the most likely token's; top-k and top-p then
    cut what it kept (the three cuts are prefixes of one ranking, so their order does not
    matter but for top-p's mass, taken over what min_p and top-k kept, as vLLM's).

    `n` (1 to 16) asks for that many completions of the prompt. Each is a request of
    its own to the scheduler (`choice(i)`), so the prompt's full blocks are computed
    once and the other choices reuse them; a seeded request's choice i draws with
    seed + i (mod 2**64), as vLLM's, so the choices differ and each repeats.

    `min_tokens` (vLLM's; 0 to max_tokens) keeps a request from ending before it has
    that many tokens: until then its stop tokens (eos unless `ignore_eos`, and
    `stop_token_ids`) have their logits at -inf, and stop strings are looked for from the
    min_tokens-th token on.

    `logit_bias` ({token id: bias}, OpenAI's; at most 1,024 tokens, each bias in
    [-100, 100]) adds each bias to its token's logit before the penalties (vLLM's
    order), so -100 all but bans a token and +100 all but forces it. Logprobs stay the
    raw model's.

    `allowed_token_ids` (vLLM's; 1 to 32,768 ids, or None for all) lets a request draw
    only these tokens: every other logit is -inf before sampling and the greedy argmax
    (not with `structured`, whose grammar masks the row already). Logprobs stay the raw
    model's.

    `bad_words` (vLLM's; at most 128 words of 1 to 256 characters) keeps these words out
    of the answer: their tokens, as the word begins a text or follows a space, are banned
    where they would complete one (bad_words.py). Logprobs stay the raw model's.
    Where allowed_token_ids or a grammar admit only tokens bad_words ban (or min_tokens
    holds back), no token can come next: allowed_token_ids all banned from the first token
    are refused when the request is added; a request that meets such a place later ends
    there, finish reason "error", its Completion's `error` saying why.

    `structured` (vLLM's structured_outputs) holds the answer to a JSON schema, any JSON
    object, a regular expression, one of a list of strings or a grammar
    (structured.StructuredOutput; the wire's [kind, spec] is taken too): each token is
    drawn from those the grammar allows next, and the request ends when the grammar
    admits nothing more. Logprobs stay the raw model's.

    `truncate_prompt_tokens` (vLLM's; None, or >= 1) keeps only the prompt's last that
    many tokens (a longer prompt is cut from the left, before its length is checked), so
    the completion's prompt is those tokens.

    `include_stop_str_in_output` (vLLM's; False) keeps the stop string that ended the
    answer at the end of its text, rather than cutting the text where it begins.

    `detokenize` False (as vLLM's) leaves the text to the caller: the engine tracks
    token ids only, and `text` stays empty. Stop strings need the text, so they need it on.

    `embed` (False) also returns the prompt's embedding (Completion.embedding): the final
    norm's output at its last token, fp32 [hidden], not normalized (last-token pooling,
    as Qwen3-Embedding, E5-Mistral and GTE-Qwen2 pool; the OpenAI API's /v1/embeddings
    normalizes it). With its prefix cached or not the bits are the same; an exact repeat
    takes it from the logits cache, where it is kept beside the prompt's logits row, and a
    prompt whose logits row alone is stored (from a generation) computes its last token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_logits: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    detokenize: bool = True
    prompt_logprobs: int | None = None
    n: int = 1
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured: StructuredOutput | None = None
    embed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_int("max_tokens", self.max_tokens, low=1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number >= 0; got {self.temperature!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(
                f"temperature must be finite and >= 0 (0 = greedy); got {self.temperature!r}"
            )
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, int | float)
            or not 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off); got {self.min_p!r}")
        if self.top_k is not None:
            check_int("top_k", self.top_k, low=1, hint=" or None (no limit)")
        if self.seed is not None:
            check_int("seed", self.seed, low=0, high=MAX_SEED - 1)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop must be a non-empty string or a list of them; got {self.stop!r}"
            )
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(
                f"stop_token_ids must be a list of token ids; got {self.stop_token_ids!r}"
            )
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids[]", token_id, low=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(
                    f"{name} must be a number in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}] "
                    f"(0 = off); got {value!r}"
                )
        rep = self.repetition_penalty
        if not _is_number(rep) or not 0 < rep < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off); got {rep!r}"
            )
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS, hint=" or None (off)")
        if self.prompt_logprobs is not None:  # the engine checks the upper bound, its setting
            check_int("prompt_logprobs", self.prompt_logprobs, low=0, hint=" or None (off)")
        check_int("n", self.n, low=1, high=MAX_CHOICES)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens,
                  hint=" (at most max_tokens)")  # fmt: skip
        if self.structured is not None:
            self.structured = StructuredOutput.of(self.structured)
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1,
                      hint=" or None (the whole prompt)")  # fmt: skip
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, list) or not 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(
                    f"allowed_token_ids must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids "
                    f"or None; got {allowed!r:.60}"
                )
            for token_id in self.allowed_token_ids:
                check_int("allowed_token_ids[]", token_id, low=0)
            if self.structured is not None:
                raise ValueError(
                    "allowed_token_ids cannot be combined with structured outputs (the grammar "
                    "says which tokens may come)"
                )
        self.bad_words = check_bad_words(self.bad_words)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                "include_stop_str_in_output must be a bool; "
                f"got {self.include_stop_str_in_output!r}"
            )
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool; got {self.detokenize!r}")
        if not isinstance(self.embed, bool):
            raise ValueError(f"embed must be a bool; got {self.embed!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need the text: detokenize must be on to use stop")

    def choice(self, index: int) -> SamplingParams:
        """The settings of choice `index` of `n`: one completion, seeded seed + index."""
        check_int("choice index", index, low=0, high=self.n - 1)
        seed = None if self.seed is None else (self.seed + index) % MAX_SEED
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the defaults leave the logits untouched)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def check_int(
    name: str, value: object, *, low: int, high: int | None = None, hint: str = ""
) -> None:
    """Raise ValueError naming `name` unless `value` is an integer in [low, high]."""
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    ok = ok and low <= value and (high is None or value <= high)  # type: ignore[operator]
    if not ok:
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {allowed}{hint}; got {value!r}")


def _logit_bias(bias: object) -> dict[int, float] | None:
    """A logit_bias as plain {int: float} (None when empty), or ValueError naming what
    is wrong. The engine checks the ids against its vocabulary."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias; got {bias!r:.60}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(
            f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens; got {len(bias)}"
        )
    for token_id, value in bias.items():
        check_int("logit_bias token id", token_id, low=0)
        if not _is_number(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, "
                f"{MAX_ABS_LOGIT_BIAS:g}]; got {value!r} for token {token_id}"
            )
    return {int(t): float(v) for t, v in bias.items()} or None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
