"""Tokenizer, chat template and streaming detokenizer for a Hugging Face model folder.

Guarantees:
- `encode` / `decode` give what transformers' fast tokenizer gives for the same folder:
  special-token strings in the text become their ids, and `tokenizer.json`'s post-processor
  adds BOS/EOS. An explicit `add_bos_token` / `add_eos_token` in `tokenizer_config.json`
  replaces that post-processor (as transformers' Llama tokenizers do). One deliberate
  difference: BOS is never added in front of text that already starts with BOS (transformers
  would give two).
- `apply_chat_template` renders what `apply_chat_template(..., tokenize=False)` renders: same
  sandboxed jinja environment, filters, globals and variables; messages are checked first.
- `IncrementalDetokenizer` never emits part of a UTF-8 character (no delta holds U+FFFD unless
  the decode so far does), and its deltas joined (plus `flush()`) equal `decode` of the
  generated ids whenever those ids form whole characters. Each `push` decodes a window of at
  most 32 tokens, so a token costs O(1), not O(length of the text).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from .spm_model import spm_tokenizer

REPLACEMENT_CHAR = "\ufffd"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# NOTE: bounds the detokenizer's window. Valid text completes a character within a few tokens;
# 16 tokens in a row that still end inside one are a malformed byte stream, emitted as it is.
_MAX_HELD_TOKENS = 16
_PROMPT_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, fails, or calls `raise_exception`."""


