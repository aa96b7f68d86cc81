"""Text <-> token ids for a model directory: ``load_tokenizer(model_dir)``.

Accepted formats, looked up in this order inside ``model_dir``:

1. Byte level. ``tokenizer_config.json`` with ``"tokenizer_class": "ByteTokenizer"``:
   a text is its UTF-8 bytes, token id = byte value (0..255). Optional keys
   ``"bos_token_id"`` (int, prepended to every encoded text) and
   ``"eos_token_id"`` (int). Decoding drops ids >= 256 and replaces invalid
   UTF-8 by U+FFFD. No other file is needed. Example::

       {"tokenizer_class": "ByteTokenizer", "bos_token_id": 256, "eos_token_id": 257}

2. Hugging Face. ``tokenizer.json`` read with the ``tokenizers`` package;
   ``encode`` applies its post-processor (which adds BOS where the file says
   so), ``decode`` skips special tokens. The EOS id comes from
   ``tokenizer_config.json``'s ``"eos_token"`` (a string or ``{"content": ...}``),
   else from ``"eos_token_id"`` in ``generation_config.json`` or ``config.json``
   (the first id when a list is given); None when none names one.

Anything else raises ``TokenizerNotFound`` (a ValueError) naming the directory.
"""

from __future__ import annotations

import json
import pathlib
from typing import Protocol

BYTE_TOKENIZER_CLASS = "ByteTokenizer"
NUM_BYTES = 256  # ids 0..255 are bytes; a byte-level vocabulary puts specials above


class TokenizerNotFound(ValueError):
    """The model directory holds no tokenizer in an accepted format."""


class Tokenizer(Protocol):
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, with optional BOS/EOS ids above 255."""

    def __init__(self, bos_id: int | None = None, eos_id: int | None = None):
        for name, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < NUM_BYTES):
                raise ValueError(f"{name}: expected None or an int >= {NUM_BYTES} (ids below are bytes), "
                                 f"got {value!r}")
        self.bos_id = bos_id
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from ``tokenizer.json``."""

    def __init__(self, path: pathlib.Path, eos_id: int | None):
        from tokenizers import Tokenizer as _Tokenizer  # only this format needs the package

        self._tokenizer = _Tokenizer.from_file(str(path))
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from err
    return data if isinstance(data, dict) else {}


def _first_id(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _hf_eos_id(model_dir: pathlib.Path, tokenizer: HFTokenizer, tokenizer_config: dict) -> int | None:
    token = tokenizer_config.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
        return tokenizer.token_to_id(token)
    for name in ("generation_config.json", "config.json"):
        eos = _first_id(_read_json(model_dir / name).get("eos_token_id"))
        if eos is not None:
            return eos
    return None


def load_tokenizer(model_dir: str | pathlib.Path) -> Tokenizer:
    """The tokenizer a model directory declares (formats: see the module docstring).

    Returns an object with ``encode(str) -> list[int]``, ``decode(list[int]) -> str``
    and ``eos_id`` (int or None). Raises TokenizerNotFound when no accepted
    format is present, ValueError for a malformed file.
    """
    model_dir = pathlib.Path(model_dir)
    config = _read_json(model_dir / "tokenizer_config.json")
    if config.get("tokenizer_class") == BYTE_TOKENIZER_CLASS:
        return ByteTokenizer(bos_id=config.get("bos_token_id"), eos_id=config.get("eos_token_id"))
    path = model_dir / "tokenizer.json"
    if path.is_file():
        try:
            tokenizer = HFTokenizer(path, eos_id=None)
        except Exception as err:  # the Rust side raises its own exception type
            raise ValueError(f"{path}: not a tokenizers file ({err})") from err
        tokenizer.eos_id = _hf_eos_id(model_dir, tokenizer, config)
        return tokenizer
    raise TokenizerNotFound(
        f"{model_dir}: no tokenizer found (expected tokenizer.json, or tokenizer_config.json with "
        f'"tokenizer_class": "{BYTE_TOKENIZER_CLASS}")')
