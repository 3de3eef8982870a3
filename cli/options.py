"""The options `generate`, `chat` and `run` share, in one place: sampling (the same
defaults everywhere), the daemon request options, and the client's socket and timeout.

Each option checks its value when it is parsed, so a bad one is a usage error (exit
code 2) naming the option, the value and what is allowed, before anything connects
or loads. The CLI samples greedily unless told otherwise (`--temperature 0`), so the
same command gives the same answer; the wire protocol and the Python API keep vLLM's
default of 1.0.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import click

from ..daemon.engine.config import setting_fields
from ..daemon.engine.sampling.bad_words import check_bad_words
from ..daemon.engine.sampling.params import MAX_ABS_LOGIT_BIAS
from ..daemon.engine.sampling.structured import StructuredOutput
from ..ipc.messages import MAX_SALT_CHARS
from ..ipc.sockets import check_address

MAX_SEED = 2**64 - 1
# int32, the range vLLM's priority has; the daemon's own check is in ipc/messages.py
QUEUE_PRIORITY_RANGE = (-(2**31), 2**31 - 1)
DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMPERATURE = 0.0


class FiniteFloat(click.ParamType):
    """A float that must be finite (nan and inf are refused, unlike click.FloatRange)
    and within [low, high]; `low_open` excludes `low` itself; `unit` (e.g. "seconds")
    is named in the refusal."""

    name = "float"

    def __init__(
        self,
        low: float | None = None,
        high: float | None = None,
        *,
        low_open: bool = False,
        unit: str = "",
    ) -> None:
        self.low, self.high, self.low_open, self.unit = low, high, low_open, unit

    def allowed(self) -> str:
        what = f"number of {self.unit}" if self.unit else "number"
        if self.low is not None and self.high is not None:
            return f"a {what} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"a finite {what} {'>' if self.low_open else '>='} {self.low:g}"
        return f"a finite {what}"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, float) and math.isfinite(value):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not {self.allowed()}", param, ctx)
        too_low = self.low is not None and (
            number <= self.low if self.low_open else number < self.low
        )
        too_high = self.high is not None and number > self.high
        if not math.isfinite(number) or too_low or too_high:
            self.fail(f"{value!r} is not {self.allowed()}", param, ctx)
        return number


class SocketAddress(click.ParamType):
    """ipc://PATH or tcp://127.0.0.1:PORT, the addresses the daemon serves."""

    name = "address"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        try:
            check_address(text)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return text


