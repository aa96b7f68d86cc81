"""Batched text generation over the paged latent cache, and its command line.

``generate(model, prompts, ...)`` runs in two compiled programs:

* prefill: the right-padded prompts go through the model's full causal forward
  once; every layer writes its latents into the cache (``write_kv``), and the
  first new token is drawn from each row's last prompt position;
* decode: one ``jax.jit`` holding a ``lax.while_loop`` that feeds the last
  token of every row through the absorbed-form decode step (``write_kv`` then
  ``mla_decode`` per layer), draws the next token, and stops when every row
  has produced ``eos_id`` or the chunk's step limit is reached. The loop state
  (caches included) is donated, so the cache is updated in place.

Streaming runs the same compiled decode program in chunks of ``chunk_size``
steps (the step limit is a traced argument: one compilation serves every
chunk) and yields each chunk's tokens as it completes.

Pages for each row cover its prompt plus ``max_new_tokens``
(``snapmla_jax.paging``). Sampling (``snapmla_jax.sampling``) uses the key
``jax.random.key(seed)`` folded with the step index, so a run repeats exactly
for a fixed seed.

With ``mesh=`` (a 1-D ``jax.sharding.Mesh`` of N devices) both programs run data-parallel
attention with expert parallelism (``snapmla_jax.data_parallel``): each device holds the
caches of its own B / N rows (the batch padded to a multiple of N with one-token rows that are
dropped) and runs their attention; the routed experts are split over the same devices and
reached through collectives; the rest of the model is replicated. The tokens are those of one
device up to floating-point summation order.

Before allocating anything, a batch is checked against the memory its cache needs
(``cache_budget``): ``BatchTooLarge`` says how many of the prompts, or how many new
tokens, would fit.

The package exports this module as ``snapmla_jax.generate``, callable as the function
``generate`` (``snapmla_jax.generate(model, prompts, ...)``), with ``stream`` and
``generate_with_stats`` beside it.

Command line: ``python -m snapmla_jax.generate --model DIR --prompt TEXT``
(see ``main``; docs/generation.md has the details).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import json
import os
import pathlib
import sys
import time
import types
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from snapmla_jax import cli
from snapmla_jax.backend import BACKENDS, resolve_backend
from snapmla_jax.cache import CACHE_DTYPES, MAX_TOKEN_SLOTS
from snapmla_jax.decode import QK_PROMOTIONS, QUERY_TERMS, check_interpreter_devices, check_qk_promotion
from snapmla_jax import data_parallel
from snapmla_jax.paging import allocate_pages
from snapmla_jax.sampling import SamplingConfig, sample

DEFAULT_PAGE_SIZE = 64
# Prompts are right-padded to a power of two (at least this) so that prompts of
# similar length share one compiled prefill.
MIN_PROMPT_BUCKET = 16
DEFAULT_CHUNK_SIZE = 8  # decode steps between two streamed outputs
MAX_COMPILED = 16  # compiled programs kept for reuse (each holds device code)
# Share of a GPU's free memory (memory_stats: bytes_limit - bytes_in_use, the weights already
# counted) the KV cache may take; the rest is left to the prefill's activations and XLA's
# temporaries.
DEVICE_MEMORY_SHARE = 0.9
# On a device that reports no memory statistics (JAX's CPU backend), the share of the host's
# available memory (MemAvailable) the KV cache may take: its arrays live in host memory beside
# the process, the weights and XLA's temporaries.
HOST_MEMORY_SHARE = 0.5
GIB = 1 << 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's carry.

    caches: tuple of per-layer LatentCache.   tokens: [B, max_new_tokens] int32,
    the generated tokens (slots past ``step`` hold 0).   step: [] int32, tokens
    generated so far.   finished: [B] bool, the row has produced ``eos_id``.
    """

    caches: tuple
    tokens: jax.Array
    step: jax.Array
    finished: jax.Array


def _model_call(method: str, graphdef, params, mesh, *row_args, **kwargs):
    """``MLAModel.<method>(*row_args, **kwargs)`` of ``nnx.merge(graphdef, params)``; with a
    mesh, data-parallel over its devices (``data_parallel.row_sharded``)."""
    if mesh is None:
        return getattr(nnx.merge(graphdef, params), method)(*row_args, **kwargs)
    return data_parallel.row_sharded(method, graphdef, mesh, **kwargs)(params, *row_args)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "backend", "mesh"), donate_argnames=("caches",))
def _prefill(params, caches, input_ids, lengths, block_table, key, *, graphdef, sampling, backend, mesh=None):
    """Fill the cache from the prompts and draw each row's first new token ([B] int32)."""
    last, caches = _model_call("prefill", graphdef, params, mesh, input_ids, lengths, caches, block_table,
                               backend=backend, last_only=True)
    return sample(last, jax.random.fold_in(key, 0), sampling), caches


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "eos_id", "backend", "mesh", "query_terms",
                                             "qk_promotion"), donate_argnames=("state",))
