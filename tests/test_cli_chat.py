"""`reprise chat` as a person uses it: a pseudo-terminal (so readline, Ctrl-C and Ctrl-D
behave as at a keyboard) against a real `reprise serve` of a tiny synthetic model."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from reprise.ipc import Client

BLOCK_SIZE = 16
SUMMARY = r"reused (\d+) of (\d+) prompt tokens"
PROMPT = r"\[(\d+)\] you> "


class Terminal:
    """A command on a pseudo-terminal that is its controlling terminal; `expect` reads
    until a pattern shows up, as a person watching the screen would."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            preexec_fn=self._as_at_a_terminal,
        )
        os.close(slave)
        self.fd = master
        self.text = ""
        self.pos = 0

    @staticmethod
    def _as_at_a_terminal() -> None:
        """In the child before exec: the terminal becomes its controlling terminal, and
        Ctrl-C and Ctrl-\\ act as at a shell's prompt. NOTE: a test run started in the
        background by a non-interactive shell (`cmd &`, as CI may start it) ignores
        SIGINT and SIGQUIT, children inherit that, and Python keeps an ignored SIGINT
        ignored: Ctrl-C would do nothing."""
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)

    def expect(self, pattern: str, timeout_s: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.compile(pattern).search(self.text, self.pos)
            if match:
                self.pos = match.end()
                return match
            left = deadline - time.monotonic()
            ready = select.select([self.fd], [], [], max(left, 0))[0] if left > 0 else []
            data = b""
            if ready:
                with suppress(OSError):  # EIO: the command closed the terminal
                    data = os.read(self.fd, 65536)
            if not data:
                why = "timed out" if left <= 0 or not ready else "the terminal closed"
                raise AssertionError(
                    f"{why} waiting for {pattern!r}; screen:\n{self.text[-3000:]}"
                    f"{self.diagnosis() if why == 'timed out' else ''}"
                )
            self.text += data.decode("utf-8", "replace")

    def diagnosis(self) -> str:
        """Where a command that went quiet is: its process state and wait channel, then
        every thread's Python stack (faulthandler, on for it: SIGABRT makes it print them
        on the terminal, and ends it)."""
        pid = self.proc.pid
        state = ""
        with suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            state = next((line for line in status.splitlines() if line.startswith("State")), "")
            state += " wchan " + Path(f"/proc/{pid}/wchan").read_text()
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        stacks, deadline = b"", time.monotonic() + 5
        while time.monotonic() < deadline:
            if not select.select([self.fd], [], [], 0.2)[0]:
                if self.proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            stacks += chunk
        text = stacks.decode("utf-8", "replace")
        return f"\n-- the command: {state}\n-- its stacks after SIGABRT:\n{text[-6000:]}"

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout_s: float = 30) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            os.close(self.fd)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass(slots=True)
class Served:
    address: str
    proc: subprocess.Popen[bytes]
    model: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A daemon serving a tiny random model (answers are noise, fast)."""
    from reprise.daemon.model.synth import synth_model

    tmp = tmp_path_factory.mktemp("chat")
    model = synth_model("tiny", tmp / "tiny")
    address = f"ipc://{tmp}/d.sock"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "REPRISE_SOCKET")}
    log = (tmp / "serve.log").open("w+")
    cmd = [
        sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(model),
        "--backend", "numpy", "--socket", address, "--block-size", str(BLOCK_SIZE),
        "--num-device-blocks", "300", "--max-model-len", "4096", "--max-tokens-cap", "4096",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not Path(f"{tmp}/d.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise AssertionError(f"the daemon did not start:\n{log.read()[-3000:]}")
        time.sleep(0.1)
    yield Served(address, proc, model)
    proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    log.close()


@pytest.fixture(scope="module")
def daemon(served: Served) -> str:
    return served.address


@pytest.fixture
def chat(daemon: str, tmp_path: Path) -> Iterator[Callable[..., Terminal]]:
    started: list[Terminal] = []

    def start(*args: str) -> Terminal:
        env = {**os.environ, "REPRISE_CACHE_DIR": str(tmp_path / "cache"), "TERM": "xterm",
               "PYTHONFAULTHANDLER": "1"}  # fmt: skip  # stacks on SIGABRT (diagnosis)
        env.pop("REPRISE_SOCKET", None)
        term = Terminal(
            [sys.executable, "-m", "reprise.cli.main", "chat", "--socket", daemon,
             "--max-tokens", "4", *args],
            env,
        )  # fmt: skip
        started.append(term)
        return term

    yield start
    for term in started:
        term.kill()


def test_turns_reuse_the_conversation_and_commands_manage_it(chat, tmp_path: Path) -> None:
    term = chat("--system", "You are terse. " * 4, "--salt", "repl")
    term.expect(r"/help for commands")
    assert term.expect(PROMPT).group(1) == "1"
    term.type("Name a colour.\n")
    first = term.expect(SUMMARY)
    assert int(first.group(1)) == 0  # a fresh salt: nothing cached
    assert term.expect(PROMPT).group(1) == "2"
    term.type("Name another one.\n")
    second = term.expect(SUMMARY)
    before, now, total = int(first.group(2)), int(second.group(1)), int(second.group(2))
    # the first turn's prompt is this one's prefix: its full blocks are found again
    assert total > before and now >= (before // BLOCK_SIZE - 1) * BLOCK_SIZE and now > 0
    assert term.expect(PROMPT).group(1) == "3"

    term.type("/stats\n")
    term.expect(r"hit rate")
    term.expect(rf"this chat: 2 answers, reused {now} of {before + total} prompt tokens")
    term.expect(PROMPT)

    saved = tmp_path / "conversation.json"
    term.type(f"/save {saved}\n")
    term.expect(r"saved 4 messages")
    data = json.loads(saved.read_text())
    assert data["system"] == "You are terse. " * 4
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"] * 2
    assert data["messages"][2]["content"] == "Name another one."

    term.type("/reset\n")
    term.expect(r"conversation cleared \(system message kept\)")
    assert term.expect(PROMPT).group(1) == "1"
    term.type("/system\n")
    term.expect(r"system: You are terse\.")
    term.type(f"/load {saved}\n")
    term.expect(r"loaded 4 messages")
    assert term.expect(PROMPT).group(1) == "3"
    term.type("Once more.\n")
    # the loaded conversation is resent: its blocks are still cached
    assert int(term.expect(SUMMARY).group(1)) >= now

    term.type("/frobnicate\n")
    term.expect(r"unknown command /frobnicate; /help lists")
    term.type("/help\n")
    term.expect(r"/save FILE")
    term.expect(PROMPT)
    term.type("\x1b[A\n")  # Up recalls the last line (readline's history)
    term.expect(r"/save FILE")
    term.expect(PROMPT)
    term.type("\x04")  # Ctrl-D
    assert term.wait() == 0
    history = tmp_path / "cache" / "chat_history"
    assert "Name another one." in history.read_text() and "/frobnicate" in history.read_text()
    assert history.stat().st_mode & 0o777 == 0o600  # it holds prompts


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("{not json", r"is not JSON: .* at line 1"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', r"messages\[0\] must be"),
        ('{"system": 5, "messages": []}', r'"system" must be a string or null'),
        ("[1, 2]", r'expected an object with "system" and "messages"'),
    ],
)
def test_bad_conversation_files_get_one_line(chat, tmp_path: Path, content, error) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    term = chat()
    term.expect(PROMPT)
    term.type(f"/load {bad}\n/load {tmp_path / 'missing.json'}\n/save {tmp_path}\n")
    term.expect(error)
    term.expect(r"cannot read .*missing\.json: No such file")
    term.expect(r"cannot write .*: Is a directory")
    assert term.expect(PROMPT).group(1) == "1"  # the conversation is untouched
    term.type("\x04")
    assert term.wait() == 0


def test_ctrl_c_stops_the_answer_and_stays(chat, daemon: str) -> None:
    with Client(daemon, timeout_s=30) as client:
        allocated = client.stats()["alloc_total_blocks"]
    term = chat("--max-tokens", "4000")
    term.expect(PROMPT)
    term.type("Tell me a long story.\n")
    term.expect(r"Tell me a long story\.\r?\n.")  # the answer has begun
    term.type("\x03")  # Ctrl-C
    term.expect(r"stopped; this turn is dropped")
    assert term.expect(PROMPT).group(1) == "1"  # the turn is dropped; the REPL stays
    with Client(daemon, timeout_s=30) as client:
        deadline = time.monotonic() + 60
        while (stats := client.stats())["num_requests"] and time.monotonic() < deadline:
            time.sleep(0.2)
    assert stats["num_requests"] == 0
    # cancelled early: far fewer blocks than the 4000 tokens' 250 were ever allocated
    assert stats["alloc_total_blocks"] - allocated < 120
    term.type("half a line\x03")  # Ctrl-C at the prompt clears the line
    assert term.expect(PROMPT).group(1) == "1"
    term.type("/quit\n")
    assert term.wait() == 0


def test_a_refused_turn_is_one_line_and_the_repl_stays(chat, daemon: str) -> None:
    term = chat("--max-tokens", "5000")  # over the daemon's --max-tokens-cap (4096)
    term.expect(PROMPT)
    term.type("Hello.\n")
    term.expect(r"the daemon refused the request: .*max_tokens.*4096")
    term.expect(r"the turn is dropped")
    assert term.expect(PROMPT).group(1) == "1"
    term.type("\x04")
    assert term.wait() == 0
    # fed by a script, the same failure ends the chat with exit code 1 and one line
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_SOCKET"}
    done = subprocess.run(
        [sys.executable, "-m", "reprise.cli.main", "chat", "--socket", daemon,
         "--max-tokens", "5000"],
        input="Hello.\n", capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("Error: the daemon refused the request: ") and "5000" in line


def test_stats_tells_a_stopped_daemon_busy_not_missing(served: Served) -> None:
    """A daemon that accepts the connection but cannot answer (here: SIGSTOP) is busy."""
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_SOCKET"}
    cmd = [sys.executable, "-m", "reprise.cli.main", "stats", "--socket", served.address]
    served.proc.send_signal(signal.SIGSTOP)
    try:
        done = subprocess.run(
            [*cmd, "--timeout", "1.5"], capture_output=True, text=True, env=env, timeout=60
        )
    finally:
        served.proc.send_signal(signal.SIGCONT)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert "is busy" in line and "no reply within 1.5 s" in line and "no reprise daemon" not in line
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and "hit rate" in done.stdout  # awake again, it answers


@pytest.mark.parametrize("stop", [[], ["--stop", ":"]])
def test_generate_and_run_share_defaults_and_stop(served: Served, stop: list[str]) -> None:
    """`generate` (daemon) and `run` (in process) sample greedily by default and cut at
    --stop alike: on one backend they give the same tokens."""
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_SOCKET"}
    cli = [sys.executable, "-m", "reprise.cli.main"]
    common = ["--raw", "hello", "--max-tokens", "8", "--json", *stop]
    outs = [
        json.loads(
            subprocess.run(
                [*cli, *args, *common], capture_output=True, text=True, env=env, timeout=120,
                check=True,
            ).stdout
        )
        for args in (
            ["generate", "--socket", served.address],
            ["run", "--model", str(served.model), "--backend", "numpy"],
        )
    ]  # fmt: skip
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert outs[0]["text"] == outs[1]["text"]
    assert outs[0]["finish_reason"] == outs[1]["finish_reason"]
    if stop:
        assert outs[0]["finish_reason"] == "stop" and ":" not in outs[0]["text"]
        assert len(outs[0]["token_ids"]) < 8
    else:
        assert len(outs[0]["token_ids"]) == 8


def _cli_json(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_SOCKET"}
    done = subprocess.run([sys.executable, "-m", "reprise.cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=120, check=True)  # fmt: skip
    return json.loads(done.stdout)


def test_generate_logprobs_n_are_the_drawn_rows(served: Served) -> None:
    """`generate --logprobs 3`: each greedy token comes with its raw-model logprob and
    three alternatives, the most likely first, which is the token drawn."""
    out = _cli_json("generate", "--socket", served.address, "--raw", "hello",
                    "--max-tokens", "6", "--json", "--logprobs", "3")  # fmt: skip
    assert len(out["logprobs"]) == len(out["token_ids"]) == 6
    for token_id, lp in zip(out["token_ids"], out["logprobs"], strict=True):
        assert lp["id"] == token_id and lp["logprob"] <= 0
        top = lp["top"]
        assert len(top) == 3 and [t[2] for t in top] == sorted((t[2] for t in top), reverse=True)
        assert top[0][0] == token_id and top[0][2] == lp["logprob"]  # greedy: the argmax


def test_penalty_flags_reach_the_sampler_alike_in_generate_and_run(served: Served) -> None:
    """--presence/--frequency/--repetition-penalty: `generate` (daemon) and `run` (in
    process) give the same tokens with them, and not the tokens of no penalties."""
    common = ["--raw", "hello", "--max-tokens", "24", "--json"]
    penalties = ["--presence-penalty", "2", "--frequency-penalty", "2",
                 "--repetition-penalty", "1.5"]  # fmt: skip
    daemon = ["generate", "--socket", served.address]
    in_process = ["run", "--model", str(served.model), "--backend", "numpy"]
    penalized = [_cli_json(*where, *common, *penalties)["token_ids"]
                 for where in (daemon, in_process)]  # fmt: skip
    plain = _cli_json(*daemon, *common)["token_ids"]
    assert penalized[0] == penalized[1]
    assert penalized[0] != plain


def test_logit_bias_and_min_tokens_flags_reach_the_sampler_alike(served: Served) -> None:
    """--logit-bias ID=BIAS and --min-tokens: `generate` and `run` give the same tokens; a
    +100 bias makes every token that one; on the end-of-text token it ends the answer at
    once, or, with --min-tokens 4, right after the 4th token (held back until then)."""
    from reprise.daemon.model.tokenizer import Tokenizer

    eos = Tokenizer.from_dir(served.model).eos_token_ids[0]
    common = ["--raw", "hello", "--max-tokens", "6", "--json"]
    daemon = ["generate", "--socket", served.address]
    in_process = ["run", "--model", str(served.model), "--backend", "numpy"]
    plain = _cli_json(*daemon, *common)["token_ids"]
    forced = [_cli_json(*where, *common, "--logit-bias", f"{plain[1]}=100")["token_ids"]
              for where in (daemon, in_process)]  # fmt: skip
    assert forced[0] == forced[1] == [plain[1]] * 6
    ended = _cli_json(*daemon, *common, "--logit-bias", f"{eos}=100")
    assert ended["token_ids"] == [eos] and ended["finish_reason"] == "stop"
    held = [_cli_json(*where, *common, "--logit-bias", f"{eos}=100", "--min-tokens", "4")
            for where in (daemon, in_process)]  # fmt: skip
    assert held[0]["token_ids"] == held[1]["token_ids"]
    assert held[0]["token_ids"][:4] == plain[:4] and held[0]["token_ids"][4] == eos
    assert len(held[0]["token_ids"]) == 5 and held[0]["finish_reason"] == "stop"


def test_bad_word_flags_reach_the_sampler_alike(served: Served) -> None:
    """--bad-word: `generate` and `run` give the same tokens, without the word's token from
    where the plain answer first had it. The word is the text of one of the answer's
    tokens that spells it alone (the tiny model's tokens are bytes and their merges)."""
    from reprise.daemon.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(served.model)
    common = ["--raw", "hello", "--max-tokens", "12", "--json"]
    daemon = ["generate", "--socket", served.address]
    in_process = ["run", "--model", str(served.model), "--backend", "numpy"]
    plain = _cli_json(*daemon, *common)["token_ids"]
    at, word = next(
        (i, w) for i, t in enumerate(plain)
        if (w := tok.decode([t])).strip() == w != "" and tok.encode(w, add_special_tokens=False) == [t]
    )  # fmt: skip
    cut = [_cli_json(*where, *common, "--bad-word", word)["token_ids"]
           for where in (daemon, in_process)]  # fmt: skip
    assert cut[0] == cut[1] and plain[at] not in cut[0]
    assert cut[0][:at] == plain[:at]


def test_structured_output_flags_hold_the_answer_alike(served: Served, tmp_path: Path) -> None:
    """--choice, --regex and --json-schema @FILE: `generate` and `run` give the same
    tokens, and the answer is in the grammar."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer", "maximum": 99, '
                      '"minimum": 0}}, "required": ["n"], "additionalProperties": false, '
                      '"x-guidance": {"whitespace_flexible": false}}')  # fmt: skip
    common = ["--raw", "hello", "--max-tokens", "12", "--json"]
    daemon = ["generate", "--socket", served.address]
    in_process = ["run", "--model", str(served.model), "--backend", "numpy"]
    cases = [
        (["--choice", "up", "--choice", "down"], r"up|down"),
        (["--regex", "[0-9]{3}"], r"[0-9]{3}"),
        (["--json-schema", f"@{schema}"], r'\{"n":[0-9]{1,2}\}'),
    ]
    for flags, pattern in cases:
        got = [_cli_json(*where, *common, *flags) for where in (daemon, in_process)]
        assert got[0]["token_ids"] == got[1]["token_ids"], flags
        assert re.fullmatch(pattern, got[0]["text"]), (flags, got[0]["text"])
        assert got[0]["finish_reason"] == "stop", flags
