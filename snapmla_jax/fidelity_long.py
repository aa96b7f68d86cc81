"""Long-context retrieval through the latent cache, per cache quantization scheme.

    python -m snapmla_jax.fidelity_long [--model DIR] [--contexts 4096 16384 ...] [--depths 0 0.5 1]
        [--trials N] [--tasks passkey kv ...] [--schemes bf16 fp8 ...] [--prefill] [--json F] [--markdown F]
        [--plot F.png]
    python -m snapmla_jax.fidelity_long --from-json F [F ...] [--trials N] [--json F] [--markdown F] [--plot F.png]

Each task (``snapmla_jax.long_context_tasks``: a needle planted at a depth of a byte
context, a question at its end) runs through ``model.decode`` in chunks of ``--chunk``
tokens, so every attention read goes through the cache and ``mla_decode``, as in a long
generation; with ``--prefill`` the context is prefilled as ``generate`` serves a prompt (full
attention that only writes the cache) and only the answer's positions read the cache. Numbers
per (task kind, context, depth, scheme):

* accuracy: the share of tasks whose answer greedy decoding reproduces exactly. It is
  read off the same teacher-forced pass: greedy decoding feeds the model exactly the
  teacher-forced tokens up to its first wrong byte, so it reproduces the answer iff
  every answer byte is the argmax of its position's teacher-forced logits.
* bits per byte of the answer span: mean -log2 p(answer byte | everything before it).
* bits per byte of the context: mean -log2 p over every byte before the answer (the filler
  text, the planted lines and the question), each predicted from the cache of all before it
  (not with ``--prefill``: the prefill reads no cache).

Cache schemes (``CACHE_SCHEMES``):

  bf16                         the BF16 cache
  fp8                          SnapMLA's cache: per-token FP8 latent, BF16 RoPE key
  emulated_per_token_576       RoPE in FP8: one scale per token over [latent, RoPE] (576
                               dims), without RoPE separation
  emulated_per_token_block128  a scale per token and 128-channel latent block, BF16 RoPE
  emulated_rope_aware_token    SnapMLA's cache rounding alone (per-token latent, BF16 RoPE)
                               through the BF16 kernel: fp8 against it is what the query and
                               P' roundings and the FP8 products cost
  emulated_rope_aware_token_query
                               that cache rounding and the FP8 kernels' query rounding (the
                               latent query in FP8 under one scale per row), through the BF16
                               kernel: against emulated_rope_aware_token, the query's cost
  fp8_xla                      the FP8 cache read by the XLA path whatever ``--backend`` says:
                               the kernels' query and P' roundings with float32 products and
                               sums, so fp8 against it is what the FP8 tensor cores'
                               accumulation costs, and it against
                               emulated_rope_aware_token_query what P's rounding costs

Listed as a ladder (bf16 emulated_rope_aware_token emulated_rope_aware_token_query fp8_xla
fp8), each scheme's difference from the one before it (``vs_previous``) is one rounding's cost.

The emulated schemes have no cache format of their own: each layer's new latent and
RoPE key are quantized to FP8 and back (``quant_report``'s schemes, in jnp) before
being written to a BF16 cache, which rounds the dequantized values once more to bf16
(relative 2**-9, against FP8's 2**-4); the emulated query rounding likewise reaches the
BF16 kernel as bf16. The per-tensor scheme of ``quant_report`` is
not emulated: its one scale covers the whole cache, which a cache written token by
token does not know when it writes.

``--model`` defaults to the shipped long-context model (``snapmla_jax/assets/long_model``): the
demo config trained by docs/train_demo.md's long-context recipe, 2k then 16k-token windows of
which three quarters are these tasks; the shipped demo model never learned to retrieve.

The output states the model's trained context (``max_position_embeddings``, the
window length ``train_demo`` trained on): beyond it the model extrapolates RoPE
positions it never saw, and near-chance accuracy is what to expect.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
import sys
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax import byte_corpus, cli, long_context_tasks
from snapmla_jax.backend import BACKENDS
from snapmla_jax.cache import LatentCache
from snapmla_jax.fidelity import LN2, heldout_files_flag, model_flag, print_and_write, pyplot, save_png
from snapmla_jax.models import MLAModel
from snapmla_jax.paging import allocate_pages
from snapmla_jax.quant_report import CHANNEL_BLOCK
from snapmla_jax.quantization import fp8_round_trip, per_token_scale
from snapmla_jax.write import write_kv

PROG = "snapmla_jax.fidelity_long"
PAGE_SIZE = 64
# The shipped model trained to retrieve at 16k tokens (the module docstring).
LONG_MODEL_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "long_model"
DEFAULT_CONTEXTS = (4096, 16384, 32768, 65536)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _fake_quant(x: jax.Array) -> jax.Array:
    """Per-row (last axis) FP8 quantize and dequantize: float [..., D] -> float32 [..., D]
    (``fp8_round_trip``, whose rounding survives XLA's GPU compiler)."""
    return fp8_round_trip(x, per_token_scale(x))


def per_token_576_round_trip(c_kv: jax.Array, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[latent, RoPE] of each token in FP8 under one scale: c_kv [..., R], k_pe [..., Dr] -> float32, same shapes."""
    both = _fake_quant(jnp.concatenate([c_kv, k_pe], axis=-1))
    return both[..., :c_kv.shape[-1]], both[..., c_kv.shape[-1]:]


def rope_aware_token_round_trip(c_kv: jax.Array, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """SnapMLA's cache rounding: the latent in FP8 under one scale per token, RoPE untouched."""
    return _fake_quant(c_kv), k_pe


def per_token_block128_round_trip(c_kv: jax.Array, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Latent in FP8 with a scale per token and 128-channel block, RoPE untouched: float32 c_kv, k_pe as given."""
    blocks = c_kv.reshape(*c_kv.shape[:-1], -1, CHANNEL_BLOCK)
    return _fake_quant(blocks).reshape(c_kv.shape), k_pe


@dataclasses.dataclass(frozen=True)
class CacheScheme:
    """How a scheme runs: the cache dtype (``LatentCache``), the transform of (c_kv, k_pe) before writing
    and of the latent query before it attends (``MLAModel.decode``), the write_kv / mla_decode
    backend when the scheme fixes one (else the caller's), the FP8 query's terms and the features a
    float32 sum of the FP8 Q.K products covers (``mla_decode``'s ``query_terms`` and
    ``qk_promotion``)."""

    cache_dtype: str
    kv_transform: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None
    backend: str | None = None
    q_transform: Callable[[jax.Array], jax.Array] | None = None
    query_terms: int = 1
    qk_promotion: int | None = None


CACHE_SCHEMES = {
    "bf16": CacheScheme("bf16"),
    "fp8": CacheScheme("fp8"),
    "emulated_per_token_576": CacheScheme("bf16", per_token_576_round_trip),
    "emulated_per_token_block128": CacheScheme("bf16", per_token_block128_round_trip),
    "emulated_rope_aware_token": CacheScheme("bf16", rope_aware_token_round_trip),
    "emulated_rope_aware_token_query": CacheScheme("bf16", rope_aware_token_round_trip, q_transform=_fake_quant),
    "fp8_xla": CacheScheme("fp8", backend="xla"),
    "fp8_two_term_query": CacheScheme("fp8", query_terms=2),
    "fp8_qk_sums_128": CacheScheme("fp8", qk_promotion=128),
}


@dataclasses.dataclass(frozen=True)
class RetrievalScore:
    """Scores of a list of tasks under one scheme.

    correct [N] bool: greedy decoding reproduces task i's answer exactly.
    byte_correct [N] float: share of task i's answer bytes that are their position's argmax.
    answer_bits [N] float: mean -log2 p of task i's answer bytes.
    context_bits [N] float or None: mean -log2 p of the bytes before task i's answer.
    """

    correct: np.ndarray
    byte_correct: np.ndarray
    answer_bits: np.ndarray
    context_bits: np.ndarray | None = None

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    @property
    def bits_per_byte(self) -> float:
        return float(self.answer_bits.mean())


@nnx.jit(static_argnames=("backend", "kv_transform", "q_transform", "query_terms", "qk_promotion"))
def _decode_chunk(model, input_ids, targets, caches, block_table, seq_lens, backend, kv_transform, q_transform,
                  query_terms=1, qk_promotion=None):
    logits, caches = model.decode(input_ids, caches, block_table, seq_lens, backend=backend,
                                  kv_transform=kv_transform, q_transform=q_transform, query_terms=query_terms,
                                  qk_promotion=qk_promotion)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return logprobs, jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0], caches


@nnx.jit(static_argnames=("backend",))
def _prefill_prompts(model, input_ids, lengths, caches, block_table, backend):
    logits, caches = model.prefill(input_ids, lengths, caches, block_table, backend=backend, last_only=True)
    return jax.nn.log_softmax(logits, axis=-1), caches


@functools.partial(jax.jit, static_argnames=("spec", "backend"))
def _converted(caches: tuple, spec: CacheScheme, backend: str) -> tuple:
    """BF16 caches (one ``LatentCache`` a layer) as ``spec``'s: every slot's latent and RoPE key
    (through ``spec.kv_transform`` if it has one) written into a fresh cache of its dtype. A bf16
    model's latents reach the cache in bf16, so this writes what a prefill into that cache would."""
    converted = []
    for cache in caches:
        num_pages, page_size, rank = cache.latent.shape
        latent, rope = cache.latent.reshape(-1, rank), cache.rope.reshape(num_pages * page_size, -1)
        if spec.kv_transform is not None:
            latent, rope = spec.kv_transform(latent, rope)
        fresh = LatentCache.create(num_pages, page_size, rank, rope.shape[-1], dtype=spec.cache_dtype)
        converted.append(write_kv(fresh, latent, rope, jnp.arange(num_pages * page_size, dtype=jnp.int32),
                                  backend=backend))
    return tuple(converted)


class TeacherForced(NamedTuple):
    """answer_logprobs: per row float32 [T - answer_starts[b], V], the log-probabilities predicting
    each answer byte; context_bits float64 [B]: mean -log2 p of tokens 1 .. answer_starts[b] - 1
    (None where the context was prefilled: its bytes then never read the cache)."""
    answer_logprobs: list[np.ndarray]
    context_bits: np.ndarray | None


def teacher_forced(model, tokens: np.ndarray, answer_starts: Sequence[int], scheme: str, *, backend: str,
                   chunk: int = 512, prefill: bool = False) -> TeacherForced:
    """Teacher-forced scores of every row through the cache of ``scheme`` (``TeacherForced``).

    tokens [B, T] int (rows of one length); answer_starts [B]: row b's answer is
    tokens[b, answer_starts[b]:]. Feeds tokens[:, :T-1] to ``model.decode`` ``chunk`` tokens per
    call (the last call takes the rest) into a fresh cache: every position's attention reads the
    cache, as in a long generation. With ``prefill``, as ``generate`` serves a prompt instead:
    row b's tokens before its answer go through ``model.prefill`` (full-precision causal
    attention that writes the cache, so the context's states never read it), its last position
    predicts the first answer byte, and the answer's other bytes are fed through ``model.decode``
    (``prefilled``).
    Raises ValueError for an unknown scheme, a chunk < 1 or an answer start outside [1, T).
    """
    if prefill:
        return prefilled(model, tokens, answer_starts, [scheme], backend=backend, chunk=chunk)[scheme]
    tokens, starts = _checked(tokens, answer_starts, [scheme], chunk)
    batch, length = tokens.shape
    spec = CACHE_SCHEMES[scheme]
    fed = length - 1  # the last token predicts nothing that is scored
    pages = allocate_pages([fed] * batch, 0, page_size=PAGE_SIZE)
    block_table = jnp.asarray(pages.block_table)
    caches = model.init_cache(pages.num_pages, PAGE_SIZE, kv_cache=spec.cache_dtype)
    first = int(starts.min()) - 1  # the first position whose output is kept
    kept, target_logprobs = [], []
    for start in range(0, fed, chunk):
        stop = min(start + chunk, fed)
        seq_lens = jnp.full((batch,), stop, jnp.int32)
        logprobs, target_lp, caches = _decode_chunk(model, jnp.asarray(tokens[:, start:stop]),
                                                    jnp.asarray(tokens[:, start + 1:stop + 1]), caches, block_table,
                                                    seq_lens, spec.backend or backend, spec.kv_transform,
                                                    spec.q_transform, spec.query_terms, spec.qk_promotion)
        target_logprobs.append(np.asarray(target_lp, np.float64))
        if stop > first:
            kept.append(np.asarray(logprobs[:, max(first - start, 0):], np.float32))
    kept = np.concatenate(kept, axis=1)  # positions first .. fed - 1
    target_logprobs = np.concatenate(target_logprobs, axis=1)  # position p predicts token p + 1
    context_bits = np.array([-target_logprobs[b, :starts[b] - 1].mean() / LN2 if starts[b] > 1 else 0.0
                             for b in range(batch)])
    return TeacherForced([kept[b, starts[b] - 1 - first:] for b in range(batch)], context_bits)


def _checked(tokens, answer_starts, schemes: Sequence[str], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [B, T], answer_starts int64 [B]) once ``teacher_forced``'s arguments are checked."""
    for scheme in schemes:
        if scheme not in CACHE_SCHEMES:
            raise ValueError(f"scheme: expected one of {tuple(CACHE_SCHEMES)}, got {scheme!r}")
    if chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1, got {chunk}")
    tokens = np.asarray(tokens, np.int32)
    batch, length = tokens.shape
    starts = np.asarray(answer_starts, np.int64)
    if starts.shape != (batch,) or (starts < 1).any() or (starts >= length).any():
        raise ValueError(f"answer_starts: expected {batch} indices in [1, {length}), got {starts.tolist()}")
    return tokens, starts


def prefilled(model, tokens: np.ndarray, answer_starts: Sequence[int], schemes: Sequence[str], *, backend: str,
              chunk: int = 512) -> dict[str, TeacherForced]:
    """``teacher_forced(prefill=True)`` of every scheme in ``schemes`` from one prefill.

    The prompts tokens[b, :answer_starts[b]] (right-padded to the longest; the rest of a
    shorter row's width is padding the prefill does not write) go through ``model.prefill``
    once, into BF16 caches; its last positions predict the first answer bytes, the same for
    every scheme. Each scheme then gets those caches converted (``_converted``) and feeds every
    row's answer bytes but the last through decode calls of ``chunk`` tokens (rows whose answer
    is shorter than the longest feed padding after it, which no scored position sees).
    Arguments and errors as ``teacher_forced``'s.
    """
    tokens, starts = _checked(tokens, answer_starts, schemes, chunk)
    batch, length = tokens.shape
    fed = int(length - 1 - starts.min())  # decoded positions of the row with the longest answer
    pages = allocate_pages([int(s) + fed for s in starts], 0, page_size=PAGE_SIZE)
    block_table = jnp.asarray(pages.block_table)
    caches = model.init_cache(pages.num_pages, PAGE_SIZE, kv_cache="bf16")
    first, bf16_caches = _prefill_prompts(model, jnp.asarray(tokens[:, :int(starts.max())]),
                                          jnp.asarray(starts, jnp.int32), caches, block_table, backend)
    first = np.asarray(first, np.float32)
    padded = np.pad(tokens, ((0, 0), (0, fed)))
    answer_ids = np.stack([padded[b, starts[b]:starts[b] + fed] for b in range(batch)])  # [B, fed]
    scored = {}
    for scheme in schemes:
        spec = CACHE_SCHEMES[scheme]
        scheme_backend = spec.backend or backend
        caches = _converted(bf16_caches, spec, scheme_backend)
        decoded = [np.zeros((batch, 0, first.shape[-1]), np.float32)]
        for start in range(0, fed, chunk):
            stop = min(start + chunk, fed)
            ids = jnp.asarray(answer_ids[:, start:stop])
            logprobs, _, caches = _decode_chunk(model, ids, ids, caches, block_table,
                                                jnp.asarray(starts + stop, jnp.int32), scheme_backend,
                                                spec.kv_transform, spec.q_transform, spec.query_terms,
                                                spec.qk_promotion)
            decoded.append(np.asarray(logprobs, np.float32))
        decoded = np.concatenate(decoded, axis=1)
        scored[scheme] = TeacherForced([np.concatenate([first[b, None], decoded[b, :length - 1 - starts[b]]])
                                        for b in range(batch)], None)
    return scored


def score_answers(logprobs: Sequence[np.ndarray], answers: Sequence[np.ndarray],
                  context_bits: np.ndarray | None = None) -> RetrievalScore:
    """Exact match, per-byte argmax match and bits per byte from per-row answer log-probabilities
    [n_b, V] and answer bytes [n_b] int; ``context_bits`` [N] is passed through."""
    correct, byte_correct, bits = [], [], []
    for lp, answer in zip(logprobs, answers, strict=True):
        hits = lp.argmax(-1) == answer
        correct.append(bool(hits.all()))
        byte_correct.append(float(hits.mean()))
        bits.append(float(-lp[np.arange(len(answer)), answer].astype(np.float64).mean() / LN2))
    return RetrievalScore(np.array(correct), np.array(byte_correct), np.array(bits), context_bits)


def retrieval_accuracy(model, tasks: Sequence[long_context_tasks.Task], scheme: str, *, backend: str,
                       chunk: int = 512, batch_size: int = 8, prefill: bool = False) -> RetrievalScore:
    """Score ``tasks`` (all of one context length) with the cache of ``scheme`` (``CACHE_SCHEMES``):
    ``batch_size`` tasks per decode batch, the context decoded or with ``prefill`` prefilled
    (``teacher_forced``). See RetrievalScore; ValueError for mixed lengths."""
    return retrieval_scores(model, tasks, [scheme], backend=backend, chunk=chunk, batch_size=batch_size,
                            prefill=prefill)[scheme]


def retrieval_scores(model, tasks: Sequence[long_context_tasks.Task], schemes: Sequence[str], *, backend: str,
                     chunk: int = 512, batch_size: int = 8, prefill: bool = False) -> dict[str, RetrievalScore]:
    """``retrieval_accuracy`` of each of ``schemes`` on the same tasks; prefilled, a batch's
    prompts are prefilled once for all the schemes (``prefilled``)."""
    if not tasks:
        raise ValueError("tasks: expected at least one task")
    if len({t.context for t in tasks}) != 1:
        raise ValueError(f"tasks: expected one context length, got {sorted({t.context for t in tasks})}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size}")
    logprobs = {scheme: [] for scheme in schemes}
    context_bits = {scheme: [] for scheme in schemes}
    for i in range(0, len(tasks), batch_size):
        group = tasks[i:i + batch_size]
        tokens, starts = np.stack([t.tokens for t in group]), [t.answer_start for t in group]
        if prefill:
            scored = prefilled(model, tokens, starts, schemes, backend=backend, chunk=chunk)
        else:
            scored = {scheme: teacher_forced(model, tokens, starts, scheme, backend=backend, chunk=chunk)
                      for scheme in schemes}
        for scheme in schemes:
            logprobs[scheme] += scored[scheme].answer_logprobs
            context_bits[scheme].append(scored[scheme].context_bits)
    answers = [t.answer for t in tasks]
    return {scheme: score_answers(logprobs[scheme], answers, None if prefill else np.concatenate(context_bits[scheme]))
            for scheme in schemes}


def paired_difference(score: RetrievalScore, reference: RetrievalScore) -> dict:
    """How ``score`` differs from ``reference`` on the same tasks, task by task.

    only_this_correct / only_reference_correct: tasks that one of the two answers exactly and
    the other does not (the discordant pairs of a paired test; their difference over the
    number of tasks is the accuracy difference). answer_bits_per_byte_diff: the mean of the
    per-task differences (this minus reference) and its standard error (zero for one task);
    context_bits_per_byte_diff the same of the context's bits per byte, where both scores have them.
    """
    def mean_and_stderr(this, ref):
        diff = this.astype(np.float64) - ref.astype(np.float64)
        return float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else 0.0

    out = {"only_this_correct": int((score.correct & ~reference.correct).sum()),
           "only_reference_correct": int((reference.correct & ~score.correct).sum())}
    out["answer_bits_per_byte_diff"], out["answer_bits_per_byte_diff_stderr"] = mean_and_stderr(
        score.answer_bits, reference.answer_bits)
    if score.context_bits is not None and reference.context_bits is not None:
        out["context_bits_per_byte_diff"], out["context_bits_per_byte_diff_stderr"] = mean_and_stderr(
            score.context_bits, reference.context_bits)
    return out


def _select(score: RetrievalScore, mine: np.ndarray) -> RetrievalScore:
    return RetrievalScore(score.correct[mine], score.byte_correct[mine], score.answer_bits[mine],
                          None if score.context_bits is None else score.context_bits[mine])


def evaluate(model, *, contexts: Sequence[int], depths: Sequence[float], kinds: Sequence[str], trials: int,
             schemes: Sequence[str], text: np.ndarray | None, backend: str, chunk: int, batch_size: int,
             seed: int = 0, prefill: bool = False, log=print,
             on_cell: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One row per (kind, context, depth, scheme): accuracy, per-byte accuracy, answer bits per byte,
    chance, number of tasks. The same tasks are scored under every scheme; the rows of every scheme
    but the first also say how it differs from the first, task by task (``paired_difference``, under
    ``reference`` and ``vs_reference``), and from the third scheme on, from the scheme listed before
    it (``previous``, ``vs_previous``): schemes listed as a ladder (bf16, emulated_rope_aware_token,
    emulated_rope_aware_token_query, fp8_xla, fp8) give each rounding's own cost. ``prefill``: each
    task's context prefilled, not decoded (``teacher_forced``). ``on_cell(rows)`` gets the rows so far
    after each (context, depth)."""
    rows = []
    for context in contexts:
        for depth in depths:
            tasks = long_context_tasks.make_tasks(kinds, context, depth, trials, seed, text=text)
            scored = retrieval_scores(model, tasks, schemes, backend=backend, chunk=chunk, batch_size=batch_size,
                                      prefill=prefill)
            scores = []
            for scheme in schemes:
                score = scored[scheme]
                for kind in kinds:
                    mine = np.array([t.kind == kind for t in tasks])
                    row = {"kind": kind, "context": context, "depth": depth, "scheme": scheme,
                           "accuracy": float(score.correct[mine].mean()),
                           "byte_accuracy": float(score.byte_correct[mine].mean()),
                           "answer_bits_per_byte": float(score.answer_bits[mine].mean()),
                           "chance": float(np.mean([t.chance for t in tasks if t.kind == kind])),
                           "tasks": int(mine.sum())}
                    if score.context_bits is not None:
                        row["context_bits_per_byte"] = float(score.context_bits[mine].mean())
                    if scores:
                        row["reference"] = schemes[0]
                        row["vs_reference"] = paired_difference(_select(score, mine), _select(scores[0], mine))
                    if len(scores) > 1:
                        row["previous"] = schemes[len(scores) - 1]
                        row["vs_previous"] = paired_difference(_select(score, mine), _select(scores[-1], mine))
                    rows.append(row)
                scores.append(score)
                log(f"context {context} depth {depth} {scheme}: accuracy {score.accuracy:.3f}, "
                    f"answer {score.bits_per_byte:.3f} bits per byte")
            if on_cell is not None:
                on_cell(rows)
    return rows


def yarn_extended(model: MLAModel, factor: float) -> MLAModel:
    """The same weights with RoPE stretched ``factor`` times by YaRN, without training.

    The config becomes rope_type "yarn" with rope_factor ``factor`` over the trained context
    (``rope_original_max_position``, the old ``max_position_embeddings``, which grows ``factor``
    times); YaRN's defaults otherwise (beta 32 / 1, cos/sin scaled by 0.1 ln(factor) + 1).
    ValueError for a factor below 1 or a model whose RoPE is not the default one.
    """
    cfg = model.cfg
    if not factor >= 1:
        raise ValueError(f"yarn_factor: expected a factor >= 1, got {factor}")
    if cfg.rope_type != "default":
        raise ValueError(f"yarn_factor: the model's RoPE is already {cfg.rope_type!r}; expected a default RoPE "
                         "to stretch")
    stretched = dataclasses.replace(cfg, rope_type="yarn", rope_factor=float(factor),
                                    rope_original_max_position=cfg.max_position_embeddings,
                                    max_position_embeddings=int(round(cfg.max_position_embeddings * factor)))
    dtype = model.embed_tokens.embedding[...].dtype
    # RoPE's frequencies are static attributes of the graph: a graph built from the stretched
    # config, holding this model's arrays.
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: MLAModel(stretched, rngs=nnx.Rngs(0), dtype=dtype)))
    return nnx.merge(graphdef, nnx.state(model))


def trained_context_note(trained_context: int, contexts: Sequence[int], yarn_factor: float | None = None) -> str:
    """The line that says how the contexts compare with what the model was trained on."""
    beyond = [c for c in contexts if c > trained_context]
    note = f"Model trained on windows of {trained_context} tokens (max_position_embeddings)."
    if yarn_factor is not None:
        note += (f" RoPE stretched {yarn_factor:g}x by YaRN, without training, to "
                 f"{int(round(trained_context * yarn_factor))} positions.")
    if beyond and yarn_factor is None:
        note += (f" Contexts {beyond} are beyond it: the model never saw those positions, so accuracy near "
                 "chance there is expected and says nothing about the cache.")
    elif beyond:
        note += (f" Contexts {beyond} are beyond the trained windows: what the model finds there, it finds "
                 "through the stretch.")
    return note


def _vs(row: dict, key: str = "vs_reference") -> str:
    """A row's task-by-task difference from the first scheme (or under ``key``, another): +tasks only
    it answers / -tasks only the other answers, then the mean differences of answer and context bits
    per byte with their standard errors."""
    if key not in row:
        return ""
    d = row[key]
    text = (f"+{d['only_this_correct']} / -{d['only_reference_correct']}; answer "
            f"{d['answer_bits_per_byte_diff']:+.4f} +- {d['answer_bits_per_byte_diff_stderr']:.4f}")
    if "context_bits_per_byte_diff" in d:
        text += (f"; context {d['context_bits_per_byte_diff']:+.5f} +- "
                 f"{d['context_bits_per_byte_diff_stderr']:.5f}")
    return text


CONTEXT_FILL = {
    False: "Contexts decoded: every token's attention reads the cache (mla_decode), as in a long generation.",
    True: "Contexts prefilled, as generate serves a prompt: the prefill's full-precision attention writes the "
          "cache; only the answer's positions read it (mla_decode), the first answer byte from the prefill itself.",
}


def to_markdown(results: dict) -> str:
    """The rows as one markdown table, under the trained-context note."""
    lines = [results["trained_context_note"], "",
             CONTEXT_FILL[bool(results.get("prefill"))], "",
             f"Backend `{results['backend']}`, {results['trials']} tasks per kind and (context, depth); accuracy is "
             "exact match of the greedy answer; byte accuracy the share of answer bytes that are the argmax; "
             "bits per byte of the answer and of the context before it; vs first scheme: tasks only this scheme "
             "answers / only the first answers, and the mean task-by-task differences of bits per byte with their "
             "standard errors; vs previous scheme: the same against the scheme listed before it.", "",
             "| task | context | depth | scheme | accuracy | byte accuracy | answer bits/byte | context bits/byte "
             "| chance | vs first scheme | vs previous scheme |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    context_bits = lambda r: f"{r['context_bits_per_byte']:.4f}" if "context_bits_per_byte" in r else ""
    lines += [f"| {r['kind']} | {r['context']} | {r['depth']:g} | {r['scheme']} | {r['accuracy']:.3f} | "
              f"{r['byte_accuracy']:.3f} | {r['answer_bits_per_byte']:.3f} | {context_bits(r)} | "
              f"{r['chance']:.1e} | {_vs(r)} | {_vs(r, 'vs_previous')} |"
              for r in results["rows"]]
    return "\n".join(lines) + "\n"


def combine_runs(runs: Sequence[dict], trials: int | Sequence[int] | None = None) -> dict:
    """One results dict from several runs' (each ``--json``'s content): their rows, a cell (kind,
    context, depth, scheme) kept from the run of most trials that has it (the first of equals), so
    a small probe never hides a larger run of the same cell. ``trials`` keeps only the
    runs of that many trials (or of any of several counts). Runs may stretch RoPE by different YaRN
    factors at different contexts (a model's trained contexts as they are, 32k through a stretch of
    2, 64k of 4): each row then carries its run's ``yarn_factor`` and the note says which contexts
    were stretched. ValueError when no run is left, the runs' trained contexts differ, or one
    context comes from runs of different stretches."""
    counts = None if trials is None else {trials} if isinstance(trials, int) else set(trials)
    runs = [r for r in runs if counts is None or r["trials"] in counts]
    if not runs:
        raise ValueError("expected at least one run" + ("" if counts is None else
                                                        f" of {' or '.join(map(str, sorted(counts)))} trials"))
    if len({r["trained_context"] for r in runs}) != 1:
        raise ValueError(f"runs of different models: trained contexts {sorted({r['trained_context'] for r in runs})}")
    if len({bool(r.get("prefill")) for r in runs}) != 1:
        raise ValueError("runs whose contexts were filled differently: some prefilled (--prefill), some decoded")
    stretch_of = {}  # context -> YaRN factor (None: as trained)
    for run in runs:
        for row in run["rows"]:
            factor = stretch_of.setdefault(row["context"], run.get("yarn_factor"))
            if factor != run.get("yarn_factor"):
                raise ValueError(f"runs of different RoPE stretches at context {row['context']}: YaRN factors "
                                 f"{factor} and {run.get('yarn_factor')}")
    rows, seen = [], set()
    for run in sorted(runs, key=lambda r: -r["trials"]):
        for row in run["rows"]:
            cell = (row["kind"], row["context"], row["depth"], row["scheme"])
            if cell not in seen:
                seen.add(cell)
                rows.append(row if run.get("yarn_factor") is None else dict(row, yarn_factor=run["yarn_factor"]))
    trained = runs[0]["trained_context"]
    stretches = set(stretch_of.values())
    if len(stretches) == 1:
        yarn_factor = stretches.pop()
        note = trained_context_note(trained, sorted(stretch_of), yarn_factor)
    else:
        yarn_factor = None
        note = " ".join([trained_context_note(trained, sorted(c for c, f in stretch_of.items() if f is None))] + [
            f"Contexts {sorted(c for c, f in stretch_of.items() if f == factor)}: RoPE stretched {factor:g}x by YaRN, "
            "without training." for factor in sorted(f for f in stretches if f is not None)])
    return {"trained_context": trained, "trained_context_note": note, "yarn_factor": yarn_factor,
            "prefill": bool(runs[0].get("prefill")), "rows": rows,
            "trials": "/".join(str(t) for t in dict.fromkeys(r["trials"] for r in runs)),
            "backend": "/".join(dict.fromkeys(r["backend"] for r in runs)),
            "commands": [r["command"] for r in runs]}


def accuracy_difference(row: dict) -> tuple[float, float]:
    """A paired row's accuracy minus its reference scheme's, and the standard error of that
    difference from the discordant tasks (b only this, c only the reference, n tasks):
    sqrt(b + c - (b - c)^2 / n) / n."""
    d, n = row["vs_reference"], row["tasks"]
    b, c = d["only_this_correct"], d["only_reference_correct"]
    return (b - c) / n, float(np.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n)


def plot(results: dict, path: str | pathlib.Path) -> None:
    """PNG, a column per task kind: accuracy against context (mean over the depths measured at every
    context), accuracy against
    depth, and (where the rows are paired) accuracy minus the first scheme's in points with
    +-2 standard errors, against depth; a line per scheme, and in the lower panels per context
    (line style). A dotted line marks the trained context."""
    plt = pyplot()
    rows = results["rows"]
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    contexts = sorted({r["context"] for r in rows})
    styles = dict(zip(contexts, ["-", "--", ":", "-."] * len(contexts)))
    colors = {s: f"C{i}" for i, s in enumerate(schemes)}
    paired = any("vs_reference" in r for r in rows)
    fig, axes = plt.subplots(2 + paired, len(kinds), figsize=(3.4 * len(kinds), 2.9 * (2 + paired)), squeeze=False)
    for col, kind in enumerate(kinds):
        for scheme in schemes:
            mine = [r for r in rows if r["kind"] == kind and r["scheme"] == scheme]
            xs = sorted({r["context"] for r in mine})
            # Depths measured at every context, so that each point averages the same needles.
            common = set.intersection(*({r["depth"] for r in mine if r["context"] == x} for x in xs)) if xs else set()
            axes[0, col].plot(xs, [np.mean([r["accuracy"] for r in mine if r["context"] == x and r["depth"] in common])
                                   for x in xs], "o-", color=colors[scheme], label=scheme)
            for context in contexts:
                here = sorted((r for r in mine if r["context"] == context), key=lambda r: r["depth"])
                if not here:
                    continue
                depths = [r["depth"] for r in here]
                axes[1, col].plot(depths, [r["accuracy"] for r in here], "o", linestyle=styles[context],
                                  color=colors[scheme], label=f"{scheme}, {context}")
                if paired and "vs_reference" in here[0]:
                    diff, err = np.array([accuracy_difference(r) for r in here]).T
                    axes[2, col].errorbar(depths, 100 * diff, yerr=200 * err, marker="o", capsize=2,
                                          linestyle=styles[context], color=colors[scheme],
                                          label=f"{scheme} - {here[0]['reference']}, {context}")
        axes[0, col].set_xscale("log", base=2)
        axes[0, col].axvline(results["trained_context"], color="gray", linestyle=":")
        axes[0, col].set_title(kind, fontsize=9)
        axes[0, col].set_xlabel("context (tokens)")
        for ax in axes[1:, col]:
            ax.set_xlabel("depth")
        for ax in axes[:2, col]:
            ax.set_ylim(-0.05, 1.05)
        if paired:
            axes[2, col].axhline(0, color="gray", linewidth=0.8)
        for ax in axes[:, col]:
            ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("accuracy (mean over the depths\nmeasured at every context)")
    axes[1, 0].set_ylabel("accuracy (line style: context)")
    axes[0, 0].legend(fontsize=7)
    axes[1, 0].legend(fontsize=6)
    if paired:
        axes[2, 0].set_ylabel("accuracy difference (points, +-2 s.e.)")
        axes[2, 0].legend(fontsize=6)
    if results.get("yarn_factor"):  # one stretch for the whole run
        stretched = {c: results["yarn_factor"] for c in contexts if c > results["trained_context"]}
    else:  # combined runs: each stretched row carries its factor
        stretched = dict(sorted({r["context"]: r["yarn_factor"] for r in rows if r.get("yarn_factor")}.items()))
    fill = "contexts prefilled" if results.get("prefill") else "contexts decoded"
    fig.suptitle(f"Retrieval through the cache ({fill}); trained context {results['trained_context']} tokens (dotted)" +
                 "".join(f"; {c} through YaRN {f:g}x" for c, f in stretched.items()), fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


def _parser() -> cli.Parser:
    p = cli.Parser(prog="python -m snapmla_jax.fidelity_long", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(LONG_MODEL_DIR),
                   help="train_demo output directory (default: the shipped model trained to retrieve at 16k "
                        "tokens); filler comes from its held-out text")
    p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS), help="context lengths in tokens")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS),
                   help="needle depths, fractions in [0, 1]")
    p.add_argument("--trials", type=int, nargs="+",
                   help="tasks per kind and (context, depth) (default 4); with --from-json, keep only the runs of "
                        "this many (or of any of several counts)")
    p.add_argument("--tasks", nargs="+", choices=long_context_tasks.TASK_KINDS,
                   default=list(long_context_tasks.TASK_KINDS), help="task kinds")
    p.add_argument("--schemes", nargs="+", choices=tuple(CACHE_SCHEMES), default=["bf16", "fp8"],
                   help="cache schemes, the first the reference (emulated_*: FP8 round trip into a BF16 cache; "
                        "fp8_xla: the FP8 cache through the XLA path; fp8_two_term_query: the FP8 cache with "
                        "the query as two FP8 terms, mla_decode's query_terms=2; fp8_qk_sums_128: the FP8 cache "
                        "with Q.K summed in float32 every 128 features in every kernel, mla_decode's "
                        "qk_promotion=128)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per decode call")
    p.add_argument("--prefill", action="store_true",
                   help="fill each context as generate serves a prompt: the model's prefill (full-precision "
                        "attention) writes the cache and only the answer's positions read it through mla_decode "
                        "(default: every context token decoded through the cache, as in a long generation; only "
                        "then are the context's bits per byte measured)")
    p.add_argument("--batch-size", type=int, default=8, help="tasks per decode batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the first trial")
    p.add_argument("--yarn-factor", type=float,
                   help="stretch the model's RoPE this many times by YaRN (no training) to reach contexts past "
                        "its trained windows, e.g. 4 for 64k on a model trained at 16k")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="write_kv/mla_decode backend (default auto)")
    p.add_argument("--from-json", nargs="+", metavar="FILE",
                   help="measure nothing: combine the runs in these files (a --json output, or {\"runs\": [...]} "
                        "of them) into --json / --markdown / --plot")
    p.add_argument("--json", help="write all rows to this file")
    p.add_argument("--markdown", help="write the table to this file")
    p.add_argument("--plot", help="write accuracy against context and depth to this PNG")
    return p


def _check_args(args) -> None:
    for trials in args.trials or ():
        if trials < 1:
            raise cli.UsageError(f"--trials: expected an int >= 1, got {trials}")
    if args.trials is not None and len(args.trials) > 1 and not args.from_json:
        raise cli.UsageError(f"--trials: expected one count when measuring (several only with --from-json), got "
                             f"{args.trials}")
    cli.check_positive(args, "chunk", "batch_size")
    if args.seed < 0:
        raise cli.UsageError(f"--seed: expected an int >= 0, got {args.seed}")
    if args.yarn_factor is not None and not args.yarn_factor >= 1:
        raise cli.UsageError(f"--yarn-factor: expected a factor >= 1, got {args.yarn_factor}")
    for depth in args.depths:
        if not 0.0 <= depth <= 1.0:
            raise cli.UsageError(f"--depths: expected fractions in [0, 1], got {depth}")
    for flag in ("json", "markdown", "plot"):
        cli.check_output_file(f"--{flag}", getattr(args, flag))


def _write(results: dict, args) -> None:
    print_and_write(results, to_markdown(results), args.json, args.markdown)
    if args.plot:
        plot(results, args.plot)


RUN_KEYS = frozenset({"rows", "trials", "trained_context", "backend", "command"})


def _combine(args) -> int:
    runs = []
    for path in args.from_json:
        try:
            content = json.loads(pathlib.Path(path).read_text())
            found = content["runs"] if isinstance(content, dict) and "runs" in content else [content]
            bad = [run for run in found if not isinstance(run, dict) or not RUN_KEYS <= run.keys()]
        except (OSError, ValueError, TypeError) as err:
            raise cli.UsageError(f"--from-json: cannot read {path} as JSON ({cli.one_line(err)})") from err
        if bad:
            raise cli.UsageError(f"--from-json: {path} is not a fidelity_long --json output (expected the keys "
                                 f"{', '.join(sorted(RUN_KEYS))} in every run)")
        runs += found
    try:
        results = combine_runs(runs, args.trials)
    except ValueError as err:
        raise cli.UsageError(f"--from-json: {err}") from err
    _write(results, args)
    return 0


def _long_context(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _check_args(args)
    if args.from_json:
        return _combine(args)
    args.trials = 4 if args.trials is None else args.trials[0]
    backend = cli.backend(args.backend)
    model, heldout = model_flag(args.model)
    root, present, _ = heldout_files_flag(heldout)
    text = byte_corpus.token_stream(root, present)
    text = text[text < byte_corpus.NUM_BYTES]
    for context in args.contexts:  # every task is built once here, so a bad context fails before any work
        try:
            for depth in args.depths:
                long_context_tasks.make_tasks(args.tasks, context, depth, 1, args.seed, text=text)
        except ValueError as err:
            raise cli.UsageError(f"--contexts: {cli.one_line(err)}") from err
    trained = model.cfg.max_position_embeddings
    if args.yarn_factor is not None:
        try:
            model = yarn_extended(model, args.yarn_factor)
        except ValueError as err:
            raise cli.flag_error(err, {"yarn_factor": "--yarn-factor"}) from err
    note = trained_context_note(trained, args.contexts, args.yarn_factor)
    print(note, flush=True)
    results = {"trained_context": trained, "trained_context_note": note, "yarn_factor": args.yarn_factor,
               "rows": [], "trials": args.trials, "prefill": args.prefill,
               "backend": backend, "device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
               "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
               "command": "python -m snapmla_jax.fidelity_long " + " ".join(argv)}

    def save(rows):  # after every (context, depth), so a run cut short keeps what it measured
        results["rows"] = rows
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")

    rows = evaluate(model, contexts=args.contexts, depths=args.depths, kinds=args.tasks, trials=args.trials,
                    schemes=args.schemes, text=text, backend=backend, chunk=args.chunk, batch_size=args.batch_size,
                    seed=args.seed, prefill=args.prefill, on_cell=save)
    results["rows"] = rows
    _write(results, args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input or out of memory)."""
    return cli.run(PROG, _long_context, argv, out_of_memory_hint="try fewer --contexts, a smaller --batch-size or "
                                                                  "--chunk")


if __name__ == "__main__":
    sys.exit(main())