def decode_chunk(params, state: DecodeState, lengths, block_table, key, stop_step, *, graphdef, sampling, eos_id,
                 backend, mesh=None, query_terms: int = 1, qk_promotion: int | None = None) -> DecodeState:
    """The compiled decode loop: steps until ``state.step == min(stop_step, max_new_tokens)``
    or every row is finished. ``params``/``graphdef``: ``nnx.split(model)``; lengths [B]
    int32 prompt lengths; block_table [B, max_pages] int32; key: the sampling key;
    stop_step [] int32; mesh: None, or the 1-D mesh the model's rows are split over
    (``data_parallel``); query_terms, qk_promotion: the FP8 query's terms and the features a
    float32 sum of its FP8 Q.K products covers (``mla_decode``'s). ``state`` is donated (the
    caches are updated in place)."""
    stop_step = jnp.minimum(stop_step, state.tokens.shape[1])

    def running(s: DecodeState):
        return (s.step < stop_step) & ~jnp.all(s.finished)

    def step(s: DecodeState) -> DecodeState:
        last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
        # The cache holds the prompt and the s.step - 1 tokens fed before: with
        # this one, lengths + s.step.
        logits, caches = _model_call("decode", graphdef, params, mesh, last, s.caches, block_table, lengths + s.step,
                                     backend=backend, query_terms=query_terms, qk_promotion=qk_promotion)
        new = sample(logits[:, 0], jax.random.fold_in(key, s.step), sampling)
        finished = s.finished
        if eos_id is not None:
            # Finished rows keep emitting eos_id: a valid token to feed, trimmed on output.
            new = jnp.where(finished, eos_id, new)
            finished = finished | (new == eos_id)
        tokens = jax.lax.dynamic_update_slice_in_dim(s.tokens, new[:, None], s.step, axis=1)
        return DecodeState(caches=caches, tokens=tokens, step=s.step + 1, finished=finished)

    return jax.lax.while_loop(running, step, state)


_COMPILED: collections.OrderedDict = collections.OrderedDict()


