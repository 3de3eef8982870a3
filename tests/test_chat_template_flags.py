"""vLLM's `serve --chat-template` and `--default-chat-template-kwargs` (a tiny random
model, NumPy backend, over HTTP and the socket): every chat is rendered with the given
template, its variables the server's defaults unless the request's chat_template_kwargs
say otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")
from http_support import HttpDaemon  # noqa: E402

from reprise.daemon.model.synth import synth_model  # noqa: E402
from reprise.daemon.model.tokenizer import Tokenizer  # noqa: E402
from reprise.ipc import Client  # noqa: E402

TEMPLATE = (
    "{% for d in documents or [] %}<doc:{{ d['title'] }}>{% endfor %}"
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
    # a pool of 8 blocks of 16 (128 tokens) under a context of 256, and no low token cap
    d = HttpDaemon(tmp / "d", model, "--chat-template", str(tmp / "t.jinja"),
                   "--default-chat-template-kwargs", '{"think": true}',
                   "--num-device-blocks", "8", "--max-tokens-cap", "4096",
                   "--responses-store-mb", "0")  # fmt: skip
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
        # vLLM's documents: the template's own variable
        ({"documents": [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]},
         "<doc:a><doc:b>[user|hi]<think>>>"),
    ]  # fmt: skip
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


def test_a_chat_without_max_tokens_runs_to_what_fits(daemon: HttpDaemon) -> None:
    """vLLM's chat default: no max_tokens runs the answer to the room left after the
    prompt (here the pool's 128 tokens, under the context's 256 and the cap's 4,096); an
    explicit max_tokens that cannot fit is refused, as before."""
    api = daemon.openai()
    messages = [{"role": "user", "content": "hi"}]
    done = api.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens + done.usage.completion_tokens == 128
    with pytest.raises(openai.BadRequestError, match="KV blocks"):
        api.chat.completions.create(model="tiny", messages=messages, max_tokens=4096,
                                    extra_body={"ignore_eos": True})  # fmt: skip


def test_a_server_keeping_no_responses_says_so(daemon: HttpDaemon) -> None:
    """--responses-store-mb 0: responses come back with store false, GET is a 404 and a
    previous_response_id is refused, naming the setting."""
    api = daemon.openai()
    r = api.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert r.store is False
    assert httpx.get(f"{daemon.url}/v1/responses/{r.id}", timeout=10).status_code == 404
    with pytest.raises(openai.BadRequestError, match="responses-store-mb 0"):
        api.responses.create(model="tiny", input="again", previous_response_id=r.id)


def test_add_special_tokens_as_vllm_takes_it(daemon: HttpDaemon) -> None:
    """vLLM's add_special_tokens: the tokenizer's BOS before a text prompt by default
    (this tiny tokenizer adds one), none with false; none before a rendered chat by
    default, one with true; the same ids in /tokenize and in the completion's usage."""
    tok = Tokenizer.from_dir(daemon.model)  # type: ignore[attr-defined]
    bos = tok.encode("hi")[0]
    assert tok.encode("hi") == [bos, *tok.encode("hi", add_special_tokens=False)]
    api = daemon.openai()
    messages = [{"role": "user", "content": "hi"}]
    for special in (None, False, True):
        extra = {} if special is None else {"add_special_tokens": special}
        text = httpx.post(f"{daemon.url}/tokenize", json={"prompt": "hi", **extra}, timeout=60)
        chat = httpx.post(
            f"{daemon.url}/tokenize", json={"messages": messages, **extra}, timeout=60
        )
        ids, chat_ids = text.json()["tokens"], chat.json()["tokens"]
        assert (ids[0] == bos) == (special is not False)
        assert (chat_ids[0] == bos) == (special is True)
        done = api.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body=extra)
        assert done.usage.prompt_tokens == len(ids)
    # a batch mixing token ids (which take no special tokens) and text
    both = api.completions.create(model="tiny", prompt=[[5, 6, 7], "hi"], max_tokens=1,
                                  extra_body={"add_special_tokens": False})  # fmt: skip
    assert both.usage.prompt_tokens == 3 + 2
