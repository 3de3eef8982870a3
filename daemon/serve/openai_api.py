"""OpenAI's request shapes, mapped to the daemon's protocol (the responses: openai_responses.py).

`parse_request` turns a `/v1/completions` or `/v1/chat/completions` body into
the keyword arguments of `Client.stream` (our Generate fields), or raises
`ApiError` naming the offending parameter. Values are checked by the daemon
(SamplingParams, Generate), whose messages come back as 400s: one set of
limits and validation for both front ends.

Unknown parameters are refused with a 400 naming them, so a client never
believes a setting took effect when it did not; `HARMLESS` lists the ones
accepted because they change nothing we compute (or only in the value given).

The body's pieces are read by openai_chat.py (chat messages and chat options) and
openai_prompts.py (prompts, batches and prompt_embeds); /tokenize and /detokenize
bodies by openai_tokenize.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..model.fim import FimTokens, infill_prompt
from .openai_chat import CHAT_OPTIONS, parse_chat_options, parse_messages
from .openai_errors import ApiError, bad
from .openai_errors import is_a as _is
from .openai_prompts import one_prompt, prompt_batch, prompt_embeds
from .openai_structured import STRUCTURED
from .openai_structured import structured as structured_of
from .openai_structured import tools as tools_of

MAX_CHOICES = 16  # `n`: choices one request may ask for
MAX_TOP_LOGPROBS = 20  # as OpenAI's (and SamplingParams')


# Accepted and not acted on, when their value asks for nothing we would have to do.
HARMLESS: dict[str, Callable[[Any], bool]] = {
    "user": lambda v: _is(v, str),  # logged with the request
    "best_of": lambda v: v in (None, 1),
    "store": lambda v: v in (None, False),
    "metadata": lambda v: True,
    "service_tier": lambda v: True,
    "parallel_tool_calls": lambda v: True,
    # chat parses its own (_tools); completions take only these
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    # SGLang's extensions, which sglang-router writes into every body it forwards, at
    # their defaults (we have no reasoning parser, so its two flags change nothing).
    "no_stop_trim": lambda v: v in (None, False),
    "return_hidden_states": lambda v: v in (None, False),
    "separate_reasoning": lambda v: _is(v, bool),
    "stream_reasoning": lambda v: _is(v, bool),
}
# Sampling parameters passed to the daemon as they are (its names are OpenAI's and vLLM's).
PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
          "include_stop_str_in_output", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
          "min_tokens")  # fmt: skip
COMMON = {"model", "stream", "stream_options", "n", "stop", "cache_salt", "priority",
          "max_tokens", "logit_bias", "prompt_logprobs", "return_token_ids",
          "return_tokens_as_token_ids", "add_special_tokens", *PASSED, *HARMLESS}  # fmt: skip
COMMON |= set(STRUCTURED)
KNOWN = {
    "completions": COMMON | {"prompt", "prompt_embeds", "logprobs", "echo", "suffix"},
    "chat": COMMON
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "echo", *CHAT_OPTIONS},
}


@dataclass(slots=True)
class ParsedRequest:
    """One HTTP request: what to send the daemon, and how to answer."""

    kind: str  # "completions" | "chat"
    model: str | None
    # None: the prompt is every row of `options["prompt_table"]` (`prompt_embeds` without
    # `prompt`), ids vocab_size .. vocab_size + rows - 1, filled in by `table_prompt`.
    prompt: str | list[int] | list[dict[str, str]] | None
    options: dict[str, Any]  # Client.stream keywords, without the prompt
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's)
    num_logprobs: int | None = None  # top alternatives per token; None: no logprobs
    echo: bool = False  # completions: the answer starts with the prompt (its logprobs too)
    # chat's echo (vLLM's): the answer's content starts with the last message's, when that
    # is the assistant's (a message continued with continue_final_message, say)
    chat_echo: str = ""
    # vLLM's return_token_ids: the prompt's ids and each choice's ids in the answer
    return_token_ids: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    tokens_as_ids: bool = False
    # chat: the server's reasoning parser (reasoning_parsers.py), unless the request's
    # SGLang-style separate_reasoning is false or its tool choice holds it to a grammar
    reasoning_parser: str | None = None
    separate_reasoning: bool = True
    # vLLM's prompt_logprobs: top alternatives per prompt token, in the answer's own field
    num_prompt_logprobs: int | None = None
    # chat with tools: "named" (the answer is the arguments of `tool_name`), "required"
    # (a JSON list of {"name", "parameters"}) or a tool-call parser's name (tool_choice
    # "auto": the calls read from the model's text): the answer comes back as tool_calls
    tool_mode: str | None = None
    tool_name: str | None = None
    tool_call_parser: str | None = None  # the server's (its call ids' form: tool_parsers.call_id)
    user: str | None = None
    # /v1/completions given a list of prompts: each runs as a request of its own, and its
    # choices are indices i * n .. i * n + n - 1 (as OpenAI's); None: the one `prompt`
    batch: list[str | list[int]] | None = None
    # OpenAI's `suffix` (completions): the text after the one asked for, each prompt its
    # prefix (fill in the middle: `fill_in`, with the model's tokens, fim.py)
    suffix: str | None = None
    # the daemon's parameter -> the body's name for it, where they differ (chat's
    # max_completion_tokens): the daemon's errors name what the client sent
    param_names: dict[str, str] = field(default_factory=dict)

    def fill_in(self, fim: FimTokens | None) -> None:
        """Each prompt laid out as the prefix of a fill-in-the-middle prompt before
        `suffix` (ApiError 400 when the model has no such tokens)."""
        if self.suffix is None:
            return
        if fim is None:
            raise bad("suffix", "this model has no fill-in-the-middle tokens (a code model's, "
                      "such as Qwen2.5-Coder's <|fim_prefix|>)")  # fmt: skip
        suffix = self.suffix
        self.prompt = infill_prompt(fim, self.prompt, suffix)  # type: ignore[arg-type]
        if self.batch is not None:
            self.batch = [infill_prompt(fim, p, suffix) for p in self.batch]  # type: ignore[arg-type]

    @property
    def prompts(self) -> list[Any]:
        """Every prompt of the request, in order (one unless a batch)."""
        return [self.prompt] if self.batch is None else self.batch

    @property
    def num_choices(self) -> int:
        """Choices in the answer: n for each prompt."""
        return len(self.prompts) * self.n

    def table_prompt(self, vocab_size: int) -> None:
        """Fill in the prompt of a `prompt_embeds` request without `prompt`: the table's
        rows in order, as fake ids (the daemon derives their extra ids from the rows)."""
        if self.prompt is None:
            rows = self.options["prompt_table"].shape[0]
            self.prompt = list(range(vocab_size, vocab_size + rows))


def parse_request(
    kind: str,
    body: object,
    *,
    max_tokens_default: int = 16,
    tool_call_parser: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> ParsedRequest:
    """A request body (parsed JSON) -> ParsedRequest, or ApiError (400) naming the parameter.
    `tool_call_parser`: the server's, for tool_choice "auto" (None: "auto" is refused).
    `defaults`: the model's sampling defaults (generation_defaults.py) for what the body
    leaves out or sets to null; its max_tokens lowers `max_tokens_default` (vLLM's rule:
    the smaller of the two is a request's max_tokens when it gives none)."""
    body = object_body(body)
    echo = _echo(body)
    # takes tools and tool_choice out of the body
    tools = tools_of(body, tool_call_parser) if kind == "chat" else None
    for key, value in body.items():
        if key not in KNOWN[kind]:
            raise ApiError(400, f"unsupported parameter: {key}", param=key,
                           code="unsupported_parameter")  # fmt: skip
        if key in HARMLESS and not HARMLESS[key](value):
            raise ApiError(400, f"unsupported value for {key}: {value!r:.60}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    options: dict[str, Any] = {k: body[k] for k in PASSED if k in body}
    defaults = dict(defaults or {})
    default_max_tokens = defaults.pop("max_tokens", None)
    for name, value in defaults.items():
        if options.get(name) is None:
            options[name] = value
    if options.get("top_k") in (-1, 0):  # vLLM's spelling of "no limit"
        del options["top_k"]
    batch: list[str | list[int]] | None = None  # /v1/completions' list of prompts
    max_tokens_param = "max_tokens"  # the body's field the token limit came from
    if kind == "chat":
        prompt: Any = parse_messages(body.get("messages"))
        # OpenAI's max_completion_tokens wins over its deprecated max_tokens (as vLLM's)
        max_tokens_param = (
            "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        )
        max_tokens = body.get(max_tokens_param)
        if (chat_options := parse_chat_options(body, prompt)) is not None:
            options["chat_options"] = chat_options
    elif "prompt_embeds" in body:
        options["prompt_table"] = prompt_embeds(body["prompt_embeds"])
        prompt = body.get("prompt")
        if prompt in ("", [""]):  # vLLM's examples send an empty prompt with the embeds
            prompt = None
        if prompt is not None:
            prompt = one_prompt(prompt)
            if isinstance(prompt, str):
                raise bad("prompt", "must be a list of token ids when prompt_embeds is given "
                          "(ids >= the vocabulary size select its rows)")  # fmt: skip
        max_tokens = body.get("max_tokens")
    else:
        batch = prompt_batch(body.get("prompt"))
        prompt = batch[0]
        max_tokens = body.get("max_tokens")
    if default_max_tokens is not None:  # the model's max_new_tokens lowers the default
        max_tokens_default = min(max_tokens_default, default_max_tokens)
    options["max_tokens"] = max_tokens_default if max_tokens is None else max_tokens
    if kind == "chat" and max_tokens is None:  # vLLM's: to its end, what fits after the prompt
        options["fit_max_tokens"] = True
    if "stop" in body:
        stop = body["stop"]
        options["stop"] = [stop] if isinstance(stop, str) else stop
    for name in ("cache_salt", "priority"):
        if name in body:
            options[name] = body[name]
    if "logit_bias" in body:
        options["logit_bias"] = _logit_bias(body["logit_bias"])
    if (structured := structured_of(body)) is not None:
        options["structured"] = structured
    if tools is not None:
        if structured is not None and tools.spec is not None:
            raise bad("tool_choice", "a required or named tool choice cannot be combined with "
                      "response_format or structured outputs (it makes the answer's grammar)")  # fmt: skip
        options["tools"] = tools.tools
        if tools.spec is not None:
            options["structured"] = tools.spec
    if tools is not None and tools.mode == "mistral":  # [TOOL_CALLS] is a special token
        options["skip_special_tokens"] = False  # kept in the text, as vLLM's parser asks
    # vLLM's `priority` orders the queue (lower first), as our queue_priority does.
    if "priority" in options:
        options["queue_priority"] = options.pop("priority")
    parsed = ParsedRequest(kind, body.get("model"), prompt, options, user=body.get("user"))
    if max_tokens_param != "max_tokens":
        parsed.param_names["max_tokens"] = max_tokens_param
    if tools is not None:
        parsed.tool_mode, parsed.tool_name = tools.mode, tools.name
        parsed.tool_call_parser = tool_call_parser
    parsed.separate_reasoning = body.get("separate_reasoning", True)
    if kind == "chat" and echo:
        if tools is not None:
            raise bad("echo", "is not supported with tools")
        if prompt[-1]["role"] == "assistant":
            parsed.chat_echo = prompt[-1]["content"] or ""
    if batch is not None and len(batch) > 1:
        parsed.batch = batch
    n = body.get("n", 1)
    if not _is(n, int) or not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"must be an integer in [1, {MAX_CHOICES}]; got {n!r}")
    parsed.n = n
    if n > 1:  # the daemon runs the choices, sharing the prompt's prefill (seeds seed + i)
        options["n"] = n
    stream = body.get("stream", False)
    if not _is(stream, bool):
        raise bad("stream", f"must be a boolean; got {stream!r}")
    parsed.stream = stream
    stream_options = body.get("stream_options") or {}
    if stream_options and not stream:  # OpenAI's and vLLM's rule
        raise bad("stream_options", "is only allowed with stream: true")
    known = {"include_usage", "continuous_usage_stats"}
    if not isinstance(stream_options, dict) or set(stream_options) - known:
        raise bad(
            "stream_options", f"only {sorted(known)} are supported; got {stream_options!r:.80}"
        )
    for key, value in stream_options.items():
        if value is not None and not _is(value, bool):
            raise bad("stream_options", f"{key} must be a boolean; got {value!r:.60}")
    parsed.include_usage = bool(stream_options.get("include_usage"))
    # vLLM's: each chunk carries its choice's usage so far (only with include_usage)
    parsed.continuous_usage = parsed.include_usage and bool(
        stream_options.get("continuous_usage_stats")
    )
    if "add_special_tokens" in body:  # vLLM's: BOS / EOS around the text (or rendered chat)
        if not _is(body["add_special_tokens"], bool):
            raise bad(
                "add_special_tokens", f"must be a boolean; got {body['add_special_tokens']!r:.60}"
            )
        options["add_special_tokens"] = body["add_special_tokens"]
    for name in ("return_token_ids", "return_tokens_as_token_ids"):
        if not _is(body.get(name, False), bool):
            raise bad(name, f"must be a boolean; got {body[name]!r:.60}")
    parsed.return_token_ids = body.get("return_token_ids", False)
    parsed.tokens_as_ids = body.get("return_tokens_as_token_ids", False)
    if parsed.return_token_ids:
        options["return_token_ids"] = True
    parsed.num_logprobs = _num_logprobs(kind, body)
    if parsed.num_logprobs is not None:
        options["logprobs"] = parsed.num_logprobs
    if (top := body.get("prompt_logprobs")) is not None:
        if not _is(top, int) or top < 0:
            raise bad("prompt_logprobs", f"must be an integer >= 0; got {top!r:.60}")
        if stream:
            raise bad("prompt_logprobs", "is not supported with stream: true")
        parsed.num_prompt_logprobs = options["prompt_logprobs"] = top
    if body.get("suffix") is not None:  # a completions' key alone (KNOWN)
        parsed.suffix = _suffix(body["suffix"], parsed, echo)
    if echo and kind == "completions":
        text_prompts = all(isinstance(p, str) for p in parsed.prompts)
        if stream and not (text_prompts and parsed.num_logprobs is None):
            raise bad("echo", "with stream: true takes text prompts without logprobs (the "
                      "prompt's text goes first; its tokens' logprobs come whole only)")  # fmt: skip
        if "prompt_table" in options:
            raise bad("echo", "is not supported with prompt_embeds")
        parsed.echo = True
        # the prompt's tokens and texts come with its logprobs (the cache serves them);
        # a text prompt without logprobs echoes as it came
        if parsed.num_logprobs is not None or not all(isinstance(p, str) for p in parsed.prompts):
            wanted = (parsed.num_logprobs or 0, parsed.num_prompt_logprobs or 0)
            options["prompt_logprobs"] = max(wanted)
    return parsed


def object_body(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return {k: v for k, v in body.items() if v is not None}  # null means "not given"


def _suffix(suffix: object, parsed: ParsedRequest, echo: bool) -> str:
    """OpenAI's `suffix`: a string, after text prompts (their prefixes), without echo."""
    if not isinstance(suffix, str):
        raise bad("suffix", f"must be a string; got {suffix!r:.60}")
    if not all(isinstance(p, str) for p in parsed.prompts):
        raise bad("suffix", "goes with text prompts (the text before the middle), not token ids "
                  "or prompt_embeds")  # fmt: skip
    if echo:
        raise bad("echo", "is not supported with suffix")
    return suffix


def _echo(body: dict[str, Any]) -> bool:
    """`echo`: OpenAI's legacy one on completions, vLLM's on chat (ParsedRequest.chat_echo)."""
    if "echo" not in body:
        return False
    echo = body.pop("echo")
    if not _is(echo, bool):
        raise bad("echo", f"must be a boolean; got {echo!r:.60}")
    return echo


def _logit_bias(bias: object) -> dict[int, object]:
    """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), as {id: bias}; the
    daemon checks the ids against the vocabulary and the biases' range."""
    if not isinstance(bias, dict):
        raise bad("logit_bias", f"must be an object of token id -> bias; got {bias!r:.60}")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad("logit_bias", f"keys must be token ids (decimal integers); got {key!r:.40}")
        out[int(key)] = value
    return out


def _num_logprobs(kind: str, body: dict[str, Any]) -> int | None:
    if kind == "completions":
        value = body.get("logprobs")
        if value is None:
            return None
        if not _is(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {value!r}")
        return value
    wanted = body.get("logprobs", False)
    if not _is(wanted, bool):
        raise bad("logprobs", f"must be a boolean; got {wanted!r}")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {top!r}")
        if not wanted:
            raise bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None
