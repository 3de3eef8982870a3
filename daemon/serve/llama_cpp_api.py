"""llama.cpp's native /completion body, read as the /v1/completions request it amounts to.

`parse_completion` translates a llama-server /completion body into an OpenAI completion
body and reads that with `openai_api.parse_request`, so both routes share one set of
checks and limits (and the daemon's own); an error names llama.cpp's parameter
(`LlamaOptions.rename`). The answer's shapes are llama_cpp_answers.py's.

Read as llama.cpp reads them: `prompt` (a string; token ids; a mix of both in one list,
each string tokenized by the daemon, the first with the tokenizer's BOS when it comes
first; a list of such prompts, each run as a request of its own; `{"prompt_string"}`),
`n_predict` (or `max_tokens`; -1, the default, runs to the context's end or the
daemon's --max-tokens-cap, as a chat without max_tokens), `temperature` (<= 0 greedy),
`top_k` (<= 0 off), `top_p` (>= 1 off), `min_p`, `seed` (-1 and 4294967295 random),
`stop`, `stream`, `ignore_eos`, `n_probs` (0 off), `repeat_penalty` (our
repetition_penalty), `presence_penalty`, `frequency_penalty`, `logit_bias`
(`[[id or text, bias]]` or `{"id or text": bias}`: a text's tokens each get the bias,
several entries for one token add up, and `false` bans it with -100, OpenAI's and the
daemon's bound, since JSON has no -inf), `json_schema` and `grammar` (GBNF; both as
structured outputs, openai_structured.py), `return_tokens`, and our `cache_salt`.
Absent sampling settings take llama.cpp's defaults (DEFAULTS), not OpenAI's.

Where llama.cpp and this daemon differ, and why:
- There are no slots: `id_slot`, `cache_prompt` and `n_cache_reuse` are accepted and
  change nothing, since every request finds its prompt's blocks by their hash, and
  reused blocks give the same bits. An answer's `id_slot` is -1 ("any").
- The sampling chain is vLLM's (SamplingParams): penalties, temperature, then min_p,
  top_k and top_p, where llama.cpp tempers last; at a temperature other than 0 or 1,
  a top_p or min_p cut may keep other tokens. `samplers` is refused.
- Penalties are vLLM's: repeat_penalty counts the prompt's and the answer's tokens
  (llama.cpp's `repeat_last_n: -1`), presence and frequency the answer's alone. A
  `repeat_last_n` other than -1 is refused while a penalty is on.
- `n_probs` are the raw model's log-probabilities (as /v1/completions' logprobs), at
  most 20; `post_sampling_probs` is refused.
- The context never shifts (a prompt past it is refused; generation stops at it), so
  `n_keep` and `n_discard` change nothing and are accepted.
Refused, as a 400 naming the key: any key not named here, and llama.cpp's samplers and
features we do not have (IGNORED) at any value but the one that turns them off.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ..engine.sampling.params import MAX_ABS_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS
from ..model.fim import FimTokens, infill_prompt
from .openai_api import ParsedRequest, object_body, parse_request
from .openai_embeddings import known_only
from .openai_errors import ApiError, bad
from .openai_errors import is_a as _is
from .openai_prompts import MAX_BATCH

Tokenize = Callable[[str, bool], Awaitable[list[int]]]  # (text, add the BOS) -> ids

MAX_STRINGS = 64  # texts a body may have tokenized (a mixed prompt's, logit_bias's)
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's "pick one" (LLAMA_DEFAULT_SEED)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama.cpp's
# sent on as they are (the OpenAI body's names are llama.cpp's)
SAME = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "seed", "stop", "stream", "ignore_eos", "cache_salt", "model")  # fmt: skip
RENAMED = {"n_predict": "max_tokens", "max_tokens": "max_tokens",
           "repeat_penalty": "repetition_penalty", "n_probs": "logprobs",
           "json_schema": "guided_json", "grammar": "guided_grammar"}  # fmt: skip
OUR_SAMPLERS = ["penalties", "temperature", "min_p", "top_k", "top_p"]  # SamplingParams'
# the settings of llama.cpp's samplers that must be off (IGNORED): harmless at any value
OFF_SAMPLERS_SETTINGS = ("dynatemp_exponent", "xtc_threshold", "mirostat_tau", "mirostat_eta",
                         "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                         "dry_sequence_breakers")  # fmt: skip


def _equals(off: float) -> Callable[[Any], bool]:
    return lambda v: _is(v, int, float) and v == off


# llama.cpp's knobs, accepted at the values that change nothing here: a feature off, or
# one whose effect this daemon has anyway (the docstring says why for each)
IGNORED: dict[str, Callable[[Any], bool]] = {
    "cache_prompt": lambda v: _is(v, bool),
    "id_slot": lambda v: _is(v, int),
    "n_cache_reuse": lambda v: _is(v, int),
    "n_keep": lambda v: _is(v, int),
    "n_discard": lambda v: _is(v, int),
    "repeat_last_n": lambda v: _is(v, int),  # checked against the penalties below
    "n_cmpl": _equals(1),
    "n_indent": _equals(0),
    "t_max_predict_ms": _equals(0),
    "typical_p": _equals(1),
    "min_keep": _equals(0),
    "dynatemp_range": _equals(0),
    "xtc_probability": _equals(0),
    "mirostat": _equals(0),
    "dry_multiplier": _equals(0),
    "top_n_sigma": lambda v: _is(v, int, float) and v <= 0,
    "timings_per_token": lambda v: v is False,
    "return_progress": lambda v: v is False,
    "post_sampling_probs": lambda v: v is False,
    "lora": lambda v: v == [],
    **dict.fromkeys(OFF_SAMPLERS_SETTINGS, lambda v: True),
}
KNOWN = {"prompt", "return_tokens", "logit_bias", *SAME, *RENAMED, *IGNORED}


@dataclass(slots=True)
class LlamaOptions:
    """How to answer a /completion: what llama.cpp's answer holds beyond the Dones."""

    return_tokens: bool = False
    n_probs: int = 0  # top alternatives per token in completion_probabilities; 0: none
    settings: dict[str, Any] = field(default_factory=dict)  # generation_settings
    # the OpenAI body's names of the parameters given -> llama.cpp's
    names: dict[str, str] = field(default_factory=dict)

    def rename(self, error: ApiError) -> ApiError:
        """`error` naming the parameter as the body did (n_predict, not max_tokens)."""
        old, message = error.param or "", error.message
        asked = self.names.get(old, old)
        if asked != old:
            named = message.startswith(old) and not message[len(old) :][:1].isidentifier()
            error.message = asked + message[len(old) :] if named else f"{asked}: {message}"
            error.param = asked
        return error


