"""vLLM's `serve --chat-template` and `--default-chat-template-kwargs` (a tiny random
model, NumPy backend, over HTTP and the socket): every chat is rendered with the given
template, its variables the server's defaults unless the request's chat_template_kwargs
say otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from http_support import HttpDaemon

from reprise.daemon.model.synth import synth_model
from reprise.daemon.model.tokenizer import Tokenizer
from reprise.ipc import Client

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}"
    "{% if think %}<think>{% else %}<plain>{% endif %}"
    "{% if add_generation_prompt %}>>{% endif %}"
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    tmp = tmp_path_factory.mktemp("template")
    model = synth_model("tiny", tmp / "tiny", seed=1)
    (tmp / "t.jinja").write_text(TEMPLATE)
    (tmp / "d").mkdir()
    d = HttpDaemon(tmp / "d", model, "--chat-template", str(tmp / "t.jinja"),
                   "--default-chat-template-kwargs", '{"think": true}')  # fmt: skip
    d.model = model  # type: ignore[attr-defined]
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.read_log()[-2000:]


def test_every_chat_is_rendered_with_the_servers_template(daemon: HttpDaemon) -> None:
    tok = Tokenizer.from_dir(daemon.model)  # type: ignore[attr-defined]
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ({}, "[user|hi]<think>>>"),  # the server's default variables
        ({"chat_template_kwargs": {"think": False}}, "[user|hi]<plain>>>"),  # the request's win
        ({"add_generation_prompt": False}, "[user|hi]<think>"),
    ]
    for extra, text in cases:
        r = httpx.post(f"{daemon.url}/tokenize", json={"messages": messages, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False), text
    with Client(daemon.address) as client:  # the socket's chats alike
        assert client.tokenize(messages) == tok.encode(
            "[user|hi]<think>>>", add_special_tokens=False
        )
        done = client.generate(messages, max_tokens=2, temperature=0)
    assert done.prompt_tokens == len(tok.encode("[user|hi]<think>>>", add_special_tokens=False))
