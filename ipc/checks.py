"""The protocol's error and the checks of its requests' fields.

`ProtocolError` is what every check raises (its `code` one of `ERROR_CODES`). The
checkers take a field's name and value and raise `bad_request` naming the field and
its bad value, so the daemon can answer and keep serving; they read the wire's shapes
(msgpack's lists, maps, strings and 64-bit integers), never the daemon's objects.
The logit bias's wire form ([token id, bias] pairs) is converted here too.
"""

from __future__ import annotations

from typing import Any

MAX_ID_CHARS = 128
# msgpack's integers: int64 and uint64; a value outside cannot be sent at all
WIRE_INT_MIN, WIRE_INT_MAX = -(1 << 63), (1 << 64) - 1

ERROR_CODES = frozenset(
    {
        "bad_message",  # not a msgpack map, truncated, or no usable `type`
        "bad_request",  # a field is missing, unknown, or of the wrong type or range
        "unknown_type",
        "unsupported_version",
        "too_large",  # the message is over the daemon's size limit
        "prompt_too_long",  # the prompt does not fit in the model's context
        "busy",  # the request queue is full
        "duplicate_id",  # this client already has a running request with this id
        "not_found",  # cancel of a request the daemon does not know
        "shutting_down",
        "internal",
    }
)


class ProtocolError(Exception):
    """A message the daemon cannot accept; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def bad(message: str) -> ProtocolError:
    return ProtocolError("bad_request", message)


def check_type(name: str, value: object, *types: type) -> None:
    """Raise bad_request unless `value` is one of `types` (bool is never an int here)."""
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise bad(f"{name} must be {names}; got {type(value).__name__} {short(value)}")
    if isinstance(value, int) and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        raise bad(f"{name} must fit in 64 bits (-2**63 to 2**64 - 1); got {short(value)}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, as JSON's "\ud800" makes one
            raise bad(
                f"{name} is not valid Unicode: a lone surrogate at character {e.start}"
            ) from None


def check_wire_json(name: str, value: object) -> None:
    """Free-form JSON (template variables, a tool's parameters, documents): every integer
    and string in it, map keys too, one the wire carries (check_type's rule), else
    bad_request naming `name`. Walked without recursion: the nesting is the sender's."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int | str) and not isinstance(item, bool):
            check_type(name, item, type(item))


def check_id(name: str, value: object) -> None:
    check_type(name, value, str)
    assert isinstance(value, str)
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise bad(f"{name} must have 1 to {MAX_ID_CHARS} characters; got {len(value)}")


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


MAX_TOOLS = (
    128  # tools one chat request may give the chat template (and tool calls a message holds)
)


def check_messages(messages: object) -> None:
    """Chat messages: a non-empty list of {role, content} maps of strings; for tool use,
    an assistant message may hold `tool_calls` (then its content may be None) and a tool
    message a `tool_call_id`, and any message a `name`."""
    check_type("messages", messages, list)
    assert isinstance(messages, list)
    if not messages:
        raise bad("messages must hold at least one message")
    for i, m in enumerate(messages):
        check_type(f"messages[{i}]", m, dict)
        extra = set(m) - {"role", "content", "tool_calls", "tool_call_id", "name"}
        if extra or "role" not in m or "content" not in m:
            raise bad(
                f"messages[{i}] must have role and content (and may have tool_calls, "
                f"tool_call_id, name); got {sorted(m)}"
            )
        check_type(f"messages[{i}].role", m["role"], str)
        if "tool_calls" in m:
            _check_tool_calls(f"messages[{i}].tool_calls", m["tool_calls"])
            check_type(f"messages[{i}].content", m["content"], str, type(None))
        else:
            check_type(f"messages[{i}].content", m["content"], str)
        for key in ("tool_call_id", "name"):
            if key in m:
                check_type(f"messages[{i}].{key}", m[key], str)


MAX_TEMPLATE_KWARGS = 32  # chat_options.kwargs: extra variables one chat template is given
# the variables the renderer itself sets, which kwargs may not replace
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message"}
)


def check_chat_options(options: object) -> None:
    """How a chat template renders a request's messages (vLLM's chat options), a map of:
    `add_generation_prompt` (bool, default true), `continue_final_message` (bool, default
    false: the last message, the assistant's, is left open for the answer to continue;
    add_generation_prompt must then be false) and `kwargs` (extra template variables by
    name, e.g. {"enable_thinking": false}; at most MAX_TEMPLATE_KWARGS)."""
    check_type("chat_options", options, dict)
    assert isinstance(options, dict)
    unknown = set(options) - {"add_generation_prompt", "continue_final_message", "kwargs"}
    if unknown:
        raise bad(
            f"chat_options has unknown field(s) {', '.join(sorted(map(short, unknown)))}; known: "
            "add_generation_prompt, continue_final_message, kwargs"
        )
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in options:
            check_type(f"chat_options.{name}", options[name], bool)
    if options.get("continue_final_message") and options.get("add_generation_prompt", True):
        raise bad(
            "chat_options: continue_final_message needs add_generation_prompt false (the "
            "answer continues the last message rather than starting a new one)"
        )
    kwargs = options.get("kwargs", {})
    check_type("chat_options.kwargs", kwargs, dict)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad(f"chat_options.kwargs may name at most {MAX_TEMPLATE_KWARGS} variables")
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier() or len(key) > 64:
            raise bad(
                f"chat_options.kwargs names must be identifiers of at most 64 characters; got {short(key)}"
            )
        if key in RESERVED_TEMPLATE_NAMES:
            raise bad(f"chat_options.kwargs cannot set {key} (the renderer sets it)")
    check_wire_json("chat_options.kwargs", kwargs)


def _bounded_list(name: str, value: object, what: str) -> list[Any]:
    """`value`, a list of at most MAX_TOOLS items (ProtocolError naming `name` if not)."""
    check_type(name, value, list)
    assert isinstance(value, list)
    if len(value) > MAX_TOOLS:
        raise bad(f"{name} may hold at most {MAX_TOOLS} {what}; got {len(value)}")
    return value


def _check_tool_calls(name: str, calls: object) -> None:
    """An assistant message's tool calls: [{"id", "type": "function", "function": {"name",
    "arguments" (JSON text)}}], at most MAX_TOOLS."""
    for j, call in enumerate(_bounded_list(name, calls, "calls")):
        check_type(f"{name}[{j}]", call, dict)
        function = call.get("function")
        if set(call) - {"id", "type", "function"} or not isinstance(function, dict):
            raise bad(f"{name}[{j}] must be {{id, type, function: {{name, arguments}}}}")
        if set(function) != {"name", "arguments"}:
            raise bad(f"{name}[{j}].function must have name and arguments; got {sorted(function)}")
        check_type(f"{name}[{j}].function.name", function["name"], str)
        check_type(f"{name}[{j}].function.arguments", function["arguments"], str)
        for key in ("id", "type"):
            if key in call:
                check_type(f"{name}[{j}].{key}", call[key], str)


def check_tools(tools: object) -> None:
    """A chat's tools, for its template: [{"type": "function", "function": {"name", and
    optionally "description", "parameters" (a JSON schema), "strict"}}], at most MAX_TOOLS."""
    for i, tool in enumerate(_bounded_list("tools", tools, "tools")):
        check_type(f"tools[{i}]", tool, dict)
        function = tool.get("function")
        if set(tool) != {"type", "function"} or tool["type"] != "function":
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        check_type(f"tools[{i}].function", function, dict)
        if extra := set(function) - {"name", "description", "parameters", "strict"}:
            raise bad(f"tools[{i}].function has unknown field(s) {sorted(extra)}")
        check_type(f"tools[{i}].function.name", function.get("name"), str)
        if not function["name"]:
            raise bad(f"tools[{i}].function.name must not be empty")
        if "description" in function:
            check_type(f"tools[{i}].function.description", function["description"], str)
        if "parameters" in function:
            check_type(f"tools[{i}].function.parameters", function["parameters"], dict)
            check_wire_json(f"tools[{i}].function.parameters", function["parameters"])
        if "strict" in function:
            check_type(f"tools[{i}].function.strict", function["strict"], bool)


def check_bias_pair(pair: list[Any]) -> None:
    if len(pair) != 2:
        raise bad(f"sampling.logit_bias[] must be [token id, bias] pairs; got {short(pair)}")
    check_type("sampling.logit_bias[] token id", pair[0], int)
    check_type("sampling.logit_bias[] bias", pair[1], int, float)


def logit_bias_to_wire(bias: dict[int, float]) -> list[list[Any]]:
    """SamplingParams' {token id: bias} as the wire's pairs, in ascending id order."""
    return [[token, bias[token]] for token in sorted(bias)]


def logit_bias_from_wire(pairs: list[list[Any]] | None) -> dict[int, float] | None:
    """The wire's pairs (checked by Generate) as {token id: bias}; bad_request if an id
    comes twice."""
    if pairs is None:
        return None
    bias = {token: value for token, value in pairs}
    if len(bias) != len(pairs):
        raise bad("logit_bias names a token id twice")
    return bias


def check_chat_extras(
    messages: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
    chat_options: dict[str, Any] | None,
) -> None:
    """The tools and chat options of a request: they go with messages alone."""
    for name, value in (("tools", tools), ("chat_options", chat_options)):
        if value is not None and messages is None:
            raise bad(f"{name} go with messages (the chat template renders them)")
    if tools is not None:
        check_tools(tools)
    if chat_options is not None:
        check_chat_options(chat_options)
        if chat_options.get("continue_final_message") and messages[-1]["role"] != "assistant":  # type: ignore[index]
            raise bad(
                "chat_options: continue_final_message needs the last message to be the "
                f"assistant's; it is {short(messages[-1]['role'])}'s"  # type: ignore[index]
            )