class InvalidMessagesError(ValueError):
    """The messages passed to `apply_chat_template` are not a list of valid message dicts."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_JINJA_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_JINJA_ENV.filters["tojson"] = _tojson
_JINJA_ENV.globals["raise_exception"] = _raise_exception
_JINJA_ENV.globals["strftime_now"] = _strftime_now


@dataclass(slots=True)
class Tokenizer:
    """A fast tokenizer plus the special tokens and chat templates of one model folder."""

    backend: BackendTokenizer = field(repr=False)
    special_tokens: dict[str, str]  # "bos_token" -> "<s>", only the ones the folder sets
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_templates: dict[str, str] = field(repr=False)  # name -> source; "default" is used
    _compiled: dict[str, jinja2.Template] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        config = _read_json_object(path / "tokenizer_config.json")
        if not tokenizer_file.is_file() and (path / "tokenizer.model").is_file():
            # a SentencePiece model alone (spm_model.py): transformers' slow Llama
            # tokenizer's file, BOS first unless the config says otherwise
            bos, eos = (_token_content(config.get(k), k) for k in ("bos_token", "eos_token"))
            backend = spm_tokenizer(path / "tokenizer.model", bos or "<s>", eos or "</s>",
                                    add_bos=bool(config.get("add_bos_token", True)))  # fmt: skip
        elif not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: a model folder needs tokenizer.json (or a "
                "SentencePiece tokenizer.model)"
            )
        else:
            try:
                backend = BackendTokenizer.from_file(str(tokenizer_file))
            except Exception as exc:  # the tokenizers package raises a bare Exception
                raise ValueError(f"{tokenizer_file}: not a tokenizers file: {exc}") from exc
        generation = _read_json_object(path / "generation_config.json")

        special_tokens = {
            key: content
            for key in _SPECIAL_TOKEN_KEYS
            if (content := _token_content(config.get(key), key)) is not None
        }
        # Like transformers: a named special token missing from the vocabulary is added to it.
        backend.add_special_tokens(
            [
                AddedToken(content, special=True, normalized=False)
                for content in dict.fromkeys(special_tokens.values())
                if backend.token_to_id(content) is None
            ]
        )
        token_ids = {key: backend.token_to_id(content) for key, content in special_tokens.items()}
        if "add_bos_token" in config or "add_eos_token" in config:
            bos = special_tokens.get("bos_token") if config.get("add_bos_token") else None
            eos = special_tokens.get("eos_token") if config.get("add_eos_token") else None
            backend.post_processor = _bos_eos_processor(backend, bos, eos)

        eos_id = token_ids.get("eos_token")  # every named token is in the vocabulary by now
        eos_ids = [eos_id] if eos_id is not None else []
        eos_ids += _generation_eos_ids(generation, path, backend.get_vocab_size())
        chat_templates = _chat_templates(config.get("chat_template"), path)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # newer transformers save it here, and it wins over the config
            chat_templates = {"default": jinja_file.read_text(encoding="utf-8")}
        processor_file = path / "chat_template.json"  # a multimodal processor's (Gemma 3's)
        if not chat_templates and processor_file.is_file():
            chat_templates = _chat_templates(
                json.loads(processor_file.read_text(encoding="utf-8")).get("chat_template"), path
            )
        return cls(
            backend=backend,
            special_tokens=special_tokens,
            bos_token_id=token_ids.get("bos_token"),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            pad_token_id=token_ids.get("pad_token"),
            chat_templates=chat_templates,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a long prompt
        # tokenized on the daemon's tokenizing thread does not stall the engine loop.
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        token_ids = encoding.ids
        mask = encoding.special_tokens_mask  # 1 where the post-processor added the token
        if (
            add_special_tokens
            and self.bos_token_id is not None
            and len(token_ids) >= 2
            and token_ids[0] == token_ids[1] == self.bos_token_id
            and (mask[0], mask[1]) == (1, 0)
        ):
            # The text brings its own BOS (a rendered chat template usually does): keep one.
            del token_ids[0]
        return token_ids

    def max_token_bytes(self) -> int | None:
        """An upper bound on the UTF-8 bytes of input text one token covers: the longest
        decoded vocabulary entry (a partial UTF-8 byte decodes to U+FFFD, 3 bytes, which
        only loosens it). None when the tokenizer has a normalizer, which may drop text
        before the model sees it, so that no such bound holds."""
        if self.backend.normalizer is not None:
            return None
        pieces = self.backend.decode_batch([[i] for i in range(self.vocab_size)])
        return max(len(p.encode("utf-8", "surrogatepass")) for p in pieces)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does.

        `continue_final_message` (transformers' and vLLM's; not with add_generation_prompt)
        leaves the last message open: the text ends where its content ends, whatever the
        template writes after it (an end-of-turn token), so an answer continues it."""
        conversation = validate_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be set"
            )
        template = self._template("tool_use" if tools is not None else "default")
        variables = {
            **self.special_tokens,
            "documents": None,
            **extra,
            "messages": conversation,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is untrusted code: any failure is its failure
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return _open_final_message(text, conversation[-1]) if continue_final_message else text

    def use_chat_template(self, source: str) -> None:
        """Render every chat with `source` (a server's --chat-template), in place of the
        folder's templates; ChatTemplateError if it does not compile."""
        check_chat_template(source)
        self.chat_templates = {"default": source}
        self._compiled.clear()

    def _template(self, name: str) -> jinja2.Template:
        if name not in self.chat_templates:
            name = "default"
        compiled = self._compiled.get(name)
        if compiled is None:
            source = self.chat_templates.get(name)
            if source is None:
                raise ChatTemplateError(
                    "this model has no default chat template (tokenizer_config.json 'chat_template'"
                    f" or chat_template.jinja); templates found: {sorted(self.chat_templates)}"
                )
            try:
                compiled = _JINJA_ENV.from_string(source)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"chat template {name!r} does not compile: {exc}") from exc
            self._compiled[name] = compiled
        return compiled


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check a chat; return it with None-valued keys dropped (as transformers does)."""
    if not isinstance(messages, list):
        raise InvalidMessagesError(
            f"messages must be a list of dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidMessagesError("messages is empty: a chat needs at least one message")
    for idx, message in enumerate(messages):
        if (problem := _message_problem(message)) is not None:
            raise InvalidMessagesError(f"messages[{idx}]{problem}")
    return [{key: value for key, value in m.items() if value is not None} for m in messages]


def _message_problem(message: object) -> str | None:
    if not isinstance(message, dict):
        return f" must be a dict, got {type(message).__name__}"
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        return ".role is missing" if role is None else f".role must be a string, got {role!r:.80}"
    if content is None:
        return None if message.get("tool_calls") is not None else ".content is missing"
    if isinstance(content, list):
        for part_idx, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                return f".content[{part_idx}] must be a text part, got {part!r:.80}"
            if not isinstance(part.get("text"), str):
                return f".content[{part_idx}].text must be a string, got {part.get('text')!r:.80}"
    elif not isinstance(content, str):
        return f".content must be a string or a list of text parts, got {type(content).__name__}"
    return None


def _open_final_message(text: str, final: dict[str, Any]) -> str:
    """`text`, a rendered chat, cut where its last message's content ends: after its last
    occurrence, with the content's trailing spaces if the template kept them."""
    content = final.get("content")
    if isinstance(content, list):  # text parts: the last one is where the chat ends
        content = content[-1]["text"] if content else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a last message with text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not write the last message's "
            "content as given, so there is no place to continue it"
        )
    kept = content.lstrip()
    if text[at : at + len(kept)] == kept:  # trailing spaces kept by the template
        return text[: at + len(kept)]
    return text[: at + len(content.strip())]


