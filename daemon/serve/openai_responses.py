"""OpenAI's response shapes, built from what the daemon sent (TokenChunk, Done).

The builders only reshape: every value in a response is one the daemon computed, so a
streamed answer and a whole one carry the same tokens, text and logprobs.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any

from ...ipc.messages import Done, TokenChunk
from . import reasoning_parsers, tool_parsers
from .openai_api import ParsedRequest


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(dones: list[Done], n: int = 1) -> dict[str, Any]:
    """Token counts of a request's choices, n a prompt (choices i * n .. i * n + n - 1 are
    prompt i's): each prompt once (as OpenAI counts it), its cached tokens as its first
    choice found them."""
    firsts = dones[::n]
    prompt = sum(d.prompt_tokens for d in firsts)
    completion = sum(len(d.token_ids) for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)}}  # fmt: skip


def finish_reason(done: Done) -> str:
    return "abort" if done.finish_reason == "cancelled" else done.finish_reason


class LogprobsBuilder:
    """One choice's logprobs in the shape its endpoint answers with; `text_offset`
    (completions) counts characters of the tokens' texts from the completion's start."""

    def __init__(self, kind: str, as_ids: bool = False) -> None:
        self.kind = kind
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: "token_id:{id}" for each text
        self.offset = 0

    def build(self, wire: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if wire is None:
            return None
        if self.as_ids:
            wire = [{**lp, "token": f"token_id:{lp['id']}",
                     "top": [[t, f"token_id:{t}", v] for t, _, v in lp["top"]]} for lp in wire]  # fmt: skip
        if self.kind == "chat":
            return {"content": [self._chat_entry(lp) for lp in wire]}
        offsets = []
        for lp in wire:
            offsets.append(self.offset)
            self.offset += len(lp["token"])
        return {
            "tokens": [lp["token"] for lp in wire],
            "token_logprobs": [lp["logprob"] for lp in wire],
            "top_logprobs": [self._top(lp) for lp in wire],
            "text_offset": offsets,
        }

    @staticmethod
    def _top(lp: dict[str, Any]) -> dict[str, float] | None:
        """A completion position's top_logprobs: its alternatives and the token itself,
        so up to logprobs + 1 entries (OpenAI's and vLLM's rule: a sampled or prompt token
        outside the top is listed too; with logprobs 0 it is alone); an echoed prompt's
        first token has no logprob: null, as OpenAI's."""
        if lp["logprob"] is None:
            return None
        top = {t: v for _, t, v in lp["top"]}
        top.setdefault(lp["token"], lp["logprob"])
        return top

    @staticmethod
    def _chat_entry(lp: dict[str, Any]) -> dict[str, Any]:
        def one(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {**one(lp["token"], lp["logprob"]),
                "top_logprobs": [one(t, v) for _, t, v in lp["top"]]}  # fmt: skip


def response(parsed: ParsedRequest, request_id: str, model: str, dones: list[Done]) -> dict:
    """The whole (non-streaming) answer."""
    choices = []
    for index, done in enumerate(dones):
        logprobs = LogprobsBuilder(parsed.kind, parsed.tokens_as_ids).build(done.logprobs)
        text = done.text
        if parsed.echo:
            text, logprobs = _echoed(parsed, parsed.prompts[index // parsed.n], done)
        if parsed.kind == "chat":
            reasoning: str | None = None
            content: str | None = done.text
            if parsed.reasoning_parser is not None:
                reasoning, content = reasoning_parsers.split(parsed.reasoning_parser, done.text)
            message = {"role": "assistant", "content": _joined(parsed.chat_echo, content)}
            reason = finish_reason(done)
            if parsed.tool_mode is not None:
                message = {"role": "assistant", **tool_answer(parsed, content or "")}
                reason = tools_finish_reason(parsed, message, reason)
            if parsed.reasoning_parser is not None:  # vLLM's field, and its newer name
                message["reasoning_content"] = message["reasoning"] = reasoning
            choice = {"index": index, "message": message, "logprobs": logprobs,
                      "finish_reason": reason, "stop_reason": done.stop_reason}  # fmt: skip
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason(done), "stop_reason": done.stop_reason}  # fmt: skip
            if parsed.num_prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(done, parsed.num_prompt_logprobs)
            if parsed.return_token_ids:
                choice["prompt_token_ids"] = done.prompt_token_ids
        if parsed.return_token_ids:
            choice["token_ids"] = done.token_ids
        choices.append(choice)
    obj = "chat.completion" if parsed.kind == "chat" else "text_completion"
    answer = {"id": request_id, "object": obj, "created": int(time.time()), "model": model,
              "choices": choices, "usage": usage(dones, parsed.n)}  # fmt: skip
    if parsed.kind == "chat" and parsed.num_prompt_logprobs is not None:  # one prompt: top level
        answer["prompt_logprobs"] = prompt_logprobs(dones[0], parsed.num_prompt_logprobs)
    if parsed.kind == "chat" and parsed.return_token_ids:
        answer["prompt_token_ids"] = dones[0].prompt_token_ids
    return answer


def _joined(echo: str, content: str | None) -> str | None:
    """A chat message's content: the echoed message, then the answer's (None: neither)."""
    return echo + content if content is not None else (echo or None)


def prompt_logprobs(done: Done, num_top: int) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first (no context), else
    {token id: {"logprob", "rank", "decoded_token"}} for the prompt token and its
    `num_top` most likely alternatives (ranked 1, 2, ... in order)."""
    assert done.prompt_logprobs is not None, "the daemon was asked for them"
    out: list[dict[int, dict[str, Any]] | None] = [None]
    for lp in done.prompt_logprobs[1:]:
        entry = {t: {"logprob": v, "rank": i, "decoded_token": text}
                 for i, (t, text, v) in enumerate(lp["top"][:num_top], 1)}  # fmt: skip
        entry[lp["id"]] = {"logprob": lp["logprob"], "rank": lp["rank"],
                           "decoded_token": lp["token"]}  # fmt: skip
        out.append(entry)
    return out


def tool_answer(parsed: ParsedRequest, text: str) -> dict[str, Any]:
    """A tool choice's answer as the message's fields, as vLLM gives it: its tool calls
    (`content` ""); a named function's call takes the answer as its arguments, a required
    choice's answer is a JSON list of {"name", "parameters"}, and "auto"'s calls are read
    from the model's own text by the server's parser (`content` the text before them, or
    None). An answer that holds no such call (cut short by max_tokens, or "auto"'s plain
    text) comes back as `content`, with no tool call."""
    content: str | None = ""
    if parsed.tool_mode == "named":
        assert parsed.tool_name is not None  # a named choice names its function
        calls = [(parsed.tool_name, text)]
    elif parsed.tool_mode == "required":
        try:
            calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                     for c in json.loads(text)]  # fmt: skip
        except (ValueError, KeyError, TypeError, RecursionError):
            return {"content": text}
    else:  # "auto": the model's own format, read by the server's parser
        answer = tool_parsers.parse(parsed.tool_mode, text)  # type: ignore[arg-type]
        if not answer.calls:
            return {"content": text}
        content, calls = answer.content, answer.calls
    return {"content": content, "tool_calls": [
        {"id": tool_parsers.call_id(parsed.tool_call_parser), "type": "function",
         "function": {"name": name, "arguments": arguments}} for name, arguments in calls]}  # fmt: skip


def tools_finish_reason(parsed: ParsedRequest, message: dict[str, Any], reason: str) -> str:
    """ "tool_calls" when the model chose to call tools (tool_choice "auto"), as vLLM's;
    a required or named choice keeps the answer's own reason."""
    auto = parsed.tool_mode not in ("named", "required")
    return "tool_calls" if auto and message.get("tool_calls") else reason


def _echoed(
    parsed: ParsedRequest, sent: str | list[int], done: Done
) -> tuple[str, dict[str, Any] | None]:
    """An echo's text and logprobs: the prompt's (`sent`), then the completion's. A text
    prompt echoes as sent; token ids as their tokens' texts joined."""
    prompt = done.prompt_logprobs
    if isinstance(sent, str):
        text = sent
    else:
        assert prompt is not None, "an echo of token ids asks for the prompt's tokens"
        text = "".join(lp["token"] for lp in prompt)
    if parsed.num_logprobs is None:
        return text + done.text, None
    assert prompt is not None and done.logprobs is not None
    if parsed.num_prompt_logprobs is not None:  # the daemon gave the larger top lists
        prompt = [{**lp, "top": lp["top"][: parsed.num_logprobs]} for lp in prompt]
    builder = LogprobsBuilder(parsed.kind, parsed.tokens_as_ids)
    return text + done.text, builder.build(prompt + done.logprobs)


class StreamBuilder:
    """The server-sent event payloads of one streamed answer, chunk by chunk."""

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str) -> None:
        self.parsed = parsed
        self.head = {"id": request_id, "object": self._object, "created": int(time.time()),
                     "model": model}  # fmt: skip
        self.logprobs = [
            LogprobsBuilder(parsed.kind, parsed.tokens_as_ids) for _ in range(parsed.num_choices)
        ]
        self.started = [False] * parsed.num_choices
        # tool_choice "auto": each choice's content, held back while it may begin a call
        self.content = [tool_parsers.content_stream(parsed.tool_mode)
                        for _ in range(parsed.num_choices)]  # fmt: skip
        # a named tool choice: each choice's call id, once its first piece went out
        self.call_ids = [""] * parsed.num_choices
        # return_token_ids: whether each choice's prompt ids went out (on its first event)
        self.ids_sent = [False] * parsed.num_choices
        # continuous usage stats: each choice's prompt length and tokens so far
        self.prompt_tokens = [0] * parsed.num_choices
        self.completion_tokens = [0] * parsed.num_choices
        # a reasoning parser: each choice's thinking apart from its content as it streams
        parser = parsed.reasoning_parser
        self.reasoning = [reasoning_parsers.ReasoningStream(parser) if parser else None
                          for _ in range(parsed.num_choices)]  # fmt: skip

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.parsed.kind == "chat" else "text_completion"

    def _event(
        self, choices: list[dict[str, Any]], usage_: Any = None, index: int | None = None
    ) -> dict[str, Any]:
        """An event of `choices`; under continuous usage stats, a chunk of choice `index`
        carries that choice's usage so far (vLLM's), else usage is null until the last."""
        event = {**self.head, "choices": choices}
        if self.parsed.include_usage:
            if index is not None and self.parsed.continuous_usage:
                prompt, completion = self.prompt_tokens[index], self.completion_tokens[index]
                usage_ = {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}  # fmt: skip
            event["usage"] = usage_
        return event

    def _choice(
        self, index: int, text: str, logprobs: Any, reason: str | None, delta: Any = None,
        stop_reason: int | str | None = None,
    ) -> dict:  # fmt: skip
        if self.parsed.kind == "chat":
            if delta is None:
                delta = {} if reason is not None and not text else {"content": text}
            if not self.started[index]:
                if self.parsed.chat_echo:  # vLLM's echo: the first delta carries it
                    delta = {**delta, "content": self.parsed.chat_echo + delta.get("content", "")}
                delta = {"role": "assistant", **delta}
                self.started[index] = True
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                    "stop_reason": stop_reason}  # fmt: skip
        if self.parsed.echo and not self.started[index]:  # a streamed echo: the prompt first
            text = self.parsed.prompts[index // self.parsed.n] + text
            self.started[index] = True
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason}  # fmt: skip

    def chunk(self, index: int, chunk: TokenChunk) -> dict[str, Any]:
        stream, thought = self.reasoning[index], ""
        if stream is not None:  # the chunk's text: its thinking, then content as below
            thought, text = stream.push(chunk.text)
            chunk = replace(chunk, text=text)
        event = self._with_reasoning(self._chunk(index, chunk), thought)
        return self._with_ids(event, index, chunk.token_ids, chunk.prompt_token_ids)

    @staticmethod
    def _with_reasoning(event: dict[str, Any], thought: str) -> dict[str, Any]:
        """A chat event's delta with the thinking it lets out (vLLM's reasoning_content,
        and its newer name reasoning), and no empty content beside it."""
        if thought:
            delta = event["choices"][0]["delta"]
            if delta.get("content") == "":
                del delta["content"]
            delta["reasoning_content"] = delta["reasoning"] = thought
        return event

    def _with_ids(
        self, event: dict[str, Any], index: int, token_ids: list[int], prompt_ids: list[int] | None
    ) -> dict[str, Any]:
        """vLLM's return_token_ids in a stream: each event's choice has the ids of its
        tokens, and a choice's first event the prompt's (chat: at the event's top level)."""
        if not self.parsed.return_token_ids:
            return event
        (choice,) = event["choices"]
        choice["token_ids"] = list(token_ids)
        if not self.ids_sent[index]:
            self.ids_sent[index] = True
            (event if self.parsed.kind == "chat" else choice)["prompt_token_ids"] = prompt_ids
        return event

    def _chunk(self, index: int, chunk: TokenChunk) -> dict[str, Any]:
        self.prompt_tokens[index] = chunk.prompt_tokens
        self.completion_tokens[index] += len(chunk.token_ids)
        logprobs = self.logprobs[index].build(chunk.logprobs)
        mode = self.parsed.tool_mode
        if mode == "named":  # the answer is the call's arguments: they stream as they come
            call: dict[str, Any] = {"index": 0, "function": {"arguments": chunk.text}}
            if not self.call_ids[index]:  # the first piece names the call
                self.call_ids[index] = tool_parsers.call_id(self.parsed.tool_call_parser)
                call = {"index": 0, "id": self.call_ids[index], "type": "function",
                        "function": {"name": self.parsed.tool_name, "arguments": chunk.text}}  # fmt: skip
            return self._event(
                [self._choice(index, "", logprobs, None, delta={"tool_calls": [call]})],
                index=index,
            )
        if mode == "required":  # a JSON list of calls: they come whole, last
            return self._event([self._choice(index, "", logprobs, None, delta={})], index=index)
        if (content := self.content[index]) is not None:  # "auto": until it may be a call
            text = content.push(chunk.text)
            choice = self._choice(index, text, logprobs, None, delta={"content": text})
            return self._event([choice], index=index)
        return self._event([self._choice(index, chunk.text, logprobs, None)], index=index)

    def done(self, index: int, done: Done) -> dict[str, Any]:
        # the whole answer's counts (a stop string may have cut tokens already streamed)
        self.prompt_tokens[index], self.completion_tokens[index] = (
            done.prompt_tokens,
            len(done.token_ids),
        )
        delta: dict[str, Any] | None = None
        reason = finish_reason(done)
        stream, thought, text = self.reasoning[index], "", done.text
        if stream is not None:  # what was held back, and the whole answer's content
            thought, rest = stream.push("", final=True)
            text = reasoning_parsers.split(stream.parser, done.text)[1] or ""
            if self.parsed.tool_mode is None:
                delta = {"content": rest} if rest else {}
        if self.parsed.tool_mode == "named" and self.call_ids[index]:
            delta = {}  # its arguments were streamed
        elif self.parsed.tool_mode is not None:
            answer = tool_answer(self.parsed, text)  # the whole answer
            reason = tools_finish_reason(self.parsed, answer, reason)
            calls, content = answer.get("tool_calls"), answer["content"] or ""
            # what of the content was not streamed ("auto" holds back what may begin a
            # call; its content is a prefix of the answer as written)
            auto = self.content[index]
            rest = content if auto is None else auto.rest(content)
            delta = {"content": rest} if rest or calls is None else {}
            if calls is not None:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        event = self._event(
            [self._choice(index, "", None, reason, delta=delta, stop_reason=done.stop_reason)],
            index=index,
        )
        if self.parsed.kind == "chat":
            event = self._with_reasoning(event, thought)
        return self._with_ids(event, index, [], done.prompt_token_ids)

    def usage(self, dones: list[Done]) -> dict[str, Any]:
        return self._event([], usage(dones, self.parsed.n))
