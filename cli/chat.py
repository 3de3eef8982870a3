"""`reprise chat`: a conversation with the daemon's model that one keeps open.

Each turn resends the whole conversation; its earlier turns are found in the KV cache,
and the line under each answer says how many prompt tokens were reused. Slash commands
manage the conversation (`/help` lists them). Ctrl-C stops an answer and drops that
turn (Up recalls the question); at the prompt it clears the line; Ctrl-D quits.
Line editing and history come from readline when stdin is a terminal; the history
lives in the reprise cache folder (REPRISE_CACHE_DIR moves it). When a script feeds
stdin there is no banner and no history, and a failed turn ends the chat (exit 1).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ..ipc.client import Client, DaemonUnavailable, RequestError
from .client_cmds import system_message
from .connect import connect, request_failed
from .display import separator, stats_table, stream_to, turn_summary
from .options import client_options, request_from, request_options, sampling_options

HISTORY_LENGTH = 1000
HELP = """\
/help            this list
/reset           forget the conversation (the system message stays)
/system [TEXT]   show the system message, or set it to TEXT (`/system -` removes it)
/stats           the daemon's cache counters, and this conversation's reuse
/save FILE       write the conversation as JSON {"system": ..., "messages": [...]}
/load FILE       continue a conversation that /save wrote
/quit            leave (as Ctrl-D)
Ctrl-C stops an answer and drops the turn; a line starting with // sends one starting with /."""


@dataclass(slots=True)
class Conversation:
    """The system message and the user/assistant turns so far."""

    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    @property
    def turn(self) -> int:
        """The number of the next user turn, from 1."""
        return 1 + sum(m["role"] == "user" for m in self.messages)

    def request(self, user_text: str) -> list[dict[str, str]]:
        """The turns so far and this one, after the system message: an empty one is sent
        (the chat template then writes no default of its own), None sends none."""
        user = {"role": "user", "content": user_text}
        return [*system_message(self.system), *self.messages, user]

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "messages": self.messages}

    @classmethod
    def from_json(cls, data: Any) -> Conversation:
        """Raises ValueError naming the first field that is wrong."""
        if not isinstance(data, dict) or set(data) - {"system", "messages"}:
            raise ValueError('expected an object with "system" and "messages"')
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f'"system" must be a string or null; got {type(system).__name__}')
        messages = data.get("messages", [])
        if not isinstance(messages, list):
            raise ValueError(f'"messages" must be a list; got {type(messages).__name__}')
        for i, m in enumerate(messages):
            ok = isinstance(m, dict) and set(m) == {"role", "content"}
            if (
                not ok
                or m["role"] not in ("user", "assistant")
                or not isinstance(m["content"], str)
            ):
                raise ValueError(
                    f'messages[{i}] must be {{"role": "user" or "assistant", '
                    f'"content": TEXT}}; got {json.dumps(m)[:80]}'
                )
        return cls(system, list(messages))

    @classmethod
    def load(cls, path: Path) -> Conversation:
        """Raises ValueError with one line saying what is wrong with the file."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text: {e.reason} at byte {e.start}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e.msg} at line {e.lineno}") from e
        try:
            return cls.from_json(data)
        except ValueError as e:
            raise ValueError(f"{path} is not a saved conversation: {e}") from e

    def save(self, path: Path) -> None:
        try:
            path.write_text(json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror or e}") from e


@dataclass(slots=True)
class Reuse:
    """Prompt tokens sent and served from the cache over the session."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_turns: int = 0

    def line(self) -> str:
        share = 100 * self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return (
            f"this chat: {self.num_turns} answers, reused {self.cached_tokens} of "
            f"{self.prompt_tokens} prompt tokens ({share:.0f} %)"
        )


