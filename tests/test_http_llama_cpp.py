"""llama.cpp's native llama-server routes on a real `reprise serve --http` (the tiny
synthetic model, one daemon for the module): /completion answers as /v1/completions and
the in-process engine do for the same greedy request, with llama.cpp's fields (stop_type
for eos, limit and word; timings; n_probs as completion_probabilities; tokens_cached on a
repeat), streamed as chunks that join to the whole answer; /tokenize and /detokenize
take llama.cpp's bodies; /apply-template renders as the tokenizer does; /props says what
the daemon runs; /embedding is /v1/embeddings' vector in llama.cpp's shape; bad bodies
get one 400 line naming llama.cpp's parameter and the daemon serves on.

The tiny model's own tokens are mostly ids with no text, so greedy requests bias the
letters of TEXT up (logit_bias in llama.cpp's text form) and penalize repeats, which
gives a varied text to stop at and to stream."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from http_support import HttpDaemon, served

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.synth import CHAT_TEMPLATE, synth_model
from reprise.daemon.model.tokenizer import Tokenizer

IDS = np.random.default_rng(7).integers(3, 200, 40).tolist()  # two full blocks of 16
TEXT = "abcdefghij klmnop"
GREEDY = {"temperature": 0, "frequency_penalty": 1.0, "logit_bias": [[TEXT, 20]]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=4)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[HttpDaemon]:
    with served(tmp_path_factory.mktemp("llama_cpp"), tiny, "--served-model-name", "tiny") as d:
        yield d


def post(daemon: HttpDaemon, path: str, body: Any) -> Any:
    reply = httpx.post(f"{daemon.url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def text_ids(daemon: HttpDaemon, text: str, bos: bool = False) -> list[int]:
    return post(daemon, "/tokenize", {"content": text, "add_special": bos})["tokens"]


def stream(daemon: HttpDaemon, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{daemon.url}/completion", json={**body, "stream": True},
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line.removeprefix("data: ")) for line in lines]  # no [DONE] here


def test_completion_is_v1_completions_and_the_engines(daemon: HttpDaemon, tiny: Path) -> None:
    bias = {str(t): 20 for t in text_ids(daemon, TEXT)}
    t_start = time.monotonic()
    whole = post(daemon, "/completion", {"prompt": IDS, "n_predict": 12, "n_probs": 3,
                                         "return_tokens": True, **GREEDY})  # fmt: skip
    elapsed_ms = (time.monotonic() - t_start) * 1e3
    openai = post(daemon, "/v1/completions", {
        "prompt": IDS, "max_tokens": 12, "temperature": 0, "frequency_penalty": 1.0,
        "logit_bias": bias, "logprobs": 3, "return_token_ids": True})["choices"][0]  # fmt: skip
    assert len(whole["content"]) > 4 and whole["content"] == openai["text"]
    assert whole["tokens"] == openai["token_ids"] and len(whole["tokens"]) == 12
    engine = Engine.from_pretrained(tiny, backend="numpy", num_device_blocks=96, block_size=16)
    params = SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.0,
                            logit_bias={int(t): 20 for t in bias})  # fmt: skip
    assert engine.generate(IDS, params).token_ids == whole["tokens"]
    assert (whole["stop"], whole["stop_type"], whole["stopping_word"]) == (True, "limit", "")
    assert (whole["tokens_predicted"], whole["tokens_evaluated"]) == (12, 40)
    assert whole["model"] == "tiny" and whole["id_slot"] == -1 and whole["truncated"] is False
    assert whole["prompt"] == post(daemon, "/detokenize", {"tokens": IDS})["content"]
    settings = whole["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["top_k"]) == (12, 0, 40)
    assert (settings["repeat_penalty"], settings["frequency_penalty"]) == (1.0, 1.0)
    assert settings["n_ctx"] == 256 and settings["n_probs"] == 3
    assert sorted(settings["logit_bias"]) == sorted([int(t), 20] for t in bias)
    # n_probs: the raw model's logprobs, as /v1/completions gives them
    probs, logprobs = whole["completion_probabilities"], openai["logprobs"]
    assert [p["id"] for p in probs] == whole["tokens"]
    assert [p["logprob"] for p in probs] == logprobs["token_logprobs"]
    assert [p["token"] for p in probs] == logprobs["tokens"]
    for entry, top in zip(probs, logprobs["top_logprobs"], strict=True):
        assert len(entry["top_logprobs"]) == 3
        alternatives = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
        alternatives.setdefault(entry["token"], entry["logprob"])  # /v1's lists the token too
        assert alternatives == top
        assert all(t["bytes"] == list(t["token"].encode()) for t in entry["top_logprobs"])
    timings = whole["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == 40 and timings["predicted_n"] == 12
    assert timings["predicted_ms"] > 0 and timings["prompt_ms"] > 0
    assert timings["predicted_per_second"] == pytest.approx(12e3 / timings["predicted_ms"])
    assert timings["prompt_ms"] + timings["predicted_ms"] < elapsed_ms  # the daemon's part
    # a repeat finds the prompt's two full blocks
    again = post(daemon, "/completion", {"prompt": IDS, "n_predict": 12, **GREEDY})
    assert again["tokens_cached"] >= 32 and again["timings"]["cache_n"] == again["tokens_cached"]
    assert again["content"] == whole["content"] and again["tokens"] == []  # not asked for


def test_stop_types_and_the_stream(daemon: HttpDaemon, tiny: Path) -> None:
    body = {"prompt": IDS, "n_predict": 12, **GREEDY}
    full = post(daemon, "/completion", body)["content"]
    stop = full[4:6]
    cut = post(daemon, "/completion", {**body, "stop": [stop, "never-seen"]})
    assert (cut["stop_type"], cut["stopping_word"]) == ("word", stop)
    assert cut["content"] == full[: full.index(stop)]
    eos = Tokenizer.from_dir(tiny).eos_token_ids[0]
    ended = post(daemon, "/completion", {"prompt": IDS, "temperature": 0,
                                         "logit_bias": {str(eos): 100}})  # fmt: skip
    assert (ended["stop_type"], ended["stopping_word"], ended["tokens_predicted"]) == ("eos", "", 1)
    to_end = post(daemon, "/completion", {"prompt": IDS, **GREEDY})  # n_predict -1
    assert to_end["stop_type"] == "limit" and to_end["tokens_predicted"] == 64  # --max-tokens-cap
    assert to_end["generation_settings"]["n_predict"] == -1
    events = stream(daemon, {**body, "n_probs": 2})
    *chunks, last = events
    assert chunks and all(e["stop"] is False for e in chunks) and last["stop"] is True
    assert "".join(e["content"] for e in chunks) == full and last["content"] == ""
    whole = post(daemon, "/completion", {**body, "n_probs": 2, "return_tokens": True})
    assert [t for e in chunks for t in e["tokens"]] == whole["tokens"]
    assert [p for e in chunks for p in e["completion_probabilities"]] == (
        whole["completion_probabilities"]
    )
    assert (last["stop_type"], last["tokens_predicted"], last["tokens"]) == ("limit", 12, [])
    assert last["timings"]["predicted_n"] == 12 and "completion_probabilities" not in last
    cut_events = stream(daemon, {**body, "stop": [stop]})
    assert "".join(e["content"] for e in cut_events) == cut["content"]
    assert cut_events[-1]["stop_type"] == "word"


def test_mixed_and_several_prompts(daemon: HttpDaemon) -> None:
    """A list mixing text and ids is one prompt (its first text with the BOS); a list of
    prompts answers with a list, in order."""
    ids = [*text_ids(daemon, "The fox", bos=True), 10, 20, *text_ids(daemon, "jumps"), 30]
    mixed = post(daemon, "/completion", {"prompt": ["The fox", 10, 20, "jumps", 30],
                                         "n_predict": 6, **GREEDY})  # fmt: skip
    plain = post(daemon, "/completion", {"prompt": ids, "n_predict": 6, **GREEDY})
    assert mixed["tokens_evaluated"] == len(ids) and mixed["content"] == plain["content"]
    several = post(daemon, "/completion", {"prompt": [IDS, "The fox"], "n_predict": 6, **GREEDY})
    assert [r["index"] for r in several] == [0, 1]
    assert several[0]["content"] == post(daemon, "/completion", {
        "prompt": IDS, "n_predict": 6, **GREEDY})["content"]  # fmt: skip
    assert several[1]["tokens_evaluated"] == len(text_ids(daemon, "The fox", bos=True))


def test_grammar_and_json_schema(daemon: HttpDaemon) -> None:
    answer = post(daemon, "/completion", {"prompt": IDS, "temperature": 0,
                                          "grammar": 'root ::= "yes" | "no"'})  # fmt: skip
    assert answer["content"] in ("yes", "no") and answer["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    shaped = post(daemon, "/completion", {"prompt": IDS, "temperature": 0, "n_predict": 32,
                                          "json_schema": schema})  # fmt: skip
    if shaped["stop_type"] == "eos":  # else cut short by n_predict: a prefix of such JSON
        assert isinstance(json.loads(shaped["content"])["a"], int)
    assert shaped["content"].startswith("{")


def test_tokenize_and_detokenize_take_llama_cpps_bodies(daemon: HttpDaemon, tiny: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny)
    text = "Hello, world"
    assert text_ids(daemon, text) == tokenizer.encode(text, add_special_tokens=False)
    with_bos = text_ids(daemon, text, bos=True)
    assert with_bos == tokenizer.encode(text) and with_bos[0] == tokenizer.bos_token_id
    pieces = post(daemon, "/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == text_ids(daemon, text)
    assert "".join(p["piece"] for p in pieces) == text
    vllm = post(daemon, "/tokenize", {"prompt": text})  # vLLM's body, vLLM's answer
    assert vllm["tokens"] == with_bos and vllm["count"] == len(with_bos)
    assert post(daemon, "/detokenize", {"tokens": with_bos[1:]}) == {"prompt": text,
                                                                     "content": text}  # fmt: skip


def test_apply_template_renders_as_the_tokenizer(daemon: HttpDaemon, tiny: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = post(daemon, "/apply-template", {"messages": messages})["prompt"]
    assert rendered == tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("assistant\n")
    chat_ids = post(daemon, "/tokenize", {"messages": messages})["tokens"]
    assert text_ids(daemon, rendered) == chat_ids  # what a /completion of it is given
    bare = post(daemon, "/apply-template", {"messages": messages, "add_generation_prompt": False})
    assert bare["prompt"] == tokenizer.apply_chat_template(messages, add_generation_prompt=False)


def test_props(daemon: HttpDaemon, tiny: Path) -> None:
    props = httpx.get(f"{daemon.url}/props", timeout=30).json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 256 and settings["params"]["n_predict"] == -1
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    engine = Engine.from_pretrained(tiny, backend="numpy", num_device_blocks=96, block_size=16)
    assert props["total_slots"] == engine.settings.max_num_seqs >= 1
    assert props["model_path"] == str(tiny) and props["model_alias"] == "tiny"
    assert props["chat_template"] == CHAT_TEMPLATE
    assert isinstance(props["build_info"], str) and props["build_info"].startswith("reprise ")


def test_embedding_is_v1_embeddings_in_llama_cpps_shape(daemon: HttpDaemon) -> None:
    inputs = [IDS[:20], "The fox jumps"]
    unit = post(daemon, "/v1/embeddings", {"input": inputs})["data"]
    raw = post(daemon, "/v1/embeddings", {"input": inputs, "normalize": False})["data"]
    one = post(daemon, "/embedding", {"content": inputs[1]})
    assert [e["index"] for e in one] == [0] and len(one[0]["embedding"]) == 1
    assert one[0]["embedding"][0] == unit[1]["embedding"]  # L2-normalized, llama.cpp's default
    both = post(daemon, "/embeddings", {"content": inputs, "embd_normalize": -1})
    assert [e["embedding"][0] for e in both] == [d["embedding"] for d in raw]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completion", {"prompt": "hi", "samplers": ["top_k"]}, "samplers"),
        ("/completion", {"prompt": "hi", "mirostat": 2}, "mirostat"),
        ("/completion", {"prompt": "hi", "n_probs": 50}, "n_probs"),
        ("/completion", {"prompt": "hi", "n_predict": 1000}, "n_predict"),  # past the cap
        ("/completion", {"prompt": "hi", "n_predict": 0}, "n_predict"),
        ("/completion", {"prompt": "hi", "repeat_penalty": 0}, "repeat_penalty"),
        (
            "/completion",
            {"prompt": "hi", "repeat_penalty": 1.1, "repeat_last_n": 64},
            "repeat_last_n",
        ),
        ("/completion", {"prompt": "hi", "logit_bias": "x"}, "logit_bias"),
        ("/completion", {"prompt": "hi", "logit_bias": [[1, "x"]]}, "logit_bias"),
        ("/completion", {"prompt": "hi", "logit_bias": [[1, 500]]}, "logit_bias"),
        ("/completion", {"prompt": "hi", "json_schema": {"type": "nope"}}, "json_schema"),
        ("/completion", {"prompt": "hi", "grammar": "root ::= ("}, "grammar"),
        ("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["a"]}}, "prompt"),
        ("/completion", {"prompt": [1.5]}, "prompt"),
        ("/completion", {"prompt": [10**9]}, "prompt"),  # the daemon's own check
        ("/completion", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/completion", {"prompt": "hi", "return_tokens": 1}, "return_tokens"),
        ("/completion", {"prompt": "hi", "model": "gpt-nothing"}, "model"),
        ("/embedding", {"content": "hi", "embd_normalize": 1}, "embd_normalize"),
        ("/embedding", {"content": "hi", "embd_normalize": []}, "embd_normalize"),  # unhashable
        ("/tokenize", {"content": "hi", "parse_special": False}, "parse_special"),
        ("/apply-template", {}, "messages"),
    ],
)
def test_bad_bodies_get_one_line(daemon: HttpDaemon, path: str, body: dict, param: str) -> None:
    reply = httpx.post(f"{daemon.url}{path}", json=body, timeout=60)
    assert reply.status_code == (404 if param == "model" else 400), reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and "\n" not in error["message"]


def test_the_daemon_serves_on(daemon: HttpDaemon) -> None:
    answer = post(daemon, "/completions", {"prompt": IDS, "n_predict": 2, **GREEDY})  # the alias
    assert answer["tokens_predicted"] == 2
    assert "Traceback" not in daemon.read_log()
