"""Fill in the middle (fim.py): OpenAI's `suffix` on /v1/completions and llama.cpp's
/infill lay the request out with the model's own tokens, found in its vocabulary; a real
`reprise serve --http` answers them as the same prompt written out by hand."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from http_support import HttpDaemon
from tokenizers import Tokenizer

from reprise.daemon.model.fim import KNOWN, FimTokens, find_fim, infill_prompt
from reprise.daemon.serve.llama_cpp_api import infill_body
from reprise.daemon.serve.openai_api import parse_request
from reprise.daemon.serve.openai_errors import ApiError

QWEN = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>")
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def test_each_known_set_is_found_whole_and_only_whole() -> None:
    for fim in KNOWN:
        needed = {fim.prefix, fim.suffix} | ({fim.middle} if fim.middle else set())
        vocabulary = {"a", "b", *needed}
        found = find_fim(vocabulary)
        assert found is not None and found.prefix == fim.prefix and found.file_sep is None
        if fim.file_sep:
            assert find_fim(vocabulary | {fim.file_sep}) == fim
        for token in needed:  # a set with a token missing is no set
            assert find_fim(vocabulary - {token}) is None
    assert find_fim({"<|fim_prefix|>", "<fim_suffix>", "<fim_middle>"}) is None  # mixed


def test_the_layouts() -> None:
    qwen, codestral = FimTokens(*QWEN), FimTokens("[PREFIX]", "[SUFFIX]", None)
    assert infill_prompt(qwen, "def f(", "):\n", start="x") == (
        "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>x"
    )
    assert infill_prompt(qwen, "p", "s", files=[("a.py", "A"), ("b.py", "B")]) == (
        "<|file_sep|>a.py\nA<|file_sep|>b.py\nB<|fim_prefix|>p<|fim_suffix|>s<|fim_middle|>"
    )
    assert infill_prompt(codestral, "p", "s") == "[SUFFIX]s[PREFIX]p"
    with pytest.raises(ValueError, match="no file separator"):
        infill_prompt(codestral, "p", "s", files=[("a", "b")])


def test_suffix_is_checked_and_needs_the_models_tokens() -> None:
    parsed = parse_request("completions", {"prompt": ["p1", "p2"], "suffix": "s"})
    parsed.fill_in(FimTokens(*QWEN))
    assert parsed.prompts == [infill_prompt(FimTokens(*QWEN), p, "s") for p in ("p1", "p2")]
    for body, param in [({"prompt": [1, 2], "suffix": "s"}, "suffix"),
                        ({"prompt": "p", "suffix": 3}, "suffix"),
                        ({"prompt": "p", "suffix": "s", "echo": True}, "echo")]:  # fmt: skip
        with pytest.raises(ApiError) as refused:
            parse_request("completions", body)
        assert refused.value.param == param
    with pytest.raises(ApiError, match="no fill-in-the-middle tokens"):
        parse_request("completions", {"prompt": "p", "suffix": "s"}).fill_in(None)
    with pytest.raises(ApiError, match="no fill-in-the-middle tokens"):
        infill_body({"input_prefix": "p"}, None)
    with pytest.raises(ApiError) as refused:
        infill_body({"input_extra": [{"filename": 1}]}, FimTokens(*QWEN))
    assert refused.value.param == "input_extra"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    """The tiny synthetic model, its tokenizer given Qwen2.5-Coder's FIM tokens."""
    from reprise.daemon.model.synth import synth_model

    tiny = synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=4)
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tokenizer.add_special_tokens(list(QWEN))
    tokenizer.save(str(tiny / "tokenizer.json"))
    d = HttpDaemon(tmp_path_factory.mktemp("fim"), tiny, "--served-model-name", "tiny")
    yield d
    d.stop()


def post(daemon: HttpDaemon, path: str, body: dict) -> dict:
    answer = httpx.post(f"{daemon.url}{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_suffix_answers_as_the_prompt_laid_out_by_hand(daemon: HttpDaemon) -> None:
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    asked = post(daemon, "/v1/completions", {"prompt": prefix, "suffix": suffix, **GREEDY})
    by_hand = "<|fim_prefix|>" + prefix + "<|fim_suffix|>" + suffix + "<|fim_middle|>"
    want = post(daemon, "/v1/completions", {"prompt": by_hand, **GREEDY})
    assert asked["choices"][0]["text"] == want["choices"][0]["text"]
    assert asked["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    ids = post(daemon, "/tokenize", {"prompt": by_hand})["tokens"]
    assert 259 in ids and len(ids) == want["usage"]["prompt_tokens"]  # the special token


def test_infill_answers_as_the_completion_of_its_layout(daemon: HttpDaemon) -> None:
    body = {"input_prefix": "x = ", "input_suffix": "\ny = x\n", "prompt": "1",
            "input_extra": [{"filename": "a.py", "text": "import b\n"}]}  # fmt: skip
    llama = {"n_predict": 5, "temperature": 0, "ignore_eos": True}
    asked = post(daemon, "/infill", {**body, **llama})
    by_hand = "<|file_sep|>a.py\nimport b\n<|fim_prefix|>x = <|fim_suffix|>\ny = x\n<|fim_middle|>1"
    want = post(daemon, "/completion", {"prompt": by_hand, **llama})
    assert asked["content"] == want["content"] and asked["tokens_predicted"] == 5
    assert asked["tokens_evaluated"] == want["tokens_evaluated"]
    bad = httpx.post(f"{daemon.url}/infill", json={"input_prefix": 3}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_prefix"
    stream = httpx.post(f"{daemon.url}/infill", json={**body, **llama, "stream": True}, timeout=60)
    events = [
        json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")
    ]
    assert "".join(e["content"] for e in events) == want["content"] and events[-1]["stop"]


def test_model_info_names_the_fim_tokens(tmp_path: Path) -> None:
    from reprise.daemon.model.modelinfo import model_info
    from reprise.daemon.model.synth import synth_model

    tiny = synth_model("tiny", tmp_path / "tiny", seed=1)
    assert model_info(tiny)["fill_in_the_middle"] is None
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tokenizer.add_special_tokens(list(QWEN[:3]))
    tokenizer.save(str(tiny / "tokenizer.json"))
    assert model_info(tiny)["fill_in_the_middle"] == " ".join(QWEN[:3])
