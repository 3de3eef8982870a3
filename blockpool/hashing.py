"""Block keys: the digest under which a full block of KV is found again.

A key is a hash (SHA-256 by default) over a typed, length-prefixed encoding of

    domain tag and format version, model fingerprint,
    parent block digest (or an explicit "no parent" tag),
    the block's token ids (fixed-width integers),
    the per-token extra ids (or an explicit "none" tag),
    and, for the first block of a sequence only, its namespace
    (cache salt and adapter id).

Guarantees:
- The encoding is injective: every field is a one-byte tag, an 8-byte
  length and its payload, in a fixed order, and every "absent" value has a
  tag of its own. So no choice of salt bytes, adapter id, token ids or extra
  ids can make two different inputs encode the same; in particular salt
  `"a"` with adapter `"bc"` never meets salt `"ab"` with adapter `"c"`, a
  `str` salt never meets the same `bytes`, and `""` never meets `None`.
- Chaining: a block's key covers its parent's digest, so equal keys mean
  (short of a hash collision) equal whole prefixes in one namespace.
- The hash function is injectable (`hasher`) so tests can force collisions;
  the pool never trusts a digest alone (it compares stored tokens, see pool.py).
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)
Hasher = Callable[[bytes], bytes]

DOMAIN_TAG = b"reprise/kv-block"
FORMAT_VERSION = 1
MAX_ID = (1 << 64) - 1

# One-byte field tags. Each "absent" value has its own tag so that absence
# never encodes like some present value.
_TAG_DOMAIN = b"D"
_TAG_MODEL = b"M"
_TAG_PARENT = b"P"
_TAG_NO_PARENT = b"p"
_TAG_TOKENS = b"T"
_TAG_EXTRA = b"E"
_TAG_NO_EXTRA = b"e"
_TAG_SALT_STR = b"S"
_TAG_SALT_BYTES = b"B"
_TAG_NO_SALT = b"s"
_TAG_ADAPTER = b"A"
_TAG_NO_ADAPTER = b"a"


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_SHA256_BYTES = 32


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who may share a sequence's blocks: a cache salt and a LoRA adapter id.

    Blocks of different namespaces never share a key. `Namespace()` (no salt,
    no adapter) is the namespace of requests that give neither.
    """

    cache_salt: str | bytes | None = None
    adapter_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cache_salt, str | bytes | None):
            raise TypeError(
                f"cache_salt must be str, bytes or None; got {type(self.cache_salt).__name__}"
            )
        if not isinstance(self.adapter_id, str | None):
            raise TypeError(f"adapter_id must be str or None; got {type(self.adapter_id).__name__}")


DEFAULT_NAMESPACE = Namespace()


def _field(tag: bytes, payload: bytes = b"") -> bytes:
    return tag + struct.pack(">Q", len(payload)) + payload


def _is_id(value: object) -> bool:
    try:
        return 0 <= operator.index(value) <= MAX_ID  # type: ignore[arg-type]
    except TypeError:
        return False


