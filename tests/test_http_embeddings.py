"""OpenAI's /v1/embeddings on a real `reprise serve --http` (the tiny synthetic model),
driven by the `openai` package: each input's vector is the in-process engine's embedding
(Engine.embed) of the same ids, normalized; base64 and float spell the same float32
values; `dimensions` cuts before normalizing; repeats (from cached blocks) keep the bits;
bad bodies get one 400 line naming the parameter; the socket client gets the raw row."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from http_support import HttpDaemon  # noqa: E402

from reprise.daemon import Engine  # noqa: E402
from reprise.ipc import Client  # noqa: E402
from reprise.ipc.codec import logits_from_wire  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=4)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("embeddings"), tiny, "--served-model-name", "tiny")
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.read_log()[-2000:]


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Engine:
    # the daemon's block size (http_support): bits are the same for one block size (DESIGN §4)
    return Engine.from_pretrained(tiny, backend="numpy", num_device_blocks=96, block_size=16)


def unit(row: np.ndarray) -> np.ndarray:
    wide = row.astype(np.float64)
    return (wide / np.sqrt(np.dot(wide, wide))).astype(np.float32)


IDS = [np.random.default_rng(n).integers(3, 200, 20 + 17 * n).tolist() for n in range(3)]


def test_vectors_are_the_engines_embeddings_normalized(daemon, reference) -> None:
    api = daemon.openai()
    answer = api.embeddings.create(model="tiny", input=IDS, encoding_format="float")
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, IDS))
    for ids, datum, row in zip(IDS, answer.data, reference.embed(IDS), strict=True):
        got = np.asarray(datum.embedding, dtype=np.float32)
        assert np.array_equal(got, unit(row)), len(ids)
        assert abs(np.linalg.norm(got.astype(np.float64)) - 1) < 1e-6
    # the openai package asks for base64 by default and decodes it: the same values
    default = api.embeddings.create(model="tiny", input=IDS)
    for a, b in zip(default.data, answer.data, strict=True):
        assert np.array_equal(
            np.asarray(a.embedding, np.float32), np.asarray(b.embedding, np.float32)
        )
    # a repeat is an exact repeat (the stored embedding, no forward): the same bits
    again = api.embeddings.create(model="tiny", input=IDS[2], encoding_format="float")
    assert again.data[0].embedding == answer.data[2].embedding


def test_text_dimensions_base64_and_raw_rows(daemon, reference) -> None:
    text = "The capital of France is Paris."
    raw = httpx.post(f"{daemon.url}/v1/embeddings", json={
        "input": text, "encoding_format": "base64", "dimensions": 16, "user": "u1"},
        timeout=60).json()  # fmt: skip
    got = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    ids = reference.tokenizer.encode(text)
    row = reference.embed([ids])[0]
    assert (
        raw["object"] == "list"
        and raw["model"] == "tiny"
        and raw["usage"]["prompt_tokens"] == len(ids)
    )
    assert np.array_equal(got, unit(row[:16]))
    plain = httpx.post(f"{daemon.url}/v1/embeddings", json={"input": [ids], "normalize": False},
                       timeout=60).json()  # fmt: skip
    assert np.array_equal(np.asarray(plain["data"][0]["embedding"], np.float32), row)
    with Client(daemon.address) as client:  # the socket: the raw row, on the Done
        done = client.generate(ids, max_tokens=1, temperature=0, embed=True)
        assert client.health().hidden_size == row.shape[0] == 128
    assert np.array_equal(logits_from_wire(done.embedding), row)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1, 2], "x", 3]}, "input"),
        ({"input": ["x"] * 257}, "input"),  # past --max-queue (256)
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 10_000}, "dimensions"),  # past the hidden size
        ({"input": "x", "normalize": "yes"}, "normalize"),
        ({"input": "x", "stream": True}, "stream"),
        ({"input": [10**9]}, "input"),  # an id past the vocabulary: the daemon's own check
    ],
)
def test_bad_bodies_get_one_line(daemon, body: dict, param: str) -> None:
    reply = httpx.post(f"{daemon.url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    assert error["message"]


def test_the_daemon_keeps_serving_after_refusals(daemon) -> None:
    for body in ({"input": "x", "dimensions": 10_000}, {"input": [10**9]}):
        httpx.post(f"{daemon.url}/v1/embeddings", json=body, timeout=60)
    answer = daemon.openai().embeddings.create(model="tiny", input="still here")
    assert len(answer.data[0].embedding) == 128  # the tiny model's hidden size
    assert "Traceback" not in daemon.read_log()