def _salt(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and len(value) > MAX_SALT_CHARS:
        raise click.BadParameter(
            f"{len(value)} characters; at most {MAX_SALT_CHARS} are allowed", ctx, param
        )
    return value


def _stop(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    if any(not s for s in value):
        raise click.BadParameter("a stop string needs at least one character; got ''", ctx, param)
    return value


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A FloatRange's value, refused when it is nan or inf (which FloatRange lets through)."""
    if value is not None and not math.isfinite(value):
        low = getattr(param.type, "min", None)
        allowed = "a finite number" + ("" if low is None else f" >= {low:g}")
        raise click.BadParameter(f"{value!r} is not {allowed}", ctx, param)
    return value


def in_a_folder(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A file to write: its folder must exist now, not only when the answer is done."""
    folder = os.path.dirname(os.path.abspath(value)) if value is not None else None
    if folder is not None and not os.path.isdir(folder):
        raise click.BadParameter(f"cannot write {str(value)!r}: no folder {folder!r}", ctx, param)
    return value


def _bad_words(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> list[str] | None:
    """--bad-word, repeatable: the list (None when not given), refused here if SamplingParams
    would refuse it, before anything loads."""
    try:
        return check_bad_words(list(value))
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


def _logit_bias(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> dict[int, float] | None:
    """ID=BIAS, repeatable: {id: bias} (None when not given), each bias in SamplingParams'
    range, refused here before anything loads (the ids past the vocabulary: the engine)."""
    bias: dict[int, float] = {}
    for item in value:
        token, sep, number = item.partition("=")
        try:
            token_id, amount = int(token), float(number)
        except ValueError:
            token_id, amount, sep = -1, 0.0, ""
        if not sep or token_id < 0 or not abs(amount) <= MAX_ABS_LOGIT_BIAS:
            raise click.BadParameter(
                f"must be ID=BIAS, a token id >= 0 and a bias in [-{MAX_ABS_LOGIT_BIAS:g}, "
                f"{MAX_ABS_LOGIT_BIAS:g}]; got {item!r}",
                ctx,
                param,
            )
        if token_id in bias:
            raise click.BadParameter(f"token {token_id} is biased twice", ctx, param)
        bias[token_id] = amount
    return bias or None


def _text_or_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """TEXT, or @FILE for the text of a file (a schema or a grammar)."""
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {value[1:]!r}: {e}", ctx, param) from None


# the structured-output options, by the StructuredOutput kind each gives
STRUCTURED_OPTIONS = {"json_schema": "json", "json_object": "json_object", "regex": "regex",
                      "choice": "choice", "grammar": "grammar"}  # fmt: skip


def structured_from(kw: dict[str, Any]) -> StructuredOutput | None:
    """The structured output the options ask for (at most one of them), checked by
    llguidance before anything loads or connects; None for none."""
    given = [name for name in STRUCTURED_OPTIONS if kw.get(name) not in (None, False, ())]
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    if len(given) > 1:
        raise click.UsageError(f"give at most one of --json-schema, --json-object, --regex, "
                               f"--choice, --grammar; got {flags}")  # fmt: skip
    if not given:
        return None
    name = given[0]
    try:
        if name == "choice":
            spec = StructuredOutput.choice(kw[name])
        else:
            spec = StructuredOutput(
                STRUCTURED_OPTIONS[name], "" if name == "json_object" else kw[name]
            )
        spec.validate()
    except ValueError as e:
        raise click.UsageError(f"{flags}: {e}") from None
    return spec


def _stack(options: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def decorate(f: Any) -> Any:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


sampling_options = _stack(
    [
        click.option(
            "--max-tokens",
            type=click.IntRange(min=1),
            default=DEFAULT_MAX_TOKENS,
            show_default=True,
            help="Most tokens to generate.",
        ),
        click.option(
            "--temperature",
            type=FiniteFloat(low=0.0),
            default=DEFAULT_TEMPERATURE,
            show_default=True,
            help="0 = greedy (the same answer every time).",
        ),
        click.option(
            "--top-p",
            type=FiniteFloat(0.0, 1.0, low_open=True),
            default=1.0,
            show_default=True,
            help="Nucleus sampling: keep the most likely tokens up to this probability.",
        ),
        click.option(
            "--top-k",
            type=click.IntRange(min=1),
            default=None,
            help="Keep only the K most likely tokens [default: no limit].",
        ),
        click.option(
            "--min-p",
            type=FiniteFloat(0.0, 1.0),
            default=None,
            help="Keep only tokens at least this likely relative to the most likely one "
            "(vLLM's min_p) [default: 0, off].",
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0, max=MAX_SEED),
            default=None,
            help="Seed for sampling: the same seed draws the same tokens [default: random].",
        ),
        click.option(
            "--stop",
            multiple=True,
            callback=_stop,
            help="Stop when the text contains this string; it is cut off (repeatable).",
        ),
        click.option(
            "--bad-word",
            "bad_words",
            multiple=True,
            callback=_bad_words,
            help="A word the answer may not contain (vLLM's bad_words; repeatable).",
        ),
        click.option(
            "--presence-penalty",
            type=FiniteFloat(-2.0, 2.0),
            default=None,
            help="Subtracted once from the logit of every token already in the output "
            "(OpenAI's) [default: 0, off].",
        ),
        click.option(
            "--frequency-penalty",
            type=FiniteFloat(-2.0, 2.0),
            default=None,
            help="Subtracted from a token's logit per time it is already in the output "
            "(OpenAI's) [default: 0, off].",
        ),
        click.option(
            "--repetition-penalty",
            type=FiniteFloat(low=0.0, low_open=True),
            default=None,
            help="Divides positive and multiplies negative logits of tokens in the prompt or "
            "output (vLLM's) [default: 1, off].",
        ),
        click.option(
            "--min-tokens",
            type=click.IntRange(min=0),
            default=None,
            help="Tokens to generate before a stop token or stop string may end the answer "
            "(vLLM's) [default: 0].",
        ),
        click.option(
            "--logit-bias",
            multiple=True,
            metavar="ID=BIAS",
            callback=_logit_bias,
            help="Add BIAS (-100 to 100) to token ID's logit before sampling, as OpenAI's "
            "logit_bias: -100 bans it, 100 forces it (repeatable).",
        ),
        click.option(
            "--json-schema",
            metavar="SCHEMA",
            callback=_text_or_file,
            default=None,
            help="Answer with JSON that follows this JSON schema (its text, or @FILE).",
        ),
        click.option(
            "--json-object", is_flag=True, default=False, help="Answer with a JSON object."
        ),
        click.option(
            "--regex", default=None, help="Answer with text the whole of which matches REGEX."
        ),
        click.option(
            "--choice",
            multiple=True,
            help="Answer with exactly one of these strings (repeatable).",
        ),
        click.option(
            "--grammar",
            callback=_text_or_file,
            default=None,
            help="Answer with text in this grammar, Lark or llama.cpp's GBNF (its text, or @FILE).",
        ),
    ]
)

PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


request_options = _stack(
    [
        click.option(
            "--salt",
            default=None,
            callback=_salt,
            help="Cache salt: requests with other salts share no KV.",
        ),
        click.option(
            "--priority",
            type=click.IntRange(0, 100),
            default=None,
            help="Retention priority of the prompt's blocks, 0-100 [default: 35].",
        ),
        click.option(
            "--queue-priority",
            type=click.IntRange(*QUEUE_PRIORITY_RANGE),
            default=0,
            show_default=True,
            help="Scheduling priority: lower is admitted first.",
        ),
    ]
)

client_options = _stack(
    [
        click.option(
            "--socket",
            envvar="REPRISE_SOCKET",
            type=SocketAddress(),
            default=None,
            help="Daemon address, ipc://PATH or tcp://127.0.0.1:PORT (env REPRISE_SOCKET).",
        ),
        click.option(
            "--timeout",
            type=FiniteFloat(low=0.0, low_open=True),
            default=300.0,
            show_default=True,
            help="Seconds to wait for each reply from the daemon.",
        ),
    ]
)


def sampling_from(kw: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams' fields from the parsed sampling options (None: left to the default)."""
    return {
        "max_tokens": kw["max_tokens"],
        "temperature": kw["temperature"],
        "top_p": kw["top_p"],
        "top_k": kw["top_k"],
        **({"min_p": kw["min_p"]} if kw.get("min_p") else {}),
        "seed": kw["seed"],
        "stop": list(kw["stop"]),
        **{name: kw[name] for name in PENALTIES if kw.get(name) is not None},
        **({"logit_bias": kw["logit_bias"]} if kw.get("logit_bias") else {}),
        **({"bad_words": kw["bad_words"]} if kw.get("bad_words") else {}),
        **({"min_tokens": kw["min_tokens"]} if kw.get("min_tokens") else {}),
        **({"structured": spec} if (spec := structured_from(kw)) is not None else {}),
    }


def request_from(kw: dict[str, Any]) -> dict[str, Any]:
    """The Client's request options from the parsed sampling and request options."""
    return {
        **sampling_from(kw),
        "cache_salt": kw["salt"],
        "priority": kw["priority"],
        "queue_priority": kw["queue_priority"],
    }


# -- prompt tables (p-tuning): `generate` only --------------------------------------------


def _id_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """A comma-separated list of non-negative integers, each below `2**64`."""
    if value is None:
        return None
    try:
        ids = [int(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"must be comma-separated integers; got {value!r}") from None
    bad = next((i for i in ids if not 0 <= i < 2**64), None)
    if bad is not None:
        raise click.BadParameter(f"ids must be in [0, 2**64); got {bad}")
    return ids


def _prompt_table(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A .npy file of a 2-d BF16 table: saved from an `ml_dtypes.bfloat16` array (NumPy
    reads it back as 2-byte void) or as its uint16 bit patterns."""
    if value is None:
        return None
    import ml_dtypes
    import numpy as np

    try:
        table = np.load(value, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise click.BadParameter(f"cannot read {value} as a .npy array: {e}") from None
    if table.dtype.itemsize != 2 or table.dtype.kind not in "Vu":
        raise click.BadParameter(
            f"{value} holds {table.dtype}; a prompt table must be bfloat16 (the model's dtype), "
            "saved from an ml_dtypes.bfloat16 array or as its uint16 bit patterns"
        )
    if table.ndim != 2:
        raise click.BadParameter(
            f"{value} has shape {list(table.shape)}; a prompt table is [num_virtual, hidden]"
        )
    return np.ascontiguousarray(table).view(ml_dtypes.bfloat16)


prompt_table_options = _stack(
    [
        click.option(
            "--token-ids",
            callback=_id_list,
            default=None,
            metavar="ID,ID,...",
            help="Send these token ids as the prompt instead of PROMPT (ids from the "
            "vocabulary size up select --prompt-table rows).",
        ),
        click.option(
            "--prompt-table",
            callback=_prompt_table,
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            metavar="FILE.npy",
            help="p-tuning: a [num_virtual, hidden] bfloat16 table; token id vocab_size + r "
            "embeds as its row r. Needs --token-ids.",
        ),
        click.option(
            "--extra-ids",
            callback=_id_list,
            default=None,
            metavar="ID,ID,...",
            help="One per token id: 0 for text tokens, > 0 for table ids, equal for equal "
            "tables [default: digests of the rows].",
        ),
    ]
)


def prompt_table_from(kw: dict[str, Any]) -> dict[str, Any]:
    """The Client's prompt-table options from the parsed ones (usage errors when they
    cannot go together)."""
    token_ids, table, extra_ids = kw["token_ids"], kw["prompt_table"], kw["extra_ids"]
    if token_ids is None:
        for name, value in (("--prompt-table", table), ("--extra-ids", extra_ids)):
            if value is not None:
                raise click.UsageError(f"{name} needs --token-ids")
        return {}
    if extra_ids is not None and len(extra_ids) != len(token_ids):
        raise click.UsageError(
            f"--extra-ids must have one id per token id: {len(extra_ids)} for {len(token_ids)}"
        )
    return {"prompt_table": table, "extra_ids": extra_ids}


def engine_settings(**fields: Any) -> Any:
    """An EngineConfig of these fields, or a usage error (exit 2) naming the bad
    setting's flag, value and what is allowed: before any model loads."""
    from ..daemon.engine.config import EngineConfig, SettingError

    try:
        return EngineConfig(**fields)
    except SettingError as e:
        raise click.UsageError(f"Invalid value for '{e.flag}': {e}") from None


def engine_option(f: Any) -> tuple[str, str, type, Any]:
    """(option name, flag, type, default) of an EngineConfig field: the option name is
    the flag's (`--host-blocks` -> host_blocks), as a config file spells it too."""
    flag = str(f.metadata["flag"])
    name = flag.split("/")[0].lstrip("-").replace("-", "_")
    kind = {"bool": bool, "int": int, "float": float}.get(str(f.type).split(" |")[0], str)
    return name, flag, kind, f.default


# option name -> EngineConfig field, for the engine's settings
ENGINE_OPTIONS: dict[str, str] = {engine_option(f)[0]: f.name for f in setting_fields()}


def speculative_config(text: str) -> dict[str, int]:
    """vLLM's `--speculative-config` JSON, as the EngineConfig fields it sets: method
    "ngram" only (prompt lookup), `num_speculative_tokens`, `prompt_lookup_min` and
    `prompt_lookup_max`, which default to each other, or both to 5, as vLLM's do, and
    `disable_by_batch_size`. A usage error names what is wrong."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise click.UsageError(f"--speculative-config must be a JSON object: {e}") from None
    if not isinstance(config, dict):
        raise click.UsageError(f"--speculative-config must be a JSON object; got {text!r}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "disable_by_batch_size"}  # fmt: skip
    if unknown := sorted(set(config) - known):
        raise click.UsageError(
            f"--speculative-config: unknown key(s) {unknown}; reprise takes {sorted(known)}"
        )
    if config.get("method") != "ngram":
        raise click.UsageError(
            '--speculative-config: method must be "ngram" (prompt lookup, the one reprise '
            f"has); got {config.get('method')!r}"
        )
    if "num_speculative_tokens" not in config:
        raise click.UsageError("--speculative-config needs num_speculative_tokens")
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    low, high = (high if low is None else low), (low if high is None else high)
    fields = {
        "speculative_tokens": config["num_speculative_tokens"],
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
    }
    if "disable_by_batch_size" in config:
        fields["speculative_disable_by_batch_size"] = config["disable_by_batch_size"]
    return fields


def engine_options(command: Any) -> Any:
    """One click option per EngineConfig field: its flag, help text and default come
    from the field, so `reprise serve --help` and `reprise bench --help` say what the
    Python API does. Each option is None unless given (the field's default then)."""
    kind: type | click.ParamType  # a field's Python type, or the choices it allows
    for f in reversed(setting_fields()):
        name, flag, kind, default = engine_option(f)
        help_text = str(f.metadata["help"])
        if default is not None and "[default:" not in help_text:
            shown = ("on" if default else "off") if isinstance(default, bool) else default
            help_text += f" [default: {shown}]"
        if "choices" in f.metadata:
            kind = click.Choice(f.metadata["choices"])
        if kind is bool:
            command = click.option(flag, name, default=None, help=help_text)(command)
        else:
            command = click.option(flag, name, type=kind, default=None, help=help_text)(command)
    return command
