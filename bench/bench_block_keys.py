"""A prompt's block keys: the engine's chain (ids encoded once, sliced per block) against
`hash_block` per block (each block's ids packed on their own, as before 2026-11-27), in
one run, rounds interleaved so that a change of the machine's speed hits both alike.

    python bench/bench_block_keys.py [--prompt-tokens 4096] [--block-size 32] [--rounds 8]

Both produce the same keys (checked here); what differs is the host time a request's
admission spends on them (issue 18's cached-prompt host time).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

from reprise.blockpool.hashing import BlockHash, encode_ids, hash_block
from reprise.blockpool.pool import BlockPool
from reprise.daemon.engine.kvmanager import KVCacheManager
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.engine.sequence import RequestId, Sequence

FINGERPRINT = b"bench-block-keys".ljust(32, b"\0")


def per_block(seq: Sequence, block_size: int, num_blocks: int) -> list[BlockHash]:
    chain: list[BlockHash] = []
    for idx in range(num_blocks):
        start, end = idx * block_size, (idx + 1) * block_size
        chain.append(hash_block(chain[-1] if chain else None, seq.token_ids(start, end),
                                extra_ids=seq.extra_ids(start, end), namespace=seq.namespace,
                                model_fingerprint=FINGERPRINT))  # fmt: skip
    return chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    bs, n = args.block_size, args.prompt_tokens
    prompt = np.random.default_rng(0).integers(0, 128_256, n).tolist()
    kv = KVCacheManager(BlockPool(n // bs + 1, bs), FINGERPRINT)

    ids = np.asarray(prompt, dtype=np.int64)  # the engine has it from checking the prompt

    def fresh() -> Sequence:  # as the engine builds it: the ids' encoding comes along
        return Sequence(RequestId(1), prompt, SamplingParams(), seed=0,
                        prompt_id_bytes=encode_ids(ids))  # fmt: skip

    seq = fresh()
    assert kv.hash_chain(seq, n // bs) == per_block(fresh(), bs, n // bs)
    assert seq.prompt_id_bytes == encode_ids(prompt)
    cases = {"per block": lambda: per_block(seq, bs, n // bs),
             "engine": lambda: kv.hash_chain(fresh(), n // bs)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            times[name].append(min(timeit.repeat(run, number=10, repeat=5)) / 10 * 1e3)
    old, new = (statistics.median(times[name]) for name in cases)
    print(
        f"{n}-token prompt, {n // bs} blocks of {bs}: hash_block per block {old:.3f} ms, "
        f"the engine's chain {new:.3f} ms (including the ids' encoding): {old / new:.2f}x"
    )


if __name__ == "__main__":
    main()
