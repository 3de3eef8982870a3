"""A SentencePiece `tokenizer.model` read without protobuf, for a model folder that ships it
instead of a tokenizer.json (older Llama 2 and Mistral fine-tunes).

The file is a protobuf `ModelProto`. `read_spm_model` reads the fields a BPE vocabulary
needs from its wire format: each piece (field 1: its text, score and type), the
trainer's model type and the normalizer's settings. `spm_tokenizer` then builds the
same tokenizer a GGUF's SentencePiece vocabulary gives (gguf_tokenizer.py), so both
tokenize as SentencePiece does. What that tokenizer cannot follow is refused in one line:
a unigram (or word, char) model, a normalizer other than the identity, and the removal
of extra whitespace (Llama 2's and Mistral's models use none of these).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from .gguf_tokenizer import build_tokenizer

_BPE = 2  # TrainerSpec.ModelType
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


@dataclass(slots=True)
class SpmModel:
    pieces: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    types: list[int] = field(default_factory=list)  # 1 normal ... 6 byte, llama.cpp's too
    model_type: int = 1  # TrainerSpec's default: unigram
    normalizer: str = ""  # NormalizerSpec.name
    charsmap: bytes = b""  # its precompiled character map (empty: identity)
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """A message's (field number, value) pairs: varints as ints, length-delimited as
    bytes, fixed32 as its 4 bytes (ValueError on a malformed message)."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise ValueError("tokenizer.model: a truncated or malformed varint")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 2:
            length = varint()
            if pos + length > len(data):
                raise ValueError("tokenizer.model: a field runs past the end of the file")
            out.append((number, data[pos : pos + length]))
            pos += length
        elif wire == 5:
            out.append((number, data[pos : pos + 4]))
            pos += 4
        elif wire == 1:
            out.append((number, data[pos : pos + 8]))
            pos += 8
        else:
            raise ValueError(f"tokenizer.model: unsupported protobuf wire type {wire}")
    return out


def read_spm_model(path: Path) -> SpmModel:
    """The pieces and settings of a SentencePiece model file."""
    model = SpmModel()
    for number, value in _fields(Path(path).read_bytes()):
        if number == 1 and isinstance(value, bytes):  # ModelProto.pieces
            text, score, kind = "", 0.0, 1  # the proto's defaults
            for n, v in _fields(value):
                if n == 1 and isinstance(v, bytes):
                    text = v.decode("utf-8")
                elif n == 2 and isinstance(v, bytes):
                    score = float(struct.unpack("<f", v)[0])
                elif n == 3 and isinstance(v, int):
                    kind = v
            model.pieces.append(text)
            model.scores.append(score)
            model.types.append(kind)
        elif number == 2 and isinstance(value, bytes):  # trainer_spec
            for n, v in _fields(value):
                if n == 3 and isinstance(v, int):
                    model.model_type = v
        elif number == 3 and isinstance(value, bytes):  # normalizer_spec
            for n, v in _fields(value):
                if n == 1 and isinstance(v, bytes):
                    model.normalizer = v.decode("utf-8")
                elif n == 2 and isinstance(v, bytes):
                    model.charsmap = v
                elif n == 3 and isinstance(v, int):
                    model.add_dummy_prefix = bool(v)
                elif n == 4 and isinstance(v, int):
                    model.remove_extra_whitespaces = bool(v)
    if not model.pieces:
        raise ValueError(f"{path}: no pieces; not a SentencePiece model")
    return model


def spm_tokenizer(path: Path, bos: str | None, eos: str | None, add_bos: bool) -> Tokenizer:
    """The tokenizer of a SentencePiece BPE model file; `bos` / `eos` the folder's special
    tokens by text (tokenizer_config.json's), BOS added first when `add_bos`."""
    model = read_spm_model(path)
    if model.model_type != _BPE:
        kind = _MODEL_TYPES.get(model.model_type, str(model.model_type))
        raise ValueError(f"{path}: a SentencePiece {kind} model; only BPE models load here")
    if model.charsmap or model.normalizer not in ("", "identity"):
        raise ValueError(
            f"{path}: normalizer {model.normalizer!r} is not supported; only the identity"
        )
    if model.remove_extra_whitespaces:
        raise ValueError(f"{path}: removes extra whitespace, which is not supported here")
    index = {piece: i for i, piece in reversed(list(enumerate(model.pieces)))}
    unknown = [i for i, t in enumerate(model.types) if t == 2]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": model.pieces,
        "tokenizer.ggml.scores": model.scores,
        "tokenizer.ggml.token_type": model.types,
        "tokenizer.ggml.add_space_prefix": model.add_dummy_prefix,
        "tokenizer.ggml.unknown_token_id": unknown[0] if unknown else None,
        "tokenizer.ggml.bos_token_id": index.get(bos) if bos else None,
        "tokenizer.ggml.eos_token_id": index.get(eos) if eos else None,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.ggml.add_eos_token": False,
    }
    return build_tokenizer(meta)