async def parse_completion(
    body: object, tokenize: Tokenize, *, max_tokens_cap: int
) -> tuple[ParsedRequest, LlamaOptions]:
    """A /completion body -> the request /v1/completions would run, and how to answer;
    or ApiError (400) naming llama.cpp's parameter."""
    body = known_only(object_body(body), KNOWN)
    for key, value in body.items():
        if key in IGNORED and not IGNORED[key](value):
            raise ApiError(400, f"unsupported value for {key}: {value!r:.60}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    if "n_predict" in body and "max_tokens" in body:
        raise bad("max_tokens", "give n_predict or max_tokens (its alias), not both")
    if "json_schema" in body and body.get("grammar", ""):
        raise bad("grammar", "give json_schema or grammar, not both")
    texts = _Texts(tokenize)
    options = LlamaOptions(names={RENAMED[k]: k for k in RENAMED if k in body})
    openai = {**DEFAULTS, **{k: body[k] for k in SAME if k in body}}
    openai.update({RENAMED[k]: body[k] for k in RENAMED if k in body})
    _llama_values(openai)
    if openai.get("guided_grammar") == "":  # llama.cpp's "no grammar"
        del openai["guided_grammar"]
    to_context = openai.get("max_tokens", -1) == -1
    if to_context:
        openai.pop("max_tokens", None)
    if "logit_bias" in body:
        openai["logit_bias"] = await _logit_bias(body["logit_bias"], texts)
    prompts = await _prompts(body.get("prompt"), texts)
    openai["prompt"] = prompts[0] if len(prompts) == 1 else prompts
    openai["return_token_ids"] = True  # the answer's `prompt` is the text of its ids
    try:
        parsed = parse_request("completions", openai, max_tokens_default=max_tokens_cap)
        options.return_tokens = body.get("return_tokens", False)
        if not _is(options.return_tokens, bool):
            raise bad("return_tokens", f"must be a boolean; got {options.return_tokens!r:.60}")
    except ApiError as e:
        raise options.rename(e) from None
    if to_context:  # to the context's end, or max_tokens_cap (a chat's default)
        parsed.options["fit_max_tokens"] = True
    penalized = parsed.options.get("repetition_penalty", 1) != 1 or any(
        parsed.options.get(name, 0) != 0 for name in ("presence_penalty", "frequency_penalty")
    )
    if penalized and body.get("repeat_last_n", -1) != -1:
        raise bad("repeat_last_n", "penalties here count the whole context (-1): the "
                  "prompt's and answer's tokens (presence and frequency: the answer's)")  # fmt: skip
    options.n_probs = parsed.num_logprobs or 0
    n_predict = -1 if to_context else parsed.options["max_tokens"]
    options.settings = generation_settings(parsed.options, n_predict, parsed.stream, body)
    return parsed, options


MAX_EXTRA_FILES = 64  # input_extra's chunks (other files' texts) an /infill may give


def infill_body(body: object, fim: FimTokens | None) -> dict[str, Any]:
    """llama.cpp's /infill body as the /completion body it amounts to: `input_prefix`,
    `input_suffix`, `input_extra` ([{"filename", "text"}], other files, as context) and
    `prompt` (the middle's start) laid out with the model's fill-in-the-middle tokens
    (fim.py) as the prompt text; the other keys as /completion's."""
    body = dict(object_body(body))
    if fim is None:
        raise bad("input_prefix", "this model has no fill-in-the-middle tokens (a code "
                  "model's, such as Qwen2.5-Coder's <|fim_prefix|>)")  # fmt: skip
    texts = {}
    for key in ("input_prefix", "input_suffix", "prompt"):
        texts[key] = body.pop(key, "")
        if not isinstance(texts[key], str):
            raise bad(key, f"must be a string; got {texts[key]!r:.60}")
    extra = body.pop("input_extra", [])
    if not isinstance(extra, list) or len(extra) > MAX_EXTRA_FILES or not all(
        isinstance(c, dict) and set(c) <= {"filename", "text"}
        and all(isinstance(v, str) for v in c.values()) for c in extra
    ):  # fmt: skip
        raise bad("input_extra", f"must be a list of at most {MAX_EXTRA_FILES} "
                  '{"filename": ..., "text": ...} objects of strings')  # fmt: skip
    files = [(c.get("filename", ""), c.get("text", "")) for c in extra]
    try:
        prompt = infill_prompt(fim, texts["input_prefix"], texts["input_suffix"],
                               start=texts["prompt"], files=files)  # fmt: skip
    except ValueError as e:
        raise bad("input_extra", str(e)) from None
    return {**body, "prompt": prompt}


def _llama_values(openai: dict[str, Any]) -> None:
    """llama.cpp's spellings of "off" and "greedy" as the daemon's."""

    def number(name: str) -> bool:
        return _is(openai.get(name), int, float)

    if number("temperature") and openai["temperature"] < 0:
        openai["temperature"] = 0
    if number("top_k") and openai["top_k"] <= 0:
        del openai["top_k"]
    if number("top_p") and openai["top_p"] > 1:
        openai["top_p"] = 1
    if number("min_p") and openai["min_p"] < 0:
        openai["min_p"] = 0
    if openai.get("seed") in RANDOM_SEEDS and _is(openai["seed"], int):
        del openai["seed"]
    if openai.get("logprobs") == 0 and _is(openai["logprobs"], int):
        del openai["logprobs"]


def generation_settings(
    options: dict[str, Any], n_predict: int, stream: bool, body: dict[str, Any]
) -> dict[str, Any]:
    """The settings a request runs with (`options`: the daemon's, as parse_request makes
    them), in llama.cpp's names: its generation_settings."""
    bias = options.get("logit_bias") or {}
    return {
        "n_predict": n_predict,
        "max_tokens": n_predict,
        "seed": options.get("seed", RANDOM_SEEDS[1]),  # llama.cpp's "random"
        "temperature": options.get("temperature", 1.0),
        "top_k": options.get("top_k", 0),
        "top_p": options.get("top_p", 1.0),
        "min_p": options.get("min_p", 0.0),
        "repeat_last_n": -1,
        "repeat_penalty": options.get("repetition_penalty", 1.0),
        "presence_penalty": options.get("presence_penalty", 0.0),
        "frequency_penalty": options.get("frequency_penalty", 0.0),
        "stop": options.get("stop", []),
        "ignore_eos": options.get("ignore_eos", False),
        "n_probs": options.get("logprobs") or 0,
        "logit_bias": [[token, value] for token, value in bias.items()],
        "grammar": body.get("grammar", ""),
        "json_schema": body.get("json_schema", {}),
        "samplers": OUR_SAMPLERS,
        "stream": stream,
    }


@dataclass(slots=True)
class _Texts:
    """The daemon's tokenizer, for the texts of one body: at most MAX_STRINGS of them."""

    tokenize: Tokenize
    num_left: int = MAX_STRINGS

    async def ids(self, text: str, bos: bool, param: str) -> list[int]:
        if self.num_left == 0:
            raise bad(param, f"a body may hold at most {MAX_STRINGS} texts to tokenize "
                      "(a mixed prompt's and logit_bias's together)")  # fmt: skip
        self.num_left -= 1
        return await self.tokenize(text, bos)


async def _prompts(prompt: object, texts: _Texts) -> list[Any]:
    """llama.cpp's `prompt`: one prompt, or a list of 1 to MAX_BATCH of them (a list of
    strings alone is several; a list with ids is one)."""
    if prompt is None:
        raise bad("prompt", "is required")
    if isinstance(prompt, str | dict) or _mixed(prompt):
        return [await _one(prompt, texts)]
    if isinstance(prompt, list) and 1 <= len(prompt) <= MAX_BATCH:
        return [await _one(p, texts) for p in prompt]
    raise bad("prompt", f"must be a string, token ids, a list mixing both, or a list of 1 to "
              f"{MAX_BATCH} of those")  # fmt: skip


def _mixed(prompt: object) -> TypeGuard[list[Any]]:
    """A list of token ids, with or without strings: one prompt."""
    return isinstance(prompt, list) and any(_is(p, int) for p in prompt)


async def _one(prompt: object, texts: _Texts) -> str | list[int]:
    """One prompt as text or ids: a mixed list's strings are tokenized, the first with
    the BOS when it comes first (llama.cpp's rule)."""
    if isinstance(prompt, dict):
        if set(prompt) != {"prompt_string"}:
            raise bad("prompt", "an object prompt must be {\"prompt_string\": ...} alone "
                      f"(no multimodal data here); got keys {sorted(prompt)}")  # fmt: skip
        prompt = prompt["prompt_string"]
    if isinstance(prompt, str):
        return prompt
    if not _mixed(prompt) or not all(_is(p, int) or isinstance(p, str) for p in prompt):
        raise bad("prompt", "each prompt must be a string, token ids, or a list mixing both")
    ids: list[int] = []
    for i, piece in enumerate(prompt):
        if isinstance(piece, str):
            ids += await texts.ids(piece, i == 0, "prompt")
        else:
            ids.append(piece)
    return ids


async def _logit_bias(value: object, texts: _Texts) -> dict[str, float]:
    """llama.cpp's logit_bias as OpenAI's {"token id": bias}: pairs [[id or text, bias]]
    or an object {"id or text": bias}; a text biases each of its tokens, biases for one
    token add up, and `false` bans the token (MAX_ABS_LOGIT_BIAS below)."""
    if isinstance(value, dict):
        pairs = [(int(k) if k.isascii() and k.isdigit() else k, v) for k, v in value.items()]
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise bad("logit_bias", "must be [[token id or text, bias], ...] or {\"token id or "
                  f"text\": bias}}; got {value!r:.60}")  # fmt: skip
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS_TOKENS} entries")
    bias: dict[int, float] = {}
    banned: set[int] = set()
    for token, amount in pairs:
        if not (amount is False or _is(amount, int, float)):
            raise bad("logit_bias", f"a bias must be a number or false; got {amount!r:.40}")
        if isinstance(token, str):
            ids = await texts.ids(token, False, "logit_bias")
        elif _is(token, int):
            ids = [token]
        else:
            raise bad("logit_bias", f"a token must be an id or a text; got {token!r:.40}")
        for t in ids:
            if amount is False:
                banned.add(t)
            else:
                bias[t] = bias.get(t, 0.0) + amount
    bias.update(dict.fromkeys(banned, -MAX_ABS_LOGIT_BIAS))
    return {str(t): b for t, b in bias.items()}
