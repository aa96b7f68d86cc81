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

Command line: ``python -m snapmla_jax.generate --model DIR --prompt TEXT``
(see ``main``; docs/generation.md has the details).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import pathlib
import sys
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax.backend import BACKENDS, resolve_backend
from snapmla_jax.cache import CACHE_DTYPES
from snapmla_jax.paging import allocate_pages
from snapmla_jax.sampling import SamplingConfig, sample

DEFAULT_PAGE_SIZE = 64
# Prompts are right-padded to a power of two (at least this) so that prompts of
# similar length share one compiled prefill.
MIN_PROMPT_BUCKET = 16
DEFAULT_CHUNK_SIZE = 8  # decode steps between two streamed outputs
MAX_COMPILED = 16  # compiled programs kept for reuse (each holds device code)


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


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "backend"), donate_argnames=("caches",))
def _prefill(params, caches, input_ids, lengths, block_table, key, *, graphdef, sampling, backend):
    """Fill the cache from the prompts and draw each row's first new token ([B] int32)."""
    model = nnx.merge(graphdef, params)
    last, caches = model.prefill(input_ids, lengths, caches, block_table, backend=backend, last_only=True)
    return sample(last, jax.random.fold_in(key, 0), sampling), caches


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "eos_id", "backend"),
                   donate_argnames=("state",))
def decode_chunk(params, state: DecodeState, lengths, block_table, key, stop_step, *, graphdef, sampling, eos_id,
                 backend) -> DecodeState:
    """The compiled decode loop: steps until ``state.step == min(stop_step, max_new_tokens)``
    or every row is finished. ``params``/``graphdef``: ``nnx.split(model)``; lengths [B]
    int32 prompt lengths; block_table [B, max_pages] int32; key: the sampling key;
    stop_step [] int32. ``state`` is donated (the caches are updated in place)."""
    model = nnx.merge(graphdef, params)
    stop_step = jnp.minimum(stop_step, state.tokens.shape[1])

    def running(s: DecodeState):
        return (s.step < stop_step) & ~jnp.all(s.finished)

    def step(s: DecodeState) -> DecodeState:
        last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
        # The cache holds the prompt and the s.step - 1 tokens fed before: with
        # this one, lengths + s.step.
        logits, caches = model.decode(last, s.caches, block_table, lengths + s.step, backend=backend)
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
            raise ValueError(f"prompts: expected row {i} to be a non-empty list of ints, got {prompt!r:.80}")
        if (row < 0).any() or (row >= vocab_size).any():
            raise ValueError(f"prompts: row {i} holds ids outside [0, {vocab_size}) (the model's vocabulary)")
        rows.append([int(t) for t in row])
    return rows


def _prompt_bucket(max_len: int) -> int:
    return max(MIN_PROMPT_BUCKET, 1 << (max_len - 1).bit_length())


