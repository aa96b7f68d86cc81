"""Python's standard library source as a byte-level training corpus.

Every machine with Python has its standard library, so a model trained on it
needs no download: the text is the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` and the vocabulary is the 256 byte values
plus a few special tokens (nothing to download).

Files are split into train and held-out by a hash of their path relative to the
stdlib root, so the split is the same on every machine with the same Python
version. The stdlib's file set changes between Python versions (files are added
and removed), so a checkpoint stores the held-out list it was evaluated on
(``write_file_list``) and evaluation reads that list back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from typing import Iterable, Sequence

import numpy as np

from snapmla_jax.tokenizer import BYTE_TOKENIZER_CLASS

NUM_BYTES = 256
BOS_ID = 256  # starts every file, and every prompt
EOS_ID = 257  # ends every file, so a generation can stop
PAD_ID = 258  # fills rows of a batch past their end
# 256 bytes + 3 specials, rounded up to a multiple of 8 so the embedding and
# the output projection have friendly shapes; ids 259..263 are never produced.
VOCAB_SIZE = 264

DEFAULT_HELDOUT_FRACTION = 0.05
# A handful of stdlib files are generated tables (unicode data, encodings) of
# several hundred KB; they say little about Python and would dominate batches.
DEFAULT_MAX_FILE_BYTES = 256 * 1024
# Third-party packages installed into the interpreter are not the stdlib and
# differ between machines.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> pathlib.Path:
    """Directory of this interpreter's pure-Python standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> bool:
    """Whether the file at ``relpath`` (posix path relative to the stdlib root) is held out.

    sha256 of the path, not Python's ``hash``: the latter is salted per process.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction: expected a value in [0, 1], got {heldout_fraction!r}")
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < heldout_fraction


def list_source_files(root: str | os.PathLike | None = None,
                      max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[str]:
    """Sorted posix paths (relative to ``root``, default the stdlib) of its ``.py`` files.

    Skips installed third-party packages, bytecode caches, empty files and
    files larger than ``max_file_bytes``. Raises ValueError if ``root`` is not
    a directory or holds no such file.
    """
    root = stdlib_root() if root is None else pathlib.Path(root)
    if not root.is_dir():
        raise ValueError(f"root: expected a directory, got {os.fspath(root)!r}")
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes: expected a positive int, got {max_file_bytes!r}")
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if 0 < path.stat().st_size <= max_file_bytes:
            out.append(rel.as_posix())
    if not out:
        raise ValueError(f"root: no .py files of at most {max_file_bytes} bytes under {os.fspath(root)!r}")
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class CorpusSplit:
    """Train and held-out file lists (posix paths relative to ``root``)."""

    root: str
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]


def split_files(root: str | os.PathLike | None = None, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> CorpusSplit:
    """The deterministic train/held-out split of the ``.py`` files under ``root``."""
    root = stdlib_root() if root is None else pathlib.Path(root)
    files = list_source_files(root, max_file_bytes)
    heldout = tuple(f for f in files if is_heldout(f, heldout_fraction))
    train = tuple(f for f in files if not is_heldout(f, heldout_fraction))
    if not train or not heldout:
        raise ValueError(f"heldout_fraction: {heldout_fraction} leaves {len(train)} train and {len(heldout)} "
                         f"held-out files out of {len(files)}; both must be non-empty")
    return CorpusSplit(root=os.fspath(root), train_files=train, heldout_files=heldout)


def encode(text: str | bytes, *, bos: bool = True) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 token ids [n (+1)], with ``BOS_ID`` first if ``bos``."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    ids = np.frombuffer(data, np.uint8).astype(np.int32)
    return np.concatenate([np.array([BOS_ID], np.int32), ids]) if bos else ids


def decode(ids: Iterable[int]) -> str:
    """Token ids -> text: byte ids are UTF-8 decoded (invalid sequences replaced), specials dropped."""
    return bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES).decode("utf-8", errors="replace")


def token_stream(root: str | os.PathLike, files: Sequence[str]) -> np.ndarray:
    """The files' bytes concatenated, each as ``BOS_ID``, bytes, ``EOS_ID``: int32 [total].

    Raises ValueError naming a file that does not exist under ``root`` (a
    held-out list from another Python version can name such files; use
    ``present_files`` first).
    """
    root = pathlib.Path(root)
    parts = []
    for rel in files:
        path = root / rel
        if not path.is_file():
            raise ValueError(f"files: {rel!r} does not exist under {os.fspath(root)!r}")
        parts.append(encode(path.read_bytes()))
        parts.append(np.array([EOS_ID], np.int32))
    if not parts:
        raise ValueError("files: expected at least one file")
    return np.concatenate(parts)


def present_files(root: str | os.PathLike, files: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``files`` into (present under ``root``, missing)."""
    root = pathlib.Path(root)
    present = [f for f in files if (root / f).is_file()]
    missing = [f for f in files if not (root / f).is_file()]
    return present, missing


def sample_windows(stream: np.ndarray, batch_size: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``batch_size`` random windows of ``length`` consecutive tokens: int32 [batch_size, length]."""
    stream = np.asarray(stream)
    if stream.ndim != 1 or stream.shape[0] < length:
        raise ValueError(f"stream: expected a 1-D token stream of at least length={length}, got shape {stream.shape}")
    starts = rng.integers(0, stream.shape[0] - length + 1, size=batch_size)
    return stream[starts[:, None] + np.arange(length)[None, :]].astype(np.int32)


def write_tokenizer_config(path: str | os.PathLike) -> None:
    """Declare this vocabulary for ``snapmla_jax.tokenizer.load_tokenizer``: a tokenizer_config.json
    naming its byte-level class, with BOS prepended to prompts and EOS ending generation."""
    record = {"tokenizer_class": BYTE_TOKENIZER_CLASS, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    pathlib.Path(path).write_text(json.dumps(record, indent=1) + "\n")


def write_file_list(path: str | os.PathLike, files: Sequence[str], *, heldout_fraction: float) -> None:
    """Store a held-out list as JSON, with the Python version whose stdlib it came from."""
    record = {"python_version": sys.version.split()[0], "heldout_fraction": heldout_fraction,
              "files": list(files)}
    pathlib.Path(path).write_text(json.dumps(record, indent=1) + "\n")


def read_file_list(path: str | os.PathLike) -> tuple[list[str], str]:
    """Inverse of ``write_file_list``: (files, python version they came from)."""
    try:
        record = json.loads(pathlib.Path(path).read_text())
        return list(record["files"]), str(record["python_version"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"path: {os.fspath(path)!r} is not a held-out file list ({err})") from err