def _signature(tree) -> tuple:
    """What a compiled program is specialised to: the tree's structure and each leaf's shape,
    dtype and sharding (a program compiled for arrays on one device refuses them on a mesh)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((leaf.shape, str(leaf.dtype), getattr(leaf, "sharding", None)) for leaf in leaves)


def _compiled(fn, static: dict, args: tuple):
    """``fn`` compiled ahead of time for ``args`` and the ``static`` keyword arguments
    (reused for equal ``_signature`` and static values); returns (callable taking
    ``args``, seconds spent compiling)."""
    key = (fn, tuple(sorted(static.items())), _signature(args))
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    compiled = fn.lower(*args, **static).compile()
    _COMPILED[key] = compiled
    while len(_COMPILED) > MAX_COMPILED:
        _COMPILED.popitem(last=False)
    return compiled, time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """Counts and times of one generation (seconds exclude compilation).

    prompt_tokens: sum of prompt lengths.  generated_tokens: new tokens returned
    (EOS excluded); the first token of each row comes from prefill, the rest
    from decode (decode_tokens).  cache_bytes: bytes of the KV cache arrays.
    """

    prompt_tokens: int
    generated_tokens: int
    decode_tokens: int
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    cache_bytes: int
    kv_cache: str

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """tokens: per prompt, the new tokens (EOS excluded).  finished: per prompt,
    whether it stopped at ``eos_id`` (else at ``max_new_tokens``)."""

    tokens: list[list[int]]
    finished: list[bool]
    stats: GenerationStats


def _validate_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts: expected a non-empty list of token-id lists, got {type(prompts).__name__}")
    rows = []
    for i, prompt in enumerate(prompts):
        row = np.asarray(prompt)
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompts: expected prompts[{i}] to be a non-empty list of ints, got {prompt!r:.80}")
        if (row < 0).any() or (row >= vocab_size).any():
            raise ValueError(f"prompts: prompts[{i}] holds ids outside [0, {vocab_size}) (the model's vocabulary)")
        rows.append([int(t) for t in row])
    return rows


class BatchTooLarge(ValueError):
    """A batch whose KV cache does not fit (see ``check_cache_fits``).

    needed_bytes: the cache it needs; budget_bytes, budget: what it may take and why (text);
    fit_prompts: how many of the prompts, from the first, fit with the same max_new_tokens;
    fit_new_tokens: the largest max_new_tokens with which all of them fit (0: none).
    """

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int, budget: str, fit_prompts: int,
                 fit_new_tokens: int):
        super().__init__(message)
        self.needed_bytes, self.budget_bytes, self.budget = needed_bytes, budget_bytes, budget
        self.fit_prompts, self.fit_new_tokens = fit_prompts, fit_new_tokens


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def cache_budget(devices: Sequence | None = None) -> tuple[int, str] | None:
    """(bytes a KV cache may take on each of ``devices``, an explanation) or None when unknown.

    A device reporting ``memory_stats()`` (GPUs) gives DEVICE_MEMORY_SHARE of its free
    memory, ``bytes_limit - bytes_in_use``; one reporting none (CPU) gives HOST_MEMORY_SHARE
    of the host's available memory. The smallest over ``devices`` (default: the local devices).
    """
    best = None
    for device in jax.local_devices() if devices is None else devices:
        try:
            stats = device.memory_stats()
        except Exception:  # backends without the call raise their own errors
            stats = None
        if stats and "bytes_limit" in stats:
            free = max(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), 0)
            budget = (int(free * DEVICE_MEMORY_SHARE),
                      f"{DEVICE_MEMORY_SHARE:.0%} of the {free / GIB:.2f} GiB free on {device.device_kind}")
        else:
            available = _host_available_bytes()
            if available is None:
                continue
            budget = (int(available * HOST_MEMORY_SHARE),
                      f"{HOST_MEMORY_SHARE:.0%} of the host's {available / GIB:.2f} GiB of available memory "
                      f"({device.platform} device)")
        if best is None or budget[0] < best[0]:
            best = budget
    return best


def _pages(lengths: np.ndarray, new_tokens: int, page_size: int) -> np.ndarray:
    return -(-(lengths + new_tokens) // page_size)


def check_cache_fits(model, lengths: Sequence[int], max_new_tokens: int, kv_cache: str, page_size: int,
                     budget: tuple[int, str] | None) -> None:
    """BatchTooLarge unless the per-layer caches for prompts of ``lengths`` plus ``max_new_tokens``
    fit ``budget`` (``cache_budget()``; None: not checked) and what the kernels address
    (``cache.MAX_TOKEN_SLOTS`` in one layer's cache array, whatever the memory)."""
    lengths = np.asarray(lengths, np.int64)
    one_page = jax.eval_shape(lambda: model.init_cache(1, page_size, kv_cache=kv_cache))
    page_bytes = sum(c.nbytes for c in one_page)
    fit_pages = MAX_TOKEN_SLOTS // page_size
    limit = f"{fit_pages} pages of {page_size} tokens (what the kernels address in one layer's cache array)"
    if budget is not None and budget[0] // page_bytes < fit_pages:
        fit_pages, limit = budget[0] // page_bytes, budget[1]
    pages = _pages(lengths, max_new_tokens, page_size)
    if pages.sum() <= fit_pages:
        return
    fit_prompts = int(np.searchsorted(np.cumsum(pages), fit_pages, side="right"))
    low, high = 0, max_new_tokens  # the largest new-token count whose pages fit (0 if none)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if _pages(lengths, mid, page_size).sum() <= fit_pages else (low, mid - 1)
    fit_new = low if _pages(lengths, low, page_size).sum() <= fit_pages else 0
    needed = int(pages.sum()) * page_bytes
    raise BatchTooLarge(
        f"prompts: {len(lengths)} prompts with max_new_tokens={max_new_tokens} need {needed / GIB:.2f} GiB of "
        f"{kv_cache} KV cache, more than {limit}; the first {fit_prompts} fit"
        + (f", or all of them with max_new_tokens={fit_new}" if fit_new else ""),
        needed_bytes=needed, budget_bytes=fit_pages * page_bytes, budget=limit, fit_prompts=fit_prompts,
        fit_new_tokens=fit_new)


def _to_host(x: jax.Array) -> np.ndarray:
    """``x``'s value on this host; an array split over several processes' devices (a mesh under
    ``jax.distributed``) is gathered from all of them."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _check_caches_fit_each_device(model, lengths: list[int], max_new_tokens: int, kv_cache: str, page_size: int,
                                  budget, groups: int) -> None:
    """``check_cache_fits`` for each device's rows (``groups`` consecutive groups of ``lengths``):
    BatchTooLarge for the device needing the most, with the new-token count at which every
    device's rows fit (how many prompts would fit is not said: fewer prompts regroup the rows)."""
    failures = []
    for group, group_lengths in enumerate(np.split(np.asarray(lengths), groups)):
        try:
            check_cache_fits(model, group_lengths, max_new_tokens, kv_cache, page_size, budget)
        except BatchTooLarge as err:
            failures.append((group, len(group_lengths), err))
    if not failures:
        return
    group, rows, worst = max(failures, key=lambda failure: failure[2].needed_bytes)
    raise BatchTooLarge(f"mesh: device {group} holds rows {group * rows}-{group * rows + rows - 1}: {worst}",
                        needed_bytes=worst.needed_bytes, budget_bytes=worst.budget_bytes, budget=worst.budget,
                        fit_prompts=0, fit_new_tokens=min(err.fit_new_tokens for _, _, err in failures))


def _prompt_bucket(max_len: int) -> int:
    return max(MIN_PROMPT_BUCKET, 1 << (max_len - 1).bit_length())


class GenerationStream:
    """Iterating yields each decode chunk's new tokens as a [B, n] int32 numpy array
    (rows that have finished repeat ``eos_id``); afterwards ``result`` holds the
    GenerationResult. Build it with ``stream`` (same arguments as ``generate``)."""

    def __init__(self, model, prompts, *, max_new_tokens: int, kv_cache: str = "fp8",
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0, eos_id: int | None = None,
                 chunk_size: int | None = DEFAULT_CHUNK_SIZE, backend: str = "auto",
                 page_size: int = DEFAULT_PAGE_SIZE, mesh: jax.sharding.Mesh | None = None, query_terms: int = 1,
                 qk_promotion: int | None = None):
        cfg = getattr(model, "cfg", None)
        if cfg is None or not hasattr(model, "decode"):
            raise ValueError(f"model: expected an MLAModel, got {type(model).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if kv_cache not in CACHE_DTYPES:
            raise ValueError(f"kv_cache: expected one of {CACHE_DTYPES}, got {kv_cache!r}")
        if type(query_terms) is not int or query_terms not in QUERY_TERMS:
            raise ValueError(f"query_terms: expected one of {QUERY_TERMS}, got {query_terms!r}")
        check_qk_promotion(qk_promotion)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed: expected an int, got {seed!r}")
        if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                                   or not 0 <= eos_id < cfg.vocab_size):
            raise ValueError(f"eos_id: expected None or an int in [0, {cfg.vocab_size}), got {eos_id!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):
            raise ValueError(f"chunk_size: expected None (one chunk) or an int >= 1, got {chunk_size!r}")
        self.prompts = _validate_prompts(prompts, cfg.vocab_size)
        lengths = [len(p) for p in self.prompts]
        context = cfg.max_position_embeddings
        if max(lengths) + max_new_tokens > context:
            row = int(np.argmax(lengths))
            raise ValueError(f"max_new_tokens: prompts[{row}] has {lengths[row]} tokens; with {max_new_tokens} new "
                             f"ones it exceeds the model's context of {context} tokens")
        if resolve_backend(backend) == "interpret":  # a bad name fails here, not at the first trace
            check_interpreter_devices()
        self.mesh = mesh
        self.rows = len(lengths)  # the batch on one device, or padded to a multiple of the mesh's devices
        if mesh is not None:
            data_parallel.mesh_axis(mesh)  # a bad mesh fails here
            model = data_parallel.place_model(model, mesh)
            self.rows = data_parallel.padded_rows(len(lengths), mesh)
            lengths = lengths + [1] * (self.rows - len(lengths))
        groups = 1 if mesh is None else mesh.size
        self.pages = allocate_pages(lengths, max_new_tokens, page_size=page_size, groups=groups)
        budget = cache_budget(None if mesh is None else mesh.local_devices)
        if mesh is None:
            check_cache_fits(model, lengths, max_new_tokens, kv_cache, page_size, budget)
        else:
            _check_caches_fit_each_device(model, lengths, max_new_tokens, kv_cache, page_size, budget, groups)
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.kv_cache = kv_cache
        self.sampling = sampling
        self.seed = seed
        self.eos_id = eos_id
        self.chunk_size = chunk_size or max_new_tokens
        self.backend = backend
        self.query_terms = query_terms
        self.qk_promotion = qk_promotion
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[np.ndarray]:
        batch, rows = len(self.prompts), self.rows
        lengths = np.ones(rows, np.int32)  # padding rows (a mesh's): one token, id 0
        lengths[:batch] = [len(p) for p in self.prompts]
        input_ids = np.zeros((rows, _prompt_bucket(int(lengths.max()))), np.int32)
        for row, prompt in enumerate(self.prompts):
            input_ids[row, :len(prompt)] = prompt
        pages, mesh = self.pages, self.mesh
        graphdef, params = nnx.split(self.model)
        if mesh is None:
            caches = self.model.init_cache(pages.num_pages, pages.page_size, kv_cache=self.kv_cache)
            put = jnp.asarray
        else:
            caches = data_parallel.create_caches(self.model, pages.num_pages, pages.page_size, self.kv_cache, mesh)
            put = functools.partial(jax.device_put, device=data_parallel.rows_sharding(mesh))
        cache_bytes = sum(c.nbytes for c in caches)
        lengths_dev, block_table = put(lengths), put(pages.block_table)
        key = jax.random.key(self.seed)

        args = (params, caches, put(input_ids), lengths_dev, block_table, key)
        static = dict(graphdef=graphdef, sampling=self.sampling, backend=self.backend, mesh=mesh)
        prefill, compile_s = _compiled(_prefill, static, args)
        start = time.perf_counter()
        first, caches = prefill(*args)
        first = _to_host(first)
        prefill_s = time.perf_counter() - start
        tokens = np.zeros((rows, self.max_new_tokens), np.int32)
        tokens[:, 0] = first
        finished = np.zeros(rows, bool) if self.eos_id is None else first == self.eos_id
        finished[batch:] = True  # padding rows never hold up the loop
        yield first[:batch, None]

        state = DecodeState(caches=caches, tokens=put(tokens), step=jnp.asarray(1, jnp.int32),
                            finished=put(finished))
        static = dict(graphdef=graphdef, sampling=self.sampling, eos_id=self.eos_id, backend=self.backend, mesh=mesh,
                      query_terms=self.query_terms, qk_promotion=self.qk_promotion)
        decode_s, step = 0.0, 1
        while step < self.max_new_tokens and not finished.all():
            args = (params, state, lengths_dev, block_table, key, jnp.asarray(step + self.chunk_size, jnp.int32))
            decode, seconds = _compiled(decode_chunk, static, args)
            compile_s += seconds
            start = time.perf_counter()
            state = decode(*args)
            new_step = int(_to_host(state.step))
            tokens = _to_host(state.tokens)
            finished = _to_host(state.finished)
            decode_s += time.perf_counter() - start
            yield tokens[:batch, step:new_step]
            step = new_step

        out, done = [], []
        for row in tokens[:batch, :step]:
            stop = np.flatnonzero(row == self.eos_id) if self.eos_id is not None else []
            out.append(row[:stop[0]].tolist() if len(stop) else row.tolist())
            done.append(bool(len(stop)))
        generated = sum(len(r) for r in out)
        self.result = GenerationResult(tokens=out, finished=done, stats=GenerationStats(
            prompt_tokens=int(lengths[:batch].sum()), generated_tokens=generated,
            decode_tokens=generated - sum(1 for r in out if r), prefill_seconds=prefill_s,
            decode_seconds=decode_s, compile_seconds=compile_s, cache_bytes=cache_bytes, kv_cache=self.kv_cache))


def stream(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, kv_cache: str = "fp8",
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
           chunk_size: int = DEFAULT_CHUNK_SIZE, backend: str = "auto",
           page_size: int = DEFAULT_PAGE_SIZE, mesh: jax.sharding.Mesh | None = None,
           query_terms: int = 1, qk_promotion: int | None = None) -> GenerationStream:
    """Like ``generate``, but an iterable of token chunks (see GenerationStream);
    ``chunk_size`` decode steps run between two chunks."""
    return GenerationStream(model, prompts, max_new_tokens=max_new_tokens, kv_cache=kv_cache,
                            sampling=SamplingConfig(temperature, top_k, top_p), seed=seed, eos_id=eos_id,
                            chunk_size=chunk_size, backend=backend, page_size=page_size, mesh=mesh,
                            query_terms=query_terms, qk_promotion=qk_promotion)


def generate_with_stats(model, prompts: Sequence[Sequence[int]], **kwargs) -> GenerationResult:
    """``generate`` returning the GenerationResult (tokens, finished flags, stats)."""
    gen = stream(model, prompts, **{"chunk_size": None, **kwargs})
    for _ in gen:
        pass
    return gen.result


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, kv_cache: str = "fp8",
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | None = None, backend: str = "auto", page_size: int = DEFAULT_PAGE_SIZE,
             mesh: jax.sharding.Mesh | None = None, query_terms: int = 1,
             qk_promotion: int | None = None) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    model: an ``MLAModel`` (its ``prefill``/``decode``/``init_cache``).
    prompts: B lists of token ids (lengths may differ; ids in [0, vocab)).
    kv_cache: "fp8" (SnapMLA's per-token FP8 latent) or "bf16".
    temperature 0 = greedy; else top_k (0 = off) and top_p (1 = off) cut the
    distribution (``snapmla_jax.sampling``). seed: the PRNG seed (same seed,
    same prompts, same batch -> same tokens). eos_id: a row stops after
    producing it (None: every row runs ``max_new_tokens``).
    backend: passed to write_kv/mla_decode ("auto" | "pallas" | "interpret" | "xla").
    query_terms: over the fp8 cache, the decode steps' query as 1 FP8 term (SnapMLA's) or 2 (its
    rounding and what that leaves: more precise answers, up to 14% of an attention call slower;
    ``mla_decode``). The prompts' prefill reads no cache and is the same either way.
    qk_promotion: over the fp8 cache, the features (128, 256 or 512) a float32 sum of the decode
    steps' FP8 Q.K products covers (``mla_decode``'s; None: each kernel's own). 128 where a
    model has more than 32 query rows a step (32 heads x s_q 1 and up) costs the attention up
    to 25% and halves FP8's cost in answer bits measured at 64k.
    mesh: None (one device), or a 1-D ``jax.sharding.Mesh``: data-parallel attention with
    the routed experts split over its devices (module docstring; ``snapmla_jax.data_parallel``).
    The model is placed on it (a copy; a model loaded with ``sharding=expert_sharding(mesh)``
    is already there). Its devices must divide the routed experts.

    Returns B lists of new token ids, EOS excluded. The decode loop runs as
    one compiled ``lax.while_loop`` (no per-token host round trip).
    Raises ValueError naming the argument for bad values, and when a prompt
    plus ``max_new_tokens`` exceeds the model's ``max_position_embeddings``;
    BatchTooLarge (a ValueError) when the KV cache would not fit in memory.
    """
    return generate_with_stats(model, prompts, max_new_tokens=max_new_tokens, kv_cache=kv_cache,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id,
                               backend=backend, page_size=page_size, mesh=mesh, query_terms=query_terms,
                               qk_promotion=qk_promotion).tokens


# ---------------------------------------------------------------- command line

DEFAULT_MODEL_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "demo_model"
PARAM_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


PROG = "snapmla_jax.generate"
# Library argument names -> the flags that set them, for errors raised below the command line.
FLAGS = {"max_new_tokens": "--max-new-tokens", "kv_cache": "--kv-cache", "temperature": "--temperature",
         "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed", "eos_id": "--eos-id", "chunk_size": "--chunk-size",
         "backend": "--backend", "ckpt_dir": "--model", "hf_dir": "--model", "mesh": "--devices",
         "query_terms": "--query-terms", "qk_promotion": "--qk-promotion", "fp8_min_elements": "--fp8-min-elements"}


def _parser() -> cli.Parser:
    parser = cli.Parser(prog="python -m snapmla_jax.generate",
                        description="Generate text with an MLA model over the FP8 (or BF16) latent cache.")
    parser.add_argument("--model", help="orbax checkpoint (snapmla_jax.convert) or Hugging Face directory "
                                        f"(default: the bundled demo model, {DEFAULT_MODEL_DIR})")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--batch-file", help="a UTF-8 file with one prompt per line, generated as one batch")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument("--kv-cache", choices=CACHE_DTYPES, default="fp8", help="latent cache format (default fp8)")
    parser.add_argument("--query-terms", type=int, choices=QUERY_TERMS, default=1,
                        help="FP8 terms of the decode steps' query over the fp8 cache: 1 (SnapMLA's, default) or 2 "
                             "(its rounding and what that leaves: closer to the BF16 cache's answers, attention up to "
                             "14%% slower)")
    parser.add_argument("--qk-promotion", type=int, choices=QK_PROMOTIONS, default=None,
                        help="features a float32 sum of the decode steps' FP8 Q.K products covers over the fp8 "
                             "cache (default: each kernel's own, 512 above 32 query rows a step, else 128); 128 "
                             "costs attention above 32 query rows up to 25%%")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    parser.add_argument("--eos-id", type=int, default=None,
                        help="token that ends a row (default: the tokenizer's EOS; -1: none)")
    parser.add_argument("--tokenizer", help="directory holding the tokenizer (default: --model)")
    parser.add_argument("--dtype", choices=sorted(PARAM_DTYPES), default=None,
                        help="parameter dtype (default: the checkpoint's; bfloat16 for Hugging Face weights)")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="linear kernels and routed experts in block FP8 (about half their bf16 bytes): those "
                             "the checkpoint holds in FP8 kept as stored, the others quantized per 128 x 128 block "
                             "as the model loads")
    cli.add_fp8_min_elements(parser, "; a converted checkpoint's FP8 weights stay as saved")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="kernel backend for write_kv/mla_decode (default auto)")
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--devices", type=int, default=None,
                           help="serve over the first N devices: each holds the caches and runs the attention of "
                                "its share of the prompts, the MoE experts are split over them (data-parallel "
                                "attention + expert parallelism; N must divide the expert count; default 1)")
    placement.add_argument("--shard-experts", action="store_true",
                           help="split the MoE expert weights over all devices, replicate the rest, and run the "
                                "whole batch's attention on every device (for models larger than one device; "
                                "--devices N is faster where the cache fits N ways)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help=f"decode steps between streamed outputs (default {DEFAULT_CHUNK_SIZE})")
    parser.add_argument("--no-stream", action="store_true", help="print the text once generation has finished")
    parser.add_argument("--json", action="store_true", help="print one JSON object (texts, tokens, stats) instead")
    return parser


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        if not args.prompt:
            raise cli.UsageError("--prompt: the prompt is empty")
        return [args.prompt]
    if args.batch_file is None:
        raise cli.UsageError("one of --prompt or --batch-file is required")
    try:
        lines = pathlib.Path(args.batch_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise cli.UsageError(f"--batch-file: cannot read {args.batch_file} ({err})") from err
    if not lines:
        raise cli.UsageError(f"--batch-file: {args.batch_file} holds no prompt")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            raise cli.UsageError(f"--batch-file: line {number} of {args.batch_file} is an empty prompt")
    return lines


def _model_dir(args) -> pathlib.Path:
    """--model (default: the bundled demo model), checked to be a model directory of a kind
    ``_load_model`` reads, before the tokenizer is looked for."""
    if args.model is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise cli.UsageError(f"--model: not given, and the bundled demo model is not installed at "
                              f"{DEFAULT_MODEL_DIR}; pass --model DIR")
        return DEFAULT_MODEL_DIR
    path = pathlib.Path(args.model)
    if not path.is_dir():
        raise cli.UsageError(f"--model: {path} is not a directory")
    if not ((path / "state").is_dir() or any(path.glob("*.safetensors"))):
        raise cli.UsageError(f"--model: {path} is neither a snapmla-jax checkpoint (no state/) nor a Hugging Face "
                          "directory (no *.safetensors)")
    return path


def _load_tokenizer(args, model_dir: pathlib.Path):
    from snapmla_jax.tokenizer import TokenizerNotFound, load_tokenizer

    try:
        return load_tokenizer(args.tokenizer or model_dir)
    except TokenizerNotFound as err:
        if args.tokenizer:
            raise cli.UsageError(f"--tokenizer: {err}") from err
        raise cli.UsageError(f"--model: {model_dir} holds no tokenizer (tokenizer.json, or a tokenizer_config.json "
                          "declaring a byte-level one); pass --tokenizer DIR") from err
    except ValueError as err:  # a malformed tokenizer file
        raise cli.UsageError(f"{'--tokenizer' if args.tokenizer else '--model'}: {err}") from err


def _load_model(model_dir: pathlib.Path, dtype_name: str | None, shard_experts: bool = False,
                mesh: jax.sharding.Mesh | None = None, fp8_weights: bool = False, fp8_min_elements: int = 0):
    """An orbax checkpoint (``<dir>/state`` beside config.json) or a Hugging Face
    directory (config.json + safetensors); ``shard_experts``: the expert weights split
    over all devices, the rest replicated (``expert_sharding``); ``mesh``: the same over
    its devices, loaded straight there (``--devices``); ``fp8_weights``: every weight that
    can be block FP8 made so (``--fp8-weights``), but those of fewer than ``fp8_min_elements``
    (``--fp8-min-elements``)."""
    from snapmla_jax.models import (expert_sharding, load_checkpoint, load_hf_checkpoint, quantize_weights,
                                    shard_model)
    from snapmla_jax.models.sharding import PlacementError

    dtype = PARAM_DTYPES[dtype_name] if dtype_name else None
    sharding = expert_sharding(mesh, mesh.axis_names[0]) if mesh is not None else (
        expert_sharding() if shard_experts else None)
    try:
        if (model_dir / "state").is_dir():
            model = load_checkpoint(model_dir, dtype=dtype, sharding=sharding)
            if fp8_weights:  # a converted checkpoint's FP8 weights stay as saved; the rest are quantized here
                model = quantize_weights(model, model.cfg.weight_block_size, min_elements=fp8_min_elements)
                model = shard_model(model, sharding) if sharding is not None else model
            return model
        return load_hf_checkpoint(model_dir, dtype=dtype or jnp.bfloat16, progress=False, sharding=sharding,
                                  fp8_weights=fp8_weights, quantize_fp8_weights=fp8_weights,
                                  fp8_min_elements=fp8_min_elements)
    except PlacementError as err:  # the placement --shard-experts / --devices asked for, not the checkpoint
        flag = f"--devices: {mesh.size} devices" if mesh is not None else f"--shard-experts: {jax.device_count()} devices"
        raise cli.UsageError(f"{flag}: {err}") from err
    except ValueError as err:  # what the directory holds: config, weights
        raise cli.flag_error(err, FLAGS, default=f"--model: {model_dir}") from err


def _prompt_name(args, number: int) -> str:
    """How a message names prompt ``number`` (from 1): by its flag, and its line in --batch-file."""
    if args.batch_file is None:
        return "--prompt: the prompt"
    return f"--batch-file: prompt {number} (line {number} of {args.batch_file})"


def _check_prompts(args, prompts: list[list[int]], model) -> None:
    """UsageError naming the prompt (counted from 1, as the lines of --batch-file) that is
    empty, holds ids the model does not have, or leaves no room for --max-new-tokens, and
    for an --eos-id outside the vocabulary."""
    vocab, context = model.cfg.vocab_size, model.cfg.max_position_embeddings
    for number, ids in enumerate(prompts, 1):
        name = _prompt_name(args, number)
        if not ids:
            raise cli.UsageError(f"{name} encodes to no tokens")
        if max(ids) >= vocab:
            raise cli.UsageError(f"{name} encodes to token id {max(ids)}, outside the model's vocabulary of {vocab}: "
                              "the tokenizer (--tokenizer) is not the model's")
        if len(ids) >= context:
            raise cli.UsageError(f"{name} has {len(ids)} tokens, not fewer than the model's context of {context}")
        if len(ids) + args.max_new_tokens > context:
            _, _, which = name.partition(": ")
            raise cli.UsageError(f"--max-new-tokens: {which} has {len(ids)} tokens; {args.max_new_tokens} new ones "
                              f"would pass the model's context of {context} tokens (at most {context - len(ids)})")
    if args.eos_id is not None and args.eos_id != -1 and not 0 <= args.eos_id < vocab:
        raise cli.UsageError(f"--eos-id: expected -1 (none) or a token id in [0, {vocab}), got {args.eos_id}")


def _too_large(err: BatchTooLarge, args, count: int) -> cli.UsageError:
    """BatchTooLarge in the command line's terms: the flag that sets the batch, and what fits."""
    if count == 1:
        source, what = "--max-new-tokens", "the prompt"
        fits = (f"--max-new-tokens {err.fit_new_tokens} would fit" if err.fit_new_tokens
                else "not even the prompt alone fits")
    else:
        source, what = "--batch-file", f"{count} prompts"
        parts = ([f"the first {err.fit_prompts} prompts"] if err.fit_prompts else []) + (
            [f"all {count} with --max-new-tokens {err.fit_new_tokens}"] if err.fit_new_tokens else [])
        fits = " or ".join(parts) + " would fit" if parts else "not even the first prompt fits"
    devices = args.devices or 1
    where = f" on one of the {devices} devices (each holds its share of the prompts)" if devices > 1 else ""
    return cli.UsageError(f"{source}: {what} with --max-new-tokens {args.max_new_tokens} need "
                          f"{err.needed_bytes / GIB:.2f} GiB of {args.kv_cache} KV cache{where}, more than {err.budget}; "
                          f"{fits}")


def _finite_or_none(value: float) -> float | None:
    return value if np.isfinite(value) else None


def _stats_line(stats: GenerationStats) -> str:
    return (f"prefill: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_s:.1f} tokens/s | "
            f"decode: {stats.decode_tokens} tokens, {stats.decode_tokens_per_s:.1f} tokens/s | "
            f"KV cache ({stats.kv_cache}): {stats.cache_bytes} bytes | compile: {stats.compile_seconds:.1f} s")


class _TextStream:
    """Prints one row's text as its tokens arrive, holding back an unfinished UTF-8 sequence."""

    def __init__(self, tokenizer, eos_id: int | None, out):
        self.tokenizer, self.eos_id, self.out = tokenizer, eos_id, out
        self.tokens: list[int] = []
        self.printed = ""

    def add(self, chunk: np.ndarray, final: bool = False) -> None:
        self.tokens += chunk.tolist()
        tokens = self.tokens
        if self.eos_id is not None and self.eos_id in tokens:
            tokens = tokens[:tokens.index(self.eos_id)]
        text = self.tokenizer.decode(tokens)
        if not final:
            text = text.rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def _generate_cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cli.check_positive(args, "max_new_tokens", "chunk_size")
    cli.check_fp8_min_elements(args)
    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise cli.flag_error(err, FLAGS) from err
    cli.backend(args.backend)
    texts = _read_prompts(args)
    model_dir = _model_dir(args)
    tokenizer = _load_tokenizer(args, model_dir)
    prompts = [tokenizer.encode(text) for text in texts]
    devices = 1 if args.devices is None else args.devices
    if not 1 <= devices <= jax.device_count():
        raise cli.UsageError(f"--devices: expected 1 to {jax.device_count()} (the devices JAX sees), got {devices}")
    mesh = data_parallel.mesh_of(devices) if devices > 1 else None
    model = _load_model(model_dir, args.dtype, args.shard_experts, mesh, args.fp8_weights, args.fp8_min_elements)
    _check_prompts(args, prompts, model)
    eos_id = tokenizer.eos_id if args.eos_id is None else (None if args.eos_id == -1 else args.eos_id)
    try:
        gen = GenerationStream(model, prompts, max_new_tokens=args.max_new_tokens, kv_cache=args.kv_cache,
                               sampling=sampling, seed=args.seed, eos_id=eos_id, chunk_size=args.chunk_size,
                               backend=args.backend, mesh=mesh, query_terms=args.query_terms,
                               qk_promotion=args.qk_promotion)
    except BatchTooLarge as err:
        raise _too_large(err, args, len(prompts)) from err
    except ValueError as err:
        raise cli.flag_error(err, FLAGS) from err

    streaming = len(prompts) == 1 and not (args.json or args.no_stream)
    text_stream = _TextStream(tokenizer, eos_id, sys.stdout) if streaming else None
    for chunk in gen:
        if text_stream:
            text_stream.add(chunk[0])
    result = gen.result
    completions = [tokenizer.decode(tokens) for tokens in result.tokens]
    if args.json:
        from snapmla_jax.models.checkpoint import fp8_kernel_record
        from snapmla_jax.models.transformer import param_bytes

        stats = result.stats
        print(json.dumps({
            "model": str(model_dir), "kv_cache": args.kv_cache, "eos_id": eos_id,
            "fp8_weights": (fp8_kernel_record(model) or {"kernels": []})["kernels"],
            "weight_bytes": param_bytes(model),
            "devices": len({device for leaf in jax.tree.leaves(nnx.state(model)) for device in leaf.sharding.device_set}),
            "sampling": dataclasses.asdict(sampling), "seed": args.seed,
            "completions": [{"prompt": text, "prompt_tokens": len(ids), "text": completion, "tokens": tokens,
                             "finish_reason": "eos" if done else "length"}
                            for text, ids, completion, tokens, done
                            in zip(texts, prompts, completions, result.tokens, result.finished)],
            "stats": {"prefill_tokens": stats.prompt_tokens,
                      "prefill_tokens_per_s": _finite_or_none(stats.prefill_tokens_per_s),
                      "decode_tokens": stats.decode_tokens,
                      "decode_tokens_per_s": _finite_or_none(stats.decode_tokens_per_s),
                      "generated_tokens": stats.generated_tokens, "kv_cache_bytes": stats.cache_bytes,
                      "prefill_seconds": stats.prefill_seconds, "decode_seconds": stats.decode_seconds,
                      "compile_seconds": stats.compile_seconds},
        }, ensure_ascii=False))
        return 0
    if text_stream:
        text_stream.add(np.zeros(0, np.int32), final=True)
        print()
    elif len(completions) == 1:
        print(completions[0])
    else:
        for number, completion in enumerate(completions, 1):
            print(f"--- {number} ---")
            print(completion)
    print(_stats_line(result.stats))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad flags or input, or out of memory)."""
    return cli.run(PROG, _generate_cli, argv, out_of_memory_hint="try fewer prompts or a smaller --max-new-tokens")


class _CallableModule(types.ModuleType):
    """This module, callable as its function ``generate``.

    The package exports the module itself as ``snapmla_jax.generate``, so that
    ``snapmla_jax.generate.stream`` and ``import snapmla_jax.generate as m`` reach the
    module (a function of the same name would hide it), while
    ``snapmla_jax.generate(model, prompts, ...)`` still calls ``generate``.
    """

    def __call__(self, *args, **kwargs) -> list[list[int]]:
        return generate(*args, **kwargs)


__signature__ = inspect.signature(generate)  # what inspect.signature shows for the callable module

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
