"""The demo's prompt shows reuse robustly (issue 21): on the default model it is a whole
number of blocks plus a few tokens, so the second call reuses nearly all of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reprise.daemon.model.tokenizer import Tokenizer

pytestmark = pytest.mark.model
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BLOCK_SIZE = 32  # serve's default


def test_the_demo_prompt_is_whole_blocks_and_a_few_tokens(default_model_dir: Path) -> None:
    demo = (SCRIPTS / "demo.sh").read_text()
    question = re.search(r"question=\$\{1:-(.+)\}", demo).group(1)
    system = (SCRIPTS / "demo_system.txt").read_text().strip()
    tok = Tokenizer.from_dir(default_model_dir)
    text = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )
    num_tokens = len(tok.encode(text, add_special_tokens=False))
    whole, rest = divmod(num_tokens, BLOCK_SIZE)
    assert whole >= 4 and 1 <= rest <= 4, (num_tokens, whole, rest)
    assert f"{num_tokens} tokens with the default question" in demo
