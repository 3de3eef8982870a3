"""OpenAI's /v1/embeddings on a real `reprise serve --http` (the tiny synthetic model),
driven by the `openai` package: each input's vector is the in-process engine's embedding
(Engine.embed) of the same ids, normalized; base64 and float spell the same float32
values; `dimensions` cuts before normalizing; repeats (from cached blocks) keep the bits;
bad bodies get one 400 line naming the parameter; the socket client gets the raw row.
vLLM's /score and /rerank: cosines of those vectors, in the pairs and order they say."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from http_support import HttpDaemon, served  # noqa: E402

from reprise.daemon import Engine  # noqa: E402
from reprise.ipc import Client  # noqa: E402
from reprise.ipc.codec import logits_from_wire  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=4)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[HttpDaemon]:
    with served(tmp_path_factory.mktemp("embeddings"), tiny, "--served-model-name", "tiny") as d:
        yield d


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


def _unit(vector: list[float]) -> np.ndarray:
    return np.asarray(vector, dtype=np.float64)


def test_score_is_the_cosine_of_the_embeddings(daemon) -> None:
    """vLLM's /score for an embedding model: one text against each of a list, or two lists
    pairwise; each score the dot product of the two /v1/embeddings vectors."""
    texts = ["The capital of France", "Paris is in France", "Bananas are yellow"]
    api = daemon.openai()
    vectors = [_unit(d.embedding) for d in api.embeddings.create(model="tiny", input=texts).data]
    one = httpx.post(f"{daemon.url}/score", json={"model": "tiny", "text_1": texts[0],
                     "text_2": texts[1:]}, timeout=60).json()  # fmt: skip
    assert one["object"] == "list" and [d["index"] for d in one["data"]] == [0, 1]
    for datum, other in zip(one["data"], vectors[1:], strict=True):
        assert datum["score"] == float(np.dot(vectors[0], other))
    pairwise = httpx.post(f"{daemon.url}/v1/score", json={"text_1": texts[:2],
                          "text_2": texts[1:]}, timeout=60).json()  # fmt: skip
    assert [d["score"] for d in pairwise["data"]] == [
        float(np.dot(vectors[0], vectors[1])), float(np.dot(vectors[1], vectors[2]))]  # fmt: skip
    assert abs(httpx.post(f"{daemon.url}/score", json={"text_1": "same", "text_2": "same"},
                          timeout=60).json()["data"][0]["score"] - 1) < 1e-6  # fmt: skip


def test_rerank_orders_the_documents_by_score(daemon) -> None:
    documents = ["Bananas are yellow", "Paris is in France", "The sky is blue", "Lyon, France"]
    query = "Where is Paris?"
    api = daemon.openai()
    vectors = [_unit(d.embedding)
               for d in api.embeddings.create(model="tiny", input=[query, *documents]).data]  # fmt: skip
    scores = [float(np.dot(vectors[0], v)) for v in vectors[1:]]
    want = sorted(range(4), key=lambda i: (-scores[i], i))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = httpx.post(f"{daemon.url}{path}", json={"query": query, "documents": documents,
                            "top_n": 3}, timeout=60).json()  # fmt: skip
        assert [r["index"] for r in answer["results"]] == want[:3]
        assert [r["relevance_score"] for r in answer["results"]] == [scores[i] for i in want[:3]]
        assert [r["document"]["text"] for r in answer["results"]] == [
            documents[i] for i in want[:3]
        ]
    bare = httpx.post(f"{daemon.url}/rerank", json={"query": query, "documents": documents,
                      "return_documents": False}, timeout=60).json()  # fmt: skip
    assert len(bare["results"]) == 4 and "document" not in bare["results"][0]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": "a"}, "text_2"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/score", {"text_1": "", "text_2": "b"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": "b", "bogus": 1}, "bogus"),
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/rerank", {"query": "q", "documents": [f"d{i}" for i in range(300)]}, None),
    ],
)
def test_bad_score_and_rerank_bodies_get_one_line(daemon, path: str, body: dict, param) -> None:
    reply = httpx.post(f"{daemon.url}{path}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and "\n" not in error["message"]