class Repl:
    def __init__(
        self,
        client: Client,
        conversation: Conversation,
        options: dict[str, Any],
        *,
        strict: bool = False,
    ) -> None:
        """`strict`: a failed turn ends the chat with an error (when a script feeds it)."""
        from rich.console import Console

        self.client = client
        self.conversation = conversation
        self.options = options
        self.strict = strict
        self.reuse = Reuse()
        self.out = Console(highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)

    def note(self, text: str, style: str = "dim") -> None:
        self.err.print(text, style=style, markup=False)

    def run(self) -> None:
        while True:
            try:
                line = input(f"[{self.conversation.turn}] you> ")
            except KeyboardInterrupt:  # clears the line, as in a shell
                print()
                continue
            except EOFError:
                print()
                return
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and not text.startswith("//"):
                try:
                    if not self.command(text):
                        return
                except KeyboardInterrupt:  # a /stats waiting on a busy daemon
                    print()
                    self.note("interrupted")
                continue
            self.answer(text[1:] if text.startswith("//") else line)

    def answer(self, user_text: str) -> None:
        request = self.conversation.request(user_text)
        try:
            done = stream_to(self.client, request, self.options, sys.stdout)
        except KeyboardInterrupt:
            print()
            self.note("stopped; this turn is dropped (Up recalls it)")
            return
        except (RequestError, DaemonUnavailable) as e:
            print()
            error = request_failed(self.client, e)
            if self.strict:
                raise error from e
            hint = "; /reset starts afresh" if getattr(e, "code", "") == "prompt_too_long" else ""
            self.note(f"{error.message}{hint}; the turn is dropped", style="red")
            return
        print()
        self.note(turn_summary(done))
        self.reuse.prompt_tokens += done.prompt_tokens
        self.reuse.cached_tokens += done.cached_tokens
        self.reuse.num_turns += 1
        self.conversation.messages += [
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": done.text},
        ]

    def command(self, text: str) -> bool:
        """Run a slash command; False means quit."""
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            self.out.print(HELP, markup=False)
        elif name == "/reset":
            self.conversation.messages.clear()
            self.note(
                "conversation cleared"
                + (" (system message kept)" if self.conversation.system is not None else "")
            )
        elif name == "/system":
            self.system(arg)
        elif name == "/stats":
            self.stats()
        elif name in ("/save", "/load"):
            self.save_or_load(name, arg)
        else:
            self.note(f"unknown command {name}; /help lists the commands", style="red")
        return True

    def system(self, arg: str) -> None:
        if not arg:
            current = self.conversation.system
            shown = "no system message" if current is None else f"system: {current or '(empty)'}"
            self.note(shown)
        elif arg == "-":
            self.conversation.system = None
            self.note("system message removed")
        else:
            self.conversation.system = arg
            self.note("system message set; it applies from the next turn")

    def stats(self) -> None:
        try:
            stats = self.client.stats()
        except (RequestError, DaemonUnavailable) as e:
            self.note(f"no stats from the daemon: {e}", style="red")
            return
        self.out.print(stats_table(stats))
        self.note(self.reuse.line())

    def save_or_load(self, name: str, arg: str) -> None:
        if not arg:
            self.note(f"{name} needs a file name: {name} FILE", style="red")
            return
        path = Path(arg).expanduser()
        try:
            if name == "/save":
                self.conversation.save(path)
                self.note(f"saved {len(self.conversation.messages)} messages to {path}")
            else:
                self.conversation = Conversation.load(path)
                self.note(
                    f"loaded {len(self.conversation.messages)} messages from {path}"
                    + (" with a system message" if self.conversation.system is not None else "")
                )
        except ValueError as e:
            self.note(str(e), style="red")


def history_file() -> Path:
    from ..daemon.model.prepare import cache_dir

    return cache_dir() / "chat_history"


@contextmanager
def line_editing(enabled: bool) -> Iterator[None]:
    """readline's editing and a history kept across sessions, when `enabled`."""
    if not enabled:
        yield
        return
    try:
        import readline  # importing it is what makes input() edit lines
    except ImportError:  # pragma: no cover (not on every platform)
        yield
        return
    path = history_file()
    with suppress(OSError):  # none yet
        readline.read_history_file(path)
    readline.set_history_length(HISTORY_LENGTH)
    try:
        yield
    finally:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))  # private: it holds prompts
            readline.write_history_file(path)
        except OSError:
            pass  # history is a convenience; a read-only cache costs only that


def _load_option(ctx: click.Context, param: click.Parameter, value: Path | None) -> Any:
    if value is None:
        return None
    try:
        return Conversation.load(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


@click.command("chat")
@click.option(
    "--system",
    default=None,
    help='System message (--system "" sends an empty one, in place of the chat '
    "template's default).",
)
@click.option(
    "--load",
    "loaded",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_load_option,
    default=None,
    help="Continue a conversation saved with /save.",
)
@sampling_options
@request_options
@client_options
def chat_cmd(
    system: str | None,
    loaded: Conversation | None,
    socket: str | None,
    timeout: float,
    **kw: Any,
) -> None:
    """Talk with the model. Each turn resends the conversation, whose earlier turns are
    reused from the KV cache. /help lists the commands; Ctrl-D quits."""
    conversation = loaded or Conversation()
    if system is not None:  # `--system ""`: an empty system message, not none
        conversation.system = system
    interactive = sys.stdin.isatty()
    options = request_from(kw)  # a bad option is refused before connecting
    with connect(socket, timeout) as client, line_editing(interactive):
        repl = Repl(client, conversation, options, strict=not interactive)
        if interactive:
            model = client.health().model
            parts = [f"reprise chat with {model} at {client.address}", "/help for commands"]
            repl.note(separator().join([*parts, "Ctrl-D quits"]))
        repl.run()
