"""vLLM's `prompt_embeds` on /v1/completions (issue 24): a real `reprise serve --http`
on the tiny synthetic model, driven by the `openai` package's `extra_body`. The
embeddings become a prompt table whose rows are the whole prompt (or the table of a
mixed prompt of token ids), with extra ids derived by the daemon, so the answer is
the socket client's for the same table and a repeat finds its blocks."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from http_support import HttpDaemon, served  # noqa: E402

from reprise.cuda.dtypes import BF16  # noqa: E402
from reprise.daemon.model.config import ModelConfig  # noqa: E402
from reprise.ipc import Client  # noqa: E402

ROWS = 40  # two full blocks of 16 and a tail
LOGPROBS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=3)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[HttpDaemon]:
    with served(tmp_path_factory.mktemp("embeds"), tiny) as d:
        yield d


@pytest.fixture(scope="module")
def hidden(tiny: Path) -> int:
    return ModelConfig.from_dir(tiny).hidden_size


def embeds(hidden: int, seed: int, rows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, hidden)).astype(BF16)


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def raw_form(table: np.ndarray) -> dict:
    data = base64.b64encode(table.view("<u2").tobytes()).decode()
    return {"data": data, "shape": list(table.shape)}


def complete(daemon: HttpDaemon, prompt_embeds: object, prompt: object = "", **kw: object):
    return daemon.openai().completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=LOGPROBS,
        extra_body={"prompt_embeds": prompt_embeds, **kw},
    )  # fmt: skip


def socket_answer(daemon: HttpDaemon, token_ids: list[int], table: np.ndarray, **kw: object):
    with Client(daemon.address) as client:
        return client.generate(token_ids, prompt_table=table, max_tokens=4, temperature=0,
                               logprobs=LOGPROBS, **kw)  # fmt: skip


def vocab(daemon: HttpDaemon) -> int:
    with Client(daemon.address) as client:
        return client.health().vocab_size


def same(http_choice, done) -> None:
    """The HTTP answer is the socket's, token for token and logprob for logprob."""
    lp = http_choice.logprobs
    assert lp.tokens == [x["token"] for x in done.logprobs]
    assert lp.token_logprobs == [x["logprob"] for x in done.logprobs]
    assert http_choice.text == done.text


def test_prompt_embeds_answer_as_the_same_table_over_the_socket(daemon, hidden) -> None:
    table = embeds(hidden, 1)
    v = vocab(daemon)
    first = complete(daemon, npy_b64(table))
    done = socket_answer(daemon, list(range(v, v + ROWS)), table, cache_salt="socket")
    same(first.choices[0], done)
    assert first.usage.prompt_tokens == ROWS and len(first.choices[0].logprobs.tokens) == 4
    again = complete(daemon, npy_b64(table))  # the .npy form, repeated
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    same(again.choices[0], done)
    raw = complete(daemon, raw_form(table))  # the raw form: the same table, the same blocks
    assert raw.usage.prompt_tokens_details.cached_tokens == 32
    same(raw.choices[0], done)
    f32 = complete(daemon, npy_b64(table.astype(np.float32)))  # exact in bfloat16: the same
    same(f32.choices[0], done)


def test_other_embeddings_share_no_block(daemon, hidden) -> None:
    complete(daemon, npy_b64(embeds(hidden, 2)))
    other = embeds(hidden, 2)
    other[0, 0] = -other[0, 0] if other[0, 0] else BF16.type(1.0)
    assert complete(daemon, npy_b64(other)).usage.prompt_tokens_details.cached_tokens == 0


def test_token_ids_with_prompt_embeds_as_their_table(daemon, hidden) -> None:
    table = embeds(hidden, 3, rows=4)
    v = vocab(daemon)
    prompt = [5, 6, 7, v + 2, v, v + 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    answer = complete(daemon, raw_form(table), prompt=prompt)
    same(answer.choices[0], socket_answer(daemon, prompt, table, cache_salt="mixed"))
    again = complete(daemon, raw_form(table), prompt=prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == 16


@pytest.mark.parametrize(
    "value, message",
    [
        ("not base64!", "is not valid base64"),
        (base64.b64encode(b"PK\x03\x04torch").decode(), "torch.save"),
        (base64.b64encode(b"\x00\x01\x02\x03").decode(), "is not an .npy file"),
        ("int32", "<i4"),
        ({"data": "AAAA", "shape": [2, 8]}, "data holds 3 bytes"),
        ({"data": "AAAA", "shape": [1]}, "shape must be [rows, hidden]"),
        ({"data": "AAAA", "shape": [1, 1], "dtype": "float16"}, "dtype must be bfloat16"),
        ([1.0, 2.0], "must be a base64 string of an .npy file"),
        ("wrong width", "prompt_embeds (as the prompt table)"),
    ],
)
def test_malformed_prompt_embeds_get_a_400_naming_the_field(daemon, hidden, value, message):
    if value == "int32":
        value = npy_b64(np.zeros((2, hidden), np.int32))
    elif value == "wrong width":
        value = npy_b64(embeds(hidden + 1, 4, rows=2))
    r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt_embeds": value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_embeds" and message in error["message"], error


def test_prompt_embeds_elsewhere_are_refused(daemon, hidden) -> None:
    table = npy_b64(embeds(hidden, 5, rows=2))
    r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": "hi", "prompt_embeds": table})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt_embeds": table}
    r = httpx.post(f"{daemon.url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds"
    with pytest.raises(openai.BadRequestError):
        complete(daemon, "!!")