class GenerationStream:
    """Iterating yields each decode chunk's new tokens as a [B, n] int32 numpy array
    (rows that have finished repeat ``eos_id``); afterwards ``result`` holds the
    GenerationResult. Build it with ``stream`` (same arguments as ``generate``)."""

    def __init__(self, model, prompts, *, max_new_tokens: int, kv_cache: str = "fp8",
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0, eos_id: int | None = None,
                 chunk_size: int | None = DEFAULT_CHUNK_SIZE, backend: str = "auto",
                 page_size: int = DEFAULT_PAGE_SIZE):
        cfg = getattr(model, "cfg", None)
        if cfg is None or not hasattr(model, "decode"):
            raise ValueError(f"model: expected an MLAModel, got {type(model).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if kv_cache not in CACHE_DTYPES:
            raise ValueError(f"kv_cache: expected one of {CACHE_DTYPES}, got {kv_cache!r}")
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
            raise ValueError(f"max_new_tokens: prompt {row} has {lengths[row]} tokens; with {max_new_tokens} new "
                             f"ones it exceeds the model's context of {context} tokens")
        resolve_backend(backend)  # a bad name fails here, not at the first trace
        self.pages = allocate_pages(lengths, max_new_tokens, page_size=page_size)
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.kv_cache = kv_cache
        self.sampling = sampling
        self.seed = seed
        self.eos_id = eos_id
        self.chunk_size = chunk_size or max_new_tokens
        self.backend = backend
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[np.ndarray]:
        batch, lengths = len(self.prompts), np.array([len(p) for p in self.prompts], np.int32)
        input_ids = np.zeros((batch, _prompt_bucket(int(lengths.max()))), np.int32)
        for row, prompt in enumerate(self.prompts):
            input_ids[row, :len(prompt)] = prompt
        pages = self.pages
        graphdef, params = nnx.split(self.model)
        caches = self.model.init_cache(pages.num_pages, pages.page_size, kv_cache=self.kv_cache)
        cache_bytes = sum(c.nbytes for c in caches)
        lengths_dev, block_table = jnp.asarray(lengths), jnp.asarray(pages.block_table)
        key = jax.random.key(self.seed)

        args = (params, caches, jnp.asarray(input_ids), lengths_dev, block_table, key)
        static = dict(graphdef=graphdef, sampling=self.sampling, backend=self.backend)
        prefill, compile_s = _compiled(_prefill, static, args)
        start = time.perf_counter()
        first, caches = prefill(*args)
        first = np.asarray(first)
        prefill_s = time.perf_counter() - start
        tokens = np.zeros((batch, self.max_new_tokens), np.int32)
        tokens[:, 0] = first
        finished = np.zeros(batch, bool) if self.eos_id is None else first == self.eos_id
        yield first[:, None]

        state = DecodeState(caches=caches, tokens=jnp.asarray(tokens), step=jnp.asarray(1, jnp.int32),
                            finished=jnp.asarray(finished))
        static = dict(graphdef=graphdef, sampling=self.sampling, eos_id=self.eos_id, backend=self.backend)
        decode_s, step = 0.0, 1
        while step < self.max_new_tokens and not finished.all():
            args = (params, state, lengths_dev, block_table, key, jnp.asarray(step + self.chunk_size, jnp.int32))
            decode, seconds = _compiled(decode_chunk, static, args)
            compile_s += seconds
            start = time.perf_counter()
            state = decode(*args)
            new_step = int(state.step)
            tokens = np.asarray(state.tokens)
            finished = np.asarray(state.finished)
            decode_s += time.perf_counter() - start
            yield tokens[:, step:new_step]
            step = new_step

        out, done = [], []
        for row in tokens[:, :step]:
            stop = np.flatnonzero(row == self.eos_id) if self.eos_id is not None else []
            out.append(row[:stop[0]].tolist() if len(stop) else row.tolist())
            done.append(bool(len(stop)))
        generated = sum(len(r) for r in out)
        self.result = GenerationResult(tokens=out, finished=done, stats=GenerationStats(
            prompt_tokens=int(lengths.sum()), generated_tokens=generated,
            decode_tokens=generated - sum(1 for r in out if r), prefill_seconds=prefill_s,
            decode_seconds=decode_s, compile_seconds=compile_s, cache_bytes=cache_bytes, kv_cache=self.kv_cache))


def stream(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, kv_cache: str = "fp8",
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
           chunk_size: int = DEFAULT_CHUNK_SIZE, backend: str = "auto",
           page_size: int = DEFAULT_PAGE_SIZE) -> GenerationStream:
    """Like ``generate``, but an iterable of token chunks (see GenerationStream);
    ``chunk_size`` decode steps run between two chunks."""
    return GenerationStream(model, prompts, max_new_tokens=max_new_tokens, kv_cache=kv_cache,
                            sampling=SamplingConfig(temperature, top_k, top_p), seed=seed, eos_id=eos_id,
                            chunk_size=chunk_size, backend=backend, page_size=page_size)


def generate_with_stats(model, prompts: Sequence[Sequence[int]], **kwargs) -> GenerationResult:
    """``generate`` returning the GenerationResult (tokens, finished flags, stats)."""
    gen = stream(model, prompts, **{"chunk_size": None, **kwargs})
    for _ in gen:
        pass
    return gen.result


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, kv_cache: str = "fp8",
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | None = None, backend: str = "auto", page_size: int = DEFAULT_PAGE_SIZE) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    model: an ``MLAModel`` (its ``prefill``/``decode``/``init_cache``).
    prompts: B lists of token ids (lengths may differ; ids in [0, vocab)).
    kv_cache: "fp8" (SnapMLA's per-token FP8 latent) or "bf16".
    temperature 0 = greedy; else top_k (0 = off) and top_p (1 = off) cut the
    distribution (``snapmla_jax.sampling``). seed: the PRNG seed (same seed,
    same prompts, same batch -> same tokens). eos_id: a row stops after
    producing it (None: every row runs ``max_new_tokens``).
    backend: passed to write_kv/mla_decode ("auto" | "pallas" | "interpret" | "xla").

    Returns B lists of new token ids, EOS excluded. The decode loop runs as
    one compiled ``lax.while_loop`` (no per-token host round trip).
    Raises ValueError naming the argument for bad values, and when a prompt
    plus ``max_new_tokens`` exceeds the model's ``max_position_embeddings``.
    """
    return generate_with_stats(model, prompts, max_new_tokens=max_new_tokens, kv_cache=kv_cache,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id,
                               backend=backend, page_size=page_size).tokens


# ---------------------------------------------------------------- command line

DEFAULT_MODEL_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "demo_model"
PARAM_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class _UsageError(Exception):
    """A bad command line or input: main() prints it on one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m snapmla_jax.generate",
                     description="Generate text with an MLA model over the FP8 (or BF16) latent cache.")
    parser.add_argument("--model", help="orbax checkpoint (snapmla_jax.convert) or Hugging Face directory "
                                        f"(default: the bundled demo model, {DEFAULT_MODEL_DIR})")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--batch-file", help="a UTF-8 file with one prompt per line, generated as one batch")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument("--kv-cache", choices=CACHE_DTYPES, default="fp8", help="latent cache format (default fp8)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    parser.add_argument("--eos-id", type=int, default=None,
                        help="token that ends a row (default: the tokenizer's EOS; -1: none)")
    parser.add_argument("--tokenizer", help="directory holding the tokenizer (default: --model)")
    parser.add_argument("--dtype", choices=sorted(PARAM_DTYPES), default=None,
                        help="parameter dtype (default: the checkpoint's; bfloat16 for Hugging Face weights)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="kernel backend for write_kv/mla_decode (default auto)")
    parser.add_argument("--shard-experts", action="store_true",
                        help="split the MoE expert weights over all devices, replicate the rest "
                             "(for models larger than one device; the expert count must divide evenly)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help=f"decode steps between streamed outputs (default {DEFAULT_CHUNK_SIZE})")
    parser.add_argument("--no-stream", action="store_true", help="print the text once generation has finished")
    parser.add_argument("--json", action="store_true", help="print one JSON object (texts, tokens, stats) instead")
    return parser


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        if not args.prompt:
            raise _UsageError("--prompt: the prompt is empty")
        return [args.prompt]
    if args.batch_file is None:
        raise _UsageError("one of --prompt or --batch-file is required")
    try:
        lines = pathlib.Path(args.batch_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise _UsageError(f"--batch-file: cannot read {args.batch_file} ({err})") from err
    if not lines:
        raise _UsageError(f"--batch-file: {args.batch_file} holds no prompt")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            raise _UsageError(f"--batch-file: line {number} of {args.batch_file} is an empty prompt")
    return lines


def _model_dir(args) -> pathlib.Path:
    if args.model is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise _UsageError(f"--model: not given, and the bundled demo model is not installed at "
                              f"{DEFAULT_MODEL_DIR}; pass --model DIR")
        return DEFAULT_MODEL_DIR
    path = pathlib.Path(args.model)
    if not path.is_dir():
        raise _UsageError(f"--model: {path} is not a directory")
    return path


def _load_model(model_dir: pathlib.Path, dtype_name: str | None, shard_experts: bool = False):
    """An orbax checkpoint (``<dir>/state`` beside config.json) or a Hugging Face
    directory (config.json + safetensors); ``shard_experts``: the expert weights split
    over all devices, the rest replicated (``expert_sharding``)."""
    from snapmla_jax.models import expert_sharding, load_checkpoint, load_hf_checkpoint
    from snapmla_jax.models.sharding import PlacementError

    dtype = PARAM_DTYPES[dtype_name] if dtype_name else None
    sharding = expert_sharding() if shard_experts else None
    try:
        if (model_dir / "state").is_dir():
            return load_checkpoint(model_dir, dtype=dtype, sharding=sharding)
        if any(model_dir.glob("*.safetensors")):
            return load_hf_checkpoint(model_dir, dtype=dtype or jnp.bfloat16, progress=False, sharding=sharding)
    except PlacementError as err:  # the placement --shard-experts asked for, not the checkpoint
        raise _UsageError(f"--shard-experts: {jax.device_count()} devices: {err}") from err
    raise _UsageError(f"--model: {model_dir} is neither an orbax checkpoint (no state/) nor a Hugging Face "
                      "directory (no *.safetensors)")


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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad flags or input)."""
    from snapmla_jax.tokenizer import load_tokenizer

    try:
        args = _parser().parse_args(argv)
    except _UsageError as err:
        print(f"snapmla_jax.generate: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    try:
        if args.max_new_tokens < 1:
            raise _UsageError(f"--max-new-tokens: expected an int >= 1, got {args.max_new_tokens}")
        if args.chunk_size < 1:
            raise _UsageError(f"--chunk-size: expected an int >= 1, got {args.chunk_size}")
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        texts = _read_prompts(args)
        model_dir = _model_dir(args)
        tokenizer = load_tokenizer(args.tokenizer or model_dir)
        prompts = [tokenizer.encode(text) for text in texts]
        model = _load_model(model_dir, args.dtype, args.shard_experts)
        context = model.cfg.max_position_embeddings
        for number, ids in enumerate(prompts, 1):
            if not ids:
                raise _UsageError(f"prompt {number}: encodes to no tokens")
            if len(ids) >= context:
                raise _UsageError(f"prompt {number}: {len(ids)} tokens, longer than the model's context of "
                                  f"{context} tokens")
        eos_id = tokenizer.eos_id if args.eos_id is None else (None if args.eos_id == -1 else args.eos_id)
        gen = GenerationStream(model, prompts, max_new_tokens=args.max_new_tokens, kv_cache=args.kv_cache,
                               sampling=sampling, seed=args.seed, eos_id=eos_id, chunk_size=args.chunk_size,
                               backend=args.backend)
    except (_UsageError, ValueError, OSError) as err:
        print(f"snapmla_jax.generate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2

    streaming = len(prompts) == 1 and not (args.json or args.no_stream)
    text_stream = _TextStream(tokenizer, eos_id, sys.stdout) if streaming else None
    for chunk in gen:
        if text_stream:
            text_stream.add(chunk[0])
    result = gen.result
    completions = [tokenizer.decode(tokens) for tokens in result.tokens]
    if args.json:
        stats = result.stats
        print(json.dumps({
            "model": str(model_dir), "kv_cache": args.kv_cache, "eos_id": eos_id,
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


if __name__ == "__main__":
    sys.exit(main())
