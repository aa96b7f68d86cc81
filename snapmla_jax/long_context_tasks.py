"""Seeded byte-level long-context tasks for the byte model (one token per byte).

Every task is one sequence of exactly ``context`` tokens, int32 [context]: ``BOS_ID``,
then a body of filler text with one or more planted lines (the needles), then a
question whose answer bytes end the sequence. Four kinds (``TASK_KINDS``):

  passkey    ``PASS_KEY = '73914'`` planted once; the question
             ``assert PASS_KEY == '`` is answered by the k digits.
  kv         the body is all ``table["3fa9c1"] = "8e07b2"`` lines (hex keys and
             values, keys distinct); the question names one key and is answered
             by its value.
  multi_hop  a chain ``v_a = v_b``, ``v_b = v_c``, ..., ``v_z = '4417'`` planted at
             scattered places; ``assert v_a == '`` is answered by following every
             link (``hops`` lines) to the digits.
  copy       a run of random lowercase words planted once; the question repeats
             its first ``cue`` bytes and is answered by the ``span`` bytes after them.

``depth`` (0..1) places the needle that holds the answer: its first byte is at body
offset ``round(depth * (body_len - needle_len))``, so 0 is right after ``BOS_ID`` and
1 is right before the question. For ``kv`` the needle is a whole line of the body, so
its depth is exact to one line. Other needles (the other links of a multi-hop chain)
go to seeded random places that overlap nothing.

Filler is a window of a token stream (``byte_corpus.token_stream``, special tokens
dropped) when one is given, else deterministic pseudo-text (``pseudo_text``). The
planted names and values are random, so they occur in the filler only by chance.

A model that has not seen the needle answers at chance: ``Task.chance`` is the
probability of guessing the whole answer from its alphabet (10**-k for k digits).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from snapmla_jax.byte_corpus import BOS_ID, NUM_BYTES

TASK_KINDS = ("passkey", "kv", "multi_hop", "copy")
DIGITS = b"0123456789"
HEX = b"0123456789abcdef"
LETTERS = b"abcdefghijklmnopqrstuvwxyz"
# The pseudo-text's words: Python-looking, since the demo model learned Python source.
_PSEUDO_WORDS = ("def", "return", "self", "if", "else", "for", "in", "import", "None", "True", "value", "name",
                 "data", "result", "item", "key", "list", "dict", "len", "range", "print", "x", "y", "0", "1",
                 "=", "+", "(", ")", ":", ",", "and", "or", "not", "is", "class", "with", "as", "try", "pass")
# How often random placement of the other needles is retried before the context is called too short.
_PLACEMENT_TRIES = 1000


@dataclasses.dataclass(frozen=True)
class Task:
    """One long-context task.

    tokens [context] int32: ``BOS_ID`` then bytes (0..255); the answer ends it.
    answer_start: index of the first answer byte; the answer is ``tokens[answer_start:]``.
    answer [n] int32: the answer bytes.
    needle_start: index of the first byte of the needle holding the answer.
    kind, depth, seed: how it was made; chance: P(guessing the whole answer).
    """

    kind: str
    tokens: np.ndarray
    answer_start: int
    answer: np.ndarray
    needle_start: int
    depth: float
    seed: int
    chance: float

    @property
    def context(self) -> int:
        return int(self.tokens.shape[0])


def pseudo_text(length: int, rng: np.random.Generator) -> np.ndarray:
    """Deterministic Python-looking filler: ``length`` bytes as int32 [length] (words, spaces, newlines)."""
    out = bytearray()
    while len(out) < length:
        words = rng.choice(len(_PSEUDO_WORDS), size=int(rng.integers(3, 10)))
        out += (" " * 4 * int(rng.integers(0, 3)) + " ".join(_PSEUDO_WORDS[i] for i in words) + "\n").encode()
    return np.frombuffer(bytes(out[:length]), np.uint8).astype(np.int32)


def filler_bytes(text: np.ndarray) -> np.ndarray:
    """The bytes of a token stream, uint8 [n]: its ids 0..255 in order (special tokens dropped);
    uint8 input is returned as it is."""
    text = np.asarray(text)
    return text if text.dtype == np.uint8 else text[(text >= 0) & (text < NUM_BYTES)].astype(np.uint8)


def _filler(length: int, rng: np.random.Generator, text: np.ndarray | None) -> np.ndarray:
    """``length`` filler bytes int32 [length]: a random window of ``text`` (bytes only), or pseudo-text."""
    if text is None:
        return pseudo_text(length, rng)
    if text.shape[0] < length:
        raise ValueError(f"text: {text.shape[0]} bytes of filler text cannot fill a body of {length} bytes")
    start = int(rng.integers(0, text.shape[0] - length + 1))
    return text[start:start + length].astype(np.int32)


def _random_bytes(alphabet: bytes, n: int, rng: np.random.Generator) -> bytes:
    return bytes(alphabet[i] for i in rng.integers(0, len(alphabet), size=n))


def _as_ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.int32)


def _depth_offset(depth: float, body_len: int, needle_len: int) -> int:
    return int(round(depth * (body_len - needle_len)))


def _place_others(body_len: int, taken: tuple[int, int], lengths: Sequence[int],
                  rng: np.random.Generator) -> list[int]:
    """Random non-overlapping offsets for needles of ``lengths``, clear of ``taken`` (start, stop)."""
    spans = [taken]
    offsets = []
    for n in lengths:
        for _ in range(_PLACEMENT_TRIES):
            start = int(rng.integers(0, body_len - n + 1))
            if all(start + n <= a or start >= b for a, b in spans):
                break
        else:
            raise ValueError(f"context: too short to place {len(lengths) + 1} needles apart")
        spans.append((start, start + n))
        offsets.append(start)
    return offsets


def _check(kind: str, context: int, depth: float, seed: int) -> None:
    if kind not in TASK_KINDS:
        raise ValueError(f"kind: expected one of {TASK_KINDS}, got {kind!r}")
    if not isinstance(context, (int, np.integer)) or isinstance(context, bool) or context < 1:
        raise ValueError(f"context: expected a positive int, got {context!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a fraction in [0, 1], got {depth!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")


def make_task(kind: str, context: int, depth: float, seed: int, *, text: np.ndarray | None = None,
              key_digits: int = 5, num_hops: int = 3, copy_cue: int = 16, copy_span: int = 24) -> Task:
    """One task of ``kind`` (``TASK_KINDS``) with exactly ``context`` tokens; see the module docstring.

    Args:
      context: total tokens, BOS and answer included.
      depth: where the answer's needle sits, a fraction of the body in [0, 1].
      seed: a non-negative int; the same arguments and seed give the same task.
      text: filler, 1-D integer token ids (a ``byte_corpus.token_stream``; ids >= 256 are
        dropped), or None for ``pseudo_text``. uint8 text is bytes already and is used as it
        is (``filler_bytes``: dropping the ids of a 29M-token stream costs ~0.1 s a call).
      key_digits: digits of the passkey; num_hops: assignments in a multi-hop chain (>= 2);
      copy_cue, copy_span: bytes of the copy task's cue and answer.
    Raises ValueError naming the argument for an unknown kind, a depth outside [0, 1], a
    negative seed, bad task sizes, or a context too short for the task's lines.
    """
    _check(kind, context, depth, seed)
    for name, value, least in (("key_digits", key_digits, 1), ("num_hops", num_hops, 2),
                               ("copy_cue", copy_cue, 4), ("copy_span", copy_span, 1)):
        if not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    if text is not None:
        text = np.asarray(text)
        if text.ndim != 1 or not np.issubdtype(text.dtype, np.integer):
            raise ValueError(f"text: expected 1-D integer token ids, got {text.dtype}{list(text.shape)}")
        text = filler_bytes(text)
    rng = np.random.default_rng([seed, TASK_KINDS.index(kind)])
    build = {"passkey": _passkey, "kv": _kv, "multi_hop": _multi_hop, "copy": _copy}[kind]
    question, answer, needles, alphabet = build(rng, key_digits=key_digits, num_hops=num_hops,
                                                copy_cue=copy_cue, copy_span=copy_span)
    body_len = context - 1 - len(question) - len(answer)
    # kv: the asked line and at least one other; else every needle once.
    least = 2 * len(needles[0]) if kind == "kv" else sum(len(n) for n in needles)
    if body_len < least:
        raise ValueError(f"context: {context} tokens are too short for a {kind} task "
                         f"(at least {context - body_len + least} needed)")
    if kind == "kv":
        body, needle_offset = _kv_body(rng, question[len(_KV_QUESTION):-len(_KV_QUESTION_END)], needles[0],
                                       body_len, depth)
    else:
        body = _filler(body_len, rng, text)
        needle_offset = _depth_offset(depth, body_len, len(needles[0]))
        others = _place_others(body_len, (needle_offset, needle_offset + len(needles[0])),
                               [len(n) for n in needles[1:]], rng)
        for offset, needle in zip([needle_offset, *others], needles):
            body[offset:offset + len(needle)] = _as_ids(needle)
    tokens = np.concatenate([np.array([BOS_ID], np.int32), body, _as_ids(question), _as_ids(answer)])
    answer_start = context - len(answer)
    return Task(kind=kind, tokens=tokens, answer_start=answer_start, answer=tokens[answer_start:].copy(),
                needle_start=1 + needle_offset, depth=float(depth), seed=int(seed),
                chance=float(len(alphabet)) ** -len(answer))


# Each builder returns (question, answer, needles with the answer's needle first, answer alphabet).

def _passkey(rng, *, key_digits, **_):
    key = _random_bytes(DIGITS, key_digits, rng)
    return b"\nassert PASS_KEY == '", key, [b"\nPASS_KEY = '" + key + b"'\n"], DIGITS


def _kv_line(key: bytes, value: bytes) -> bytes:
    return b'table["' + key + b'"] = "' + value + b'"\n'


_KV_QUESTION, _KV_QUESTION_END = b'\nassert table["', b'"] == "'


def _kv(rng, **_):
    key, value = _random_bytes(HEX, 6, rng), _random_bytes(HEX, 6, rng)
    return _KV_QUESTION + key + _KV_QUESTION_END, value, [_kv_line(key, value)], HEX


def _kv_body(rng, asked_key: bytes, needle: bytes, body_len: int, depth: float) -> tuple[np.ndarray, int]:
    """A body of table lines with keys distinct from each other and from ``asked_key`` (spaces pad the
    start), ``needle`` being the line nearest the depth: (int32 [body_len], the needle's offset)."""
    width = len(needle)
    lines = body_len // width
    pad = body_len - lines * width
    index = min(lines - 1, max(0, int(round((_depth_offset(depth, body_len, width) - pad) / width))))
    keys = set()
    parts = [b" " * pad]
    for i in range(lines):
        if i == index:
            parts.append(needle)
            continue
        key = _random_bytes(HEX, 6, rng)
        while key == asked_key or key in keys:
            key = _random_bytes(HEX, 6, rng)
        keys.add(key)
        parts.append(_kv_line(key, _random_bytes(HEX, 6, rng)))
    return _as_ids(b"".join(parts)).copy(), pad + index * width


def _multi_hop(rng, *, num_hops, **_):
    names = []
    while len(names) < num_hops:
        name = b"v_" + _random_bytes(HEX, 6, rng)
        if name not in names:
            names.append(name)
    value = _random_bytes(DIGITS, 4, rng)
    links = [b"\n" + names[i] + b" = " + names[i + 1] + b"\n" for i in range(num_hops - 1)]
    return b"\nassert " + names[0] + b" == '", value, [b"\n" + names[-1] + b" = '" + value + b"'\n", *links], DIGITS


def _copy(rng, *, copy_cue, copy_span, **_):
    words = bytearray()
    while len(words) < copy_cue + copy_span:
        words += _random_bytes(LETTERS, int(rng.integers(3, 8)), rng) + b" "
    run = bytes(words[:copy_cue + copy_span])
    return b"\n# " + run[:copy_cue], run[copy_cue:], [b"\n# " + run + b"\n"], LETTERS + b" "


def make_tasks(kinds: Sequence[str], context: int, depth: float, trials: int, seed: int = 0, *,
               text: np.ndarray | None = None, **sizes) -> list[Task]:
    """``trials`` tasks per kind at one (context, depth); trial t of a kind uses seed ``seed + t``.

    Returns a list ordered by kind, then trial. ``sizes`` go to ``make_task``.
    """
    if not isinstance(trials, (int, np.integer)) or trials < 1:
        raise ValueError(f"trials: expected an int >= 1, got {trials!r}")
    return [make_task(kind, context, depth, seed + t, text=text, **sizes) for kind in kinds for t in range(trials)]


class MixedWindows(NamedTuple):
    """A training batch of ``mixed_windows``.

    tokens         int32 [batch_size, length]
    answer_starts  int32 [batch_size]: a task row's first answer index (``Task.answer_start``);
                   ``length`` for a row of plain text, which holds no answer.
    """
    tokens: np.ndarray
    answer_starts: np.ndarray


def mixed_windows(text: np.ndarray, batch_size: int, length: int, seed: int, *, task_fraction: float = 0.25,
                  kinds: Sequence[str] = TASK_KINDS, filler: np.ndarray | None = None) -> MixedWindows:
    """A training batch for a long-context run (``MixedWindows``).

    Each row is, with probability ``task_fraction``, a task of a random kind at a random
    depth with filler from ``text``, else a random window of ``text`` (a
    ``byte_corpus.token_stream``, special tokens kept). Deterministic per ``seed``.
    ``filler``: ``filler_bytes(text)``, when the caller keeps it across batches.
    Raises ValueError for a fraction outside [0, 1], an unknown kind, or ``text``
    shorter than ``length``.
    """
    if not 0.0 <= task_fraction <= 1.0:
        raise ValueError(f"task_fraction: expected a fraction in [0, 1], got {task_fraction!r}")
    for kind in kinds:
        if kind not in TASK_KINDS:
            raise ValueError(f"kinds: expected names from {TASK_KINDS}, got {kind!r}")
    text = np.asarray(text)
    if text.ndim != 1 or text.shape[0] < length:
        raise ValueError(f"text: expected a 1-D token stream of at least length={length}, got shape {text.shape}")
    rng = np.random.default_rng(seed)
    if filler is None and task_fraction > 0:
        filler = filler_bytes(text)  # once a batch, not once a task
    rows, starts = [], []
    for _ in range(batch_size):
        if rng.random() < task_fraction:
            kind = kinds[int(rng.integers(len(kinds)))]
            task = make_task(kind, length, float(rng.random()), int(rng.integers(2**31)), text=filler)
            rows.append(task.tokens)
            starts.append(task.answer_start)
        else:
            start = int(rng.integers(0, text.shape[0] - length + 1))
            rows.append(text[start:start + length].astype(np.int32))
            starts.append(length)
    return MixedWindows(np.stack(rows), np.asarray(starts, np.int32))