def encode_ids(ids: Sequence[int] | np.ndarray, name: str = "token ids") -> bytes:
    """Ids as the key encodes each one (8 bytes, big-endian), in one C call (an integer
    array: one NumPy cast); ValueError naming the first id outside [0, 2**64)."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu" and ids.ndim == 1:
        if ids.size and ids.min() < 0:
            raise ValueError(f"{name} must be integers in [0, 2**64); got {int(ids.min())}")
        return ids.astype(">u8").tobytes()
    try:
        return struct.pack(f">{len(ids)}Q", *ids)
    except (struct.error, TypeError):
        bad = next((i for i in ids if not _is_id(i)), None)
        raise ValueError(f"{name} must be integers in [0, 2**64); got {bad!r}") from None


def decode_blocks(id_bytes: bytes, block_size: int) -> list[tuple[int, ...]]:
    """`encode_ids`' bytes of whole blocks back to each block's ids."""
    unpack = struct.Struct(f">{block_size}Q").unpack_from
    return [unpack(id_bytes, start) for start in range(0, len(id_bytes), 8 * block_size)]


def _namespace_fields(namespace: Namespace) -> bytes:
    salt = namespace.cache_salt
    if salt is None:
        out = _field(_TAG_NO_SALT)
    elif isinstance(salt, str):
        out = _field(_TAG_SALT_STR, salt.encode("utf-8", "surrogatepass"))
    else:
        out = _field(_TAG_SALT_BYTES, bytes(salt))
    if namespace.adapter_id is None:
        return out + _field(_TAG_NO_ADAPTER)
    return out + _field(_TAG_ADAPTER, namespace.adapter_id.encode("utf-8", "surrogatepass"))


_DOMAIN_FIELD = _field(_TAG_DOMAIN, DOMAIN_TAG + struct.pack(">H", FORMAT_VERSION))
_NO_PARENT_FIELD = _field(_TAG_NO_PARENT)
_NO_EXTRA_FIELD = _field(_TAG_NO_EXTRA)


def _encode(
    model_field: bytes,
    parent: BlockHash | None,
    tokens_field: bytes,
    extra_field: bytes,
    namespace: Namespace | None,
) -> bytes:
    """A block's key bytes from its fields (the token and extra-id fields encoded by
    the caller, so that a chain encodes its ids once)."""
    if parent is None:
        namespace_fields = _namespace_fields(namespace or DEFAULT_NAMESPACE)
        return b"".join(
            (
                _DOMAIN_FIELD,
                model_field,
                _NO_PARENT_FIELD,
                tokens_field,
                extra_field,
                namespace_fields,
            )
        )
    parent_field = _field(_TAG_PARENT, bytes(parent))
    return b"".join((_DOMAIN_FIELD, model_field, parent_field, tokens_field, extra_field))


def _extra_field(extra_ids: Sequence[int] | None) -> bytes:
    return (
        _NO_EXTRA_FIELD
        if extra_ids is None
        else _field(_TAG_EXTRA, encode_ids(extra_ids, "extra ids"))
    )


def encode_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    *,
    extra_ids: Sequence[int] | None = None,
    namespace: Namespace | None = None,
    model_fingerprint: bytes,
) -> bytes:
    """The exact bytes `hash_block` hashes (exposed so tests can check injectivity).

    `namespace` is encoded for the first block only (`parent is None`); a later
    block inherits it through its parent's digest, so it is ignored there.
    """
    if extra_ids is not None and len(extra_ids) != len(token_ids):
        raise ValueError(
            f"extra_ids must have one id per token: {len(extra_ids)} for {len(token_ids)} tokens"
        )
    model_field = _field(_TAG_MODEL, bytes(model_fingerprint))
    tokens_field = _field(_TAG_TOKENS, encode_ids(token_ids))
    return _encode(model_field, parent, tokens_field, _extra_field(extra_ids), namespace)


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    *,
    extra_ids: Sequence[int] | None = None,
    namespace: Namespace | None = None,
    model_fingerprint: bytes,
    hasher: Hasher = sha256,
) -> BlockHash:
    """The key of one block given its parent's key (None for a sequence's first block)."""
    data = encode_block(
        parent,
        token_ids,
        extra_ids=extra_ids,
        namespace=namespace,
        model_fingerprint=model_fingerprint,
    )
    return BlockHash(hasher(data))


def hash_encoded_blocks(
    parent: BlockHash | None,
    token_bytes: bytes,
    block_size: int,
    *,
    extra_ids_per_block: Sequence[Sequence[int] | None] | None = None,
    namespace: Namespace | None = None,
    model_fingerprint: bytes,
    hasher: Hasher = sha256,
) -> list[BlockHash]:
    """Chained keys of consecutive full blocks whose ids are already encoded
    (`encode_ids`; a whole number of blocks), the first one's parent `parent`: bit for
    bit `hash_block` of each, with the ids converted once rather than per block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1; got {block_size}")
    width = 8 * block_size
    num_blocks, rest = divmod(len(token_bytes), width)
    if rest:
        raise ValueError(
            f"{len(token_bytes)} encoded bytes are no whole number of {block_size}-token blocks"
        )
    if extra_ids_per_block is not None and len(extra_ids_per_block) != num_blocks:
        raise ValueError(f"{len(extra_ids_per_block)} extra-id blocks for {num_blocks} blocks")
    model_field = _field(_TAG_MODEL, bytes(model_fingerprint))
    # A block below the first is _encode's parent case, its constant fields joined once:
    # (domain, model), (parent tag, length, parent), (tokens tag, length), ids, extra ids.
    head = _DOMAIN_FIELD + model_field
    tokens_head = _TAG_TOKENS + struct.pack(">Q", width)
    pack_length = struct.Struct(">Q").pack
    # The default hasher: every block below the first starts with the same bytes up to
    # its parent's digest (32 bytes), so a SHA-256 state fed them once is copied for each
    # block and fed the rest, in C (hashlib), without joining the block's bytes first.
    below_first = None
    if hasher is sha256:
        below_first = hashlib.sha256(head + _TAG_PARENT + pack_length(_SHA256_BYTES)).copy
    hashes: list[BlockHash] = []
    append = hashes.append
    for idx in range(num_blocks):
        extra = None if extra_ids_per_block is None else extra_ids_per_block[idx]
        if extra is None:
            extra_field = _NO_EXTRA_FIELD
        elif len(extra) != block_size:
            raise ValueError(
                f"extra_ids must have one id per token: {len(extra)} for {block_size} tokens"
            )
        else:
            extra_field = _extra_field(extra)
        ids = token_bytes[idx * width : (idx + 1) * width]
        if parent is None:
            data = _encode(model_field, None, tokens_head + ids, extra_field, namespace)
            parent = BlockHash(hasher(data))
        elif below_first is not None and len(parent) == _SHA256_BYTES:
            state = below_first()
            state.update(parent)
            state.update(tokens_head)
            state.update(ids)
            state.update(extra_field)
            parent = state.digest()  # type: ignore[assignment]
        else:
            data = b"".join(
                (head, _TAG_PARENT, pack_length(len(parent)), parent, tokens_head, ids, extra_field)
            )
            parent = BlockHash(hasher(data))
        append(parent)
    return hashes


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra_ids: Sequence[int] | None = None,
    namespace: Namespace | None = None,
    model_fingerprint: bytes,
    hasher: Hasher = sha256,
) -> list[BlockHash]:
    """Chained keys of every FULL block of a sequence; a trailing partial block gets none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1; got {block_size}")
    if extra_ids is not None and len(extra_ids) != len(token_ids):
        raise ValueError(
            f"extra_ids must have one id per token: {len(extra_ids)} for {len(token_ids)} tokens"
        )
    num_full = len(token_ids) // block_size * block_size
    extra = None
    if extra_ids is not None:
        extra = [extra_ids[i : i + block_size] for i in range(0, num_full, block_size)]
    return hash_encoded_blocks(
        None,
        encode_ids(token_ids[:num_full]),
        block_size,
        extra_ids_per_block=extra,
        namespace=namespace,
        model_fingerprint=model_fingerprint,
        hasher=hasher,
    )
