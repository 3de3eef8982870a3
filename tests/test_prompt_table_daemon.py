"""Prompt tables through a real `reprise serve` (tiny synthetic model, blocks of 4) and
`reprise generate --prompt-table`: TensorRT-LLM's three requests give the logits of a
fresh in-process engine, derived extra ids share, and bad input gets one error
naming the field, through the daemon and as a CLI usage error."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from test_daemon import REPRISE, Daemon, Raw, recv
from test_prompt_table import BS, GREEDY, make, requests, table

from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.synth import synth_model
from reprise.ipc import Done, RequestError
from reprise.ipc.codec import logits_from_wire, prompt_table_to_wire
from reprise.ipc.messages import PROTOCOL_VERSION, ErrorReply

MAX_MESSAGE_BYTES = 8192


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("ptune-daemon") / "tiny")


@pytest.fixture(scope="module")
def config(tiny: Path) -> ModelConfig:
    return ModelConfig.from_dir(tiny)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("d"), tiny, "--block-size", str(BS),
               "--max-message-bytes", str(MAX_MESSAGE_BYTES))  # fmt: skip
    yield d
    d.stop()
    assert d.proc.returncode == 0


def ask(daemon: Daemon, request: dict, **options) -> Done:
    with daemon.client() as client:
        return client.generate(
            request["prompt"],
            prompt_table=request.get("prompt_table"),
            extra_ids=request.get("extra_ids"),
            max_tokens=GREEDY.max_tokens,
            temperature=0,
            ignore_eos=True,
            return_logits=True,
            **options,
        )


def test_trtllm_example_through_the_daemon(daemon: Daemon, tiny: Path, config) -> None:
    outs = [ask(daemon, r) for r in requests(config)]
    assert [o.cached_tokens for o in outs] == [0, 0, BS]
    logits = [logits_from_wire(o.logits) for o in outs]
    assert not np.array_equal(logits[0], logits[1])
    for request, got in zip(requests(config), logits, strict=True):
        request = dict(request)
        fresh = make(tiny).generate(request.pop("prompt"), GREEDY, **request)
        assert np.array_equal(got, fresh.logits)
    # derived extra ids: an equal table shares the first block, without extra ids given
    v = config.vocab_size
    derived = {"prompt": [v, v + 1, v + 2, v + 3, 9, 9], "prompt_table": table(config, 7)}
    # the repeat: every token, as an exact repeat (the first call's 3 generated tokens
    # filled the second block)
    assert [ask(daemon, derived).cached_tokens for _ in range(2)] == [0, 6]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"prompt_table": None}, "got 1024: ids from 1024 up select prompt_table rows, but"),
        ({"extra_ids": [1, 1, 1, 1, 0]}, "extra_ids must have one id per prompt token"),
        ({"extra_ids": [1, 1, 1, 0, 0, 0]}, r"extra_ids\[3\] is 0"),
        ({"extra_ids": [1, 1, 1, 1, 0, 7]}, r"extra_ids\[5\] is 7"),
        ({"prompt": [1024, 1025, 1026, 1030, 9, 9]}, "selects row 6, but the table has 4 rows"),
        ({"prompt_table": "wide"}, r"prompt_table must have shape \[num_virtual >= 1, hidden 128"),
    ],
)
def test_bad_input_gets_an_error_naming_the_field(daemon: Daemon, config, change, match) -> None:
    request = {"prompt": [1024, 1025, 1026, 1027, 9, 9], "prompt_table": table(config, 1),
               "extra_ids": [1, 1, 1, 1, 0, 0], **change}  # fmt: skip
    if isinstance(request["prompt_table"], str):
        request["prompt_table"] = np.zeros(
            (4, config.hidden_size + 2), dtype=table(config, 1).dtype
        )
    with pytest.raises(RequestError, match=match) as info:
        ask(daemon, request)
    assert info.value.code == "bad_request"


def test_malformed_wire_tables_are_refused(daemon: Daemon, config) -> None:
    wire = prompt_table_to_wire(table(config, 1))
    cases = [
        ({**wire, "dtype": "float32"}, "prompt_table.dtype must be bfloat16"),
        ({**wire, "data": wire["data"][:-2]}, "prompt_table.data must hold 2 bytes per element"),
        ({**wire, "shape": [4]}, r"prompt_table.shape must be \[num_virtual, hidden\]"),
        ({"shape": wire["shape"], "data": wire["data"]}, "prompt_table must have exactly"),
    ]
    conn = Raw(daemon.address)
    try:
        for i, (bad, match) in enumerate(cases):
            body = {"v": PROTOCOL_VERSION, "type": "generate", "id": f"bad{i}",
                    "token_ids": [1024, 5], "prompt_table": bad}  # fmt: skip
            conn.send(msgpack.packb(body, use_bin_type=True))
            reply = recv(conn)
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
            assert reply.id == f"bad{i}"
            assert re.search(match, reply.message), reply.message
        # a table past the message size limit is refused like any large input
        big = prompt_table_to_wire(np.zeros((64, config.hidden_size), dtype=table(config, 1).dtype))
        body = {"v": PROTOCOL_VERSION, "type": "generate", "id": "big", "token_ids": [1024],
                "prompt_table": big}  # fmt: skip
        conn.send(msgpack.packb(body, use_bin_type=True))
        reply = recv(conn)
        assert isinstance(reply, ErrorReply) and reply.code == "too_large", reply
    finally:
        conn.close()


def test_cli_generate_with_a_prompt_table(daemon: Daemon, config, tmp_path: Path) -> None:
    path = tmp_path / "table.npy"
    np.save(path, table(config, 11))
    base = [REPRISE, "generate", "--token-ids", "1024,1025,1026,1027,3", "--prompt-table",
            str(path), "--max-tokens", "2", "--temperature", "0", "--json",
            "--socket", daemon.address]  # fmt: skip
    runs = [subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
            for extra in ([], [], ["--extra-ids", "5,5,5,5,0"])]  # fmt: skip
    for done in runs:
        assert done.returncode == 0, done.stderr
    cached = [json.loads(done.stdout)["cached_tokens"] for done in runs]
    assert cached == [0, BS, 0]  # given extra ids 5 are not the derived ones
    bad = subprocess.run([*base, "--extra-ids", "5,5,5,5,1"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert bad.returncode == 2, bad.stderr
    assert "extra_ids[4] is 1" in bad.stderr and "Traceback" not in bad.stderr
    no_table = [arg for arg in base if arg not in ("--prompt-table", str(path))]
    bad = subprocess.run(no_table, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert "no prompt_table" in bad.stderr and "Traceback" not in bad.stderr