def check_chat_template(source: str) -> None:
    """That `source` compiles as a chat template (ChatTemplateError saying where not)."""
    try:
        _JINJA_ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    The vLLM / TGI scheme: the window `_ids` holds the tokens already emitted in the previous
    step (context, so the decoder sees the same neighbours as a full decode) plus those not yet
    emitted. Each push decodes the window and emits what goes beyond the context's text, unless
    the text ends in U+FFFD (an incomplete character), which is held until it completes.
    """

    __slots__ = (
        "_backend",
        "_ids",
        "_num_context",
        "_pieces",
        "_prefix_len",
        "skip_special_tokens",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = False,
    ) -> None:
        self._backend = tokenizer.backend
        self.skip_special_tokens = skip_special_tokens
        # [context tokens (already emitted) | held tokens]
        self._ids: list[int] = [int(i) for i in prompt_ids[-_PROMPT_CONTEXT_TOKENS:]]
        self._num_context = len(self._ids)
        self._prefix_len = len(self._decode(self._ids))  # chars of the window already emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        window_text = self._decode(self._ids)
        num_held = len(self._ids) - self._num_context
        if num_held < _MAX_HELD_TOKENS and (
            len(window_text) <= self._prefix_len or window_text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of generation: emit whatever is held, U+FFFD included."""
        return self._emit(self._decode(self._ids))

    def _emit(self, window_text: str) -> str:
        delta = window_text[self._prefix_len :]
        # The tokens just emitted become the next window's context.
        del self._ids[: self._num_context]
        self._num_context = len(self._ids)
        self._prefix_len = len(self._decode(self._ids))
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def _bos_eos_processor(
    backend: BackendTokenizer, bos: str | None, eos: str | None
) -> processors.TemplateProcessing:
    """The post-processor transformers builds from add_bos_token / add_eos_token."""

    def pieces(sequence: str, type_id: int) -> list[str]:
        head = [f"{bos}:{type_id}"] if bos is not None else []
        tail = [f"{eos}:{type_id}"] if eos is not None else []
        return [*head, f"${sequence}:{type_id}", *tail]

    return processors.TemplateProcessing(
        single=pieces("A", 0),
        pair=pieces("A", 0) + pieces("B", 1),
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t],
    )


def _generation_eos_ids(generation: dict[str, Any], path: Path, vocab_size: int) -> list[int]:
    value = generation.get("eos_token_id")
    eos_ids = value if isinstance(value, list) else [] if value is None else [value]
    for token_id in eos_ids:
        if type(token_id) is not int or not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{path / 'generation_config.json'}: eos_token_id {value!r} holds {token_id!r},"
                f" which is not a token id in [0, {vocab_size})"
            )
    return eos_ids


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: object, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"tokenizer_config.json: {key} must be a string or an object with 'content', got {value!r}"
    )


def _chat_templates(value: object, path: Path) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(
        f"{path / 'tokenizer_config.json'}: chat_template must be a string or a list of"
        f" {{'name', 'template'}} objects, got {value!r:.200}"
    )
