"""Long-context retrieval through the latent cache, per cache quantization scheme.

    python -m snapmla_jax.fidelity_long [--model DIR] [--contexts 4096 16384 ...] [--depths 0 0.5 1]
        [--trials N] [--tasks passkey kv ...] [--schemes bf16 fp8 ...] [--json F] [--markdown F] [--plot F.png]

Each task (``snapmla_jax.long_context_tasks``: a needle planted at a depth of a byte
context, a question at its end) runs through ``model.decode`` in chunks of ``--chunk``
tokens, so every attention read goes through the cache and ``mla_decode``. Two numbers
per (task kind, context, depth, scheme):

* accuracy: the share of tasks whose answer greedy decoding reproduces exactly. It is
  read off the same teacher-forced pass: greedy decoding feeds the model exactly the
  teacher-forced tokens up to its first wrong byte, so it reproduces the answer iff
  every answer byte is the argmax of its position's teacher-forced logits.
* bits per byte of the answer span: mean -log2 p(answer byte | everything before it).

Cache schemes (``CACHE_SCHEMES``):

  bf16                         the BF16 cache
  fp8                          SnapMLA's cache: per-token FP8 latent, BF16 RoPE key
  emulated_per_token_576       RoPE in FP8: one scale per token over [latent, RoPE] (576
                               dims), without RoPE separation
  emulated_per_token_block128  a scale per token and 128-channel latent block, BF16 RoPE

The emulated schemes have no cache format of their own: each layer's new latent and
RoPE key are quantized to FP8 and back (``quant_report``'s schemes, in jnp) before
being written to a BF16 cache, which rounds the dequantized values once more to bf16
(relative 2**-9, against FP8's 2**-4). The per-tensor scheme of ``quant_report`` is
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
import json
import pathlib
import sys
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax import byte_corpus, cli, long_context_tasks
from snapmla_jax.backend import BACKENDS
from snapmla_jax.fidelity import LN2, heldout_files_flag, model_flag, pyplot, save_png
from snapmla_jax.paging import allocate_pages
from snapmla_jax.quant_report import CHANNEL_BLOCK
from snapmla_jax.quantization import fp8_round_trip, per_token_scale

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


def per_token_block128_round_trip(c_kv: jax.Array, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Latent in FP8 with a scale per token and 128-channel block, RoPE untouched: float32 c_kv, k_pe as given."""
    blocks = c_kv.reshape(*c_kv.shape[:-1], -1, CHANNEL_BLOCK)
    return _fake_quant(blocks).reshape(c_kv.shape), k_pe


@dataclasses.dataclass(frozen=True)
class CacheScheme:
    """How a scheme runs: the cache dtype (``LatentCache``) and the transform of (c_kv, k_pe) before writing."""

    cache_dtype: str
    kv_transform: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None


CACHE_SCHEMES = {
    "bf16": CacheScheme("bf16"),
    "fp8": CacheScheme("fp8"),
    "emulated_per_token_576": CacheScheme("bf16", per_token_576_round_trip),
    "emulated_per_token_block128": CacheScheme("bf16", per_token_block128_round_trip),
}


@dataclasses.dataclass(frozen=True)
class RetrievalScore:
    """Scores of a list of tasks under one scheme.

    correct [N] bool: greedy decoding reproduces task i's answer exactly.
    byte_correct [N] float: share of task i's answer bytes that are their position's argmax.
    answer_bits [N] float: mean -log2 p of task i's answer bytes.
    """

    correct: np.ndarray
    byte_correct: np.ndarray
    answer_bits: np.ndarray

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    @property
    def bits_per_byte(self) -> float:
        return float(self.answer_bits.mean())


@nnx.jit(static_argnames=("backend", "kv_transform"))
def _decode_chunk(model, input_ids, caches, block_table, seq_lens, backend, kv_transform):
    logits, caches = model.decode(input_ids, caches, block_table, seq_lens, backend=backend,
                                  kv_transform=kv_transform)
    return jax.nn.log_softmax(logits, axis=-1), caches


def answer_logprobs(model, tokens: np.ndarray, answer_starts: Sequence[int], scheme: str, *, backend: str,
                    chunk: int = 512) -> list[np.ndarray]:
    """Teacher-forced log-probabilities of every row's answer span, through the cache of ``scheme``.

    tokens [B, T] int (rows of one length); answer_starts [B]: row b's answer is
    tokens[b, answer_starts[b]:]. Feeds tokens[:, :T-1] to ``model.decode`` ``chunk`` tokens per
    call (the last call takes the rest) into a fresh cache. Returns per row float32
    [T - answer_starts[b], V]: the log-probabilities predicting each answer byte.
    Raises ValueError for an unknown scheme, a chunk < 1 or an answer start outside [1, T).
    """
    if scheme not in CACHE_SCHEMES:
        raise ValueError(f"scheme: expected one of {tuple(CACHE_SCHEMES)}, got {scheme!r}")
    if chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1, got {chunk}")
    tokens = np.asarray(tokens, np.int32)
    batch, length = tokens.shape
    starts = np.asarray(answer_starts, np.int64)
    if starts.shape != (batch,) or (starts < 1).any() or (starts >= length).any():
        raise ValueError(f"answer_starts: expected {batch} indices in [1, {length}), got {starts.tolist()}")
    spec = CACHE_SCHEMES[scheme]
    fed = length - 1  # the last token predicts nothing that is scored
    pages = allocate_pages([fed] * batch, 0, page_size=PAGE_SIZE)
    block_table = jnp.asarray(pages.block_table)
    caches = model.init_cache(pages.num_pages, PAGE_SIZE, kv_cache=spec.cache_dtype)
    first = int(starts.min()) - 1  # the first position whose output is kept
    kept = []
    for start in range(0, fed, chunk):
        stop = min(start + chunk, fed)
        seq_lens = jnp.full((batch,), stop, jnp.int32)
        logprobs, caches = _decode_chunk(model, jnp.asarray(tokens[:, start:stop]), caches, block_table, seq_lens,
                                         backend, spec.kv_transform)
        if stop > first:
            kept.append(np.asarray(logprobs[:, max(first - start, 0):], np.float32))
    kept = np.concatenate(kept, axis=1)  # positions first .. fed - 1
    return [kept[b, starts[b] - 1 - first:] for b in range(batch)]


def score_answers(logprobs: Sequence[np.ndarray], answers: Sequence[np.ndarray]) -> RetrievalScore:
    """Exact match, per-byte argmax match and bits per byte from per-row answer log-probabilities
    [n_b, V] and answer bytes [n_b] int."""
    correct, byte_correct, bits = [], [], []
    for lp, answer in zip(logprobs, answers, strict=True):
        hits = lp.argmax(-1) == answer
        correct.append(bool(hits.all()))
        byte_correct.append(float(hits.mean()))
        bits.append(float(-lp[np.arange(len(answer)), answer].astype(np.float64).mean() / LN2))
    return RetrievalScore(np.array(correct), np.array(byte_correct), np.array(bits))


def retrieval_accuracy(model, tasks: Sequence[long_context_tasks.Task], scheme: str, *, backend: str,
                       chunk: int = 512, batch_size: int = 8) -> RetrievalScore:
    """Score ``tasks`` (all of one context length) with the cache of ``scheme`` (``CACHE_SCHEMES``):
    ``batch_size`` tasks per decode batch. See RetrievalScore; ValueError for mixed lengths."""
    if not tasks:
        raise ValueError("tasks: expected at least one task")
    if len({t.context for t in tasks}) != 1:
        raise ValueError(f"tasks: expected one context length, got {sorted({t.context for t in tasks})}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size}")
    logprobs = []
    for i in range(0, len(tasks), batch_size):
        group = tasks[i:i + batch_size]
        logprobs += answer_logprobs(model, np.stack([t.tokens for t in group]), [t.answer_start for t in group],
                                    scheme, backend=backend, chunk=chunk)
    return score_answers(logprobs, [t.answer for t in tasks])


def evaluate(model, *, contexts: Sequence[int], depths: Sequence[float], kinds: Sequence[str], trials: int,
             schemes: Sequence[str], text: np.ndarray | None, backend: str, chunk: int, batch_size: int,
             seed: int = 0, log=print) -> list[dict]:
    """One row per (kind, context, depth, scheme): accuracy, per-byte accuracy, answer bits per byte,
    chance, number of tasks. The same tasks are scored under every scheme."""
    rows = []
    for context in contexts:
        for depth in depths:
            tasks = long_context_tasks.make_tasks(kinds, context, depth, trials, seed, text=text)
            for scheme in schemes:
                score = retrieval_accuracy(model, tasks, scheme, backend=backend, chunk=chunk, batch_size=batch_size)
                for kind in kinds:
                    mine = np.array([t.kind == kind for t in tasks])
                    rows.append({"kind": kind, "context": context, "depth": depth, "scheme": scheme,
                                 "accuracy": float(score.correct[mine].mean()),
                                 "byte_accuracy": float(score.byte_correct[mine].mean()),
                                 "answer_bits_per_byte": float(score.answer_bits[mine].mean()),
                                 "chance": float(np.mean([t.chance for t in tasks if t.kind == kind])),
                                 "tasks": int(mine.sum())})
                log(f"context {context} depth {depth} {scheme}: accuracy {score.accuracy:.3f}, "
                    f"answer {score.bits_per_byte:.3f} bits per byte")
    return rows


def trained_context_note(trained_context: int, contexts: Sequence[int]) -> str:
    """The line that says how the contexts compare with what the model was trained on."""
    beyond = [c for c in contexts if c > trained_context]
    note = f"Model trained on windows of {trained_context} tokens (max_position_embeddings)."
    if beyond:
        note += (f" Contexts {beyond} are beyond it: the model never saw those positions, so accuracy near "
                 "chance there is expected and says nothing about the cache.")
    return note


def to_markdown(results: dict) -> str:
    """The rows as one markdown table, under the trained-context note."""
    lines = [results["trained_context_note"], "",
             f"Backend `{results['backend']}`, {results['trials']} tasks per kind and (context, depth); accuracy is "
             "exact match of the greedy answer; byte accuracy the share of answer bytes that are the argmax.", "",
             "| task | context | depth | scheme | accuracy | byte accuracy | answer bits/byte | chance |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['context']} | {r['depth']:g} | {r['scheme']} | {r['accuracy']:.3f} | "
              f"{r['byte_accuracy']:.3f} | {r['answer_bits_per_byte']:.3f} | {r['chance']:.1e} |"
              for r in results["rows"]]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str | pathlib.Path) -> None:
    """PNG: per task kind, accuracy against context (mean over depths) and against depth (mean over
    contexts), one line per scheme; a dotted line marks the trained context."""
    plt = pyplot()
    rows = results["rows"]
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    fig, axes = plt.subplots(2, len(kinds), figsize=(3.2 * len(kinds), 5.5), squeeze=False)
    for col, kind in enumerate(kinds):
        for scheme in schemes:
            mine = [r for r in rows if r["kind"] == kind and r["scheme"] == scheme]
            for ax, key in ((axes[0, col], "context"), (axes[1, col], "depth")):
                xs = sorted({r[key] for r in mine})
                ax.plot(xs, [np.mean([r["accuracy"] for r in mine if r[key] == x]) for x in xs], "o-", label=scheme)
        axes[0, col].set_xscale("log", base=2)
        axes[0, col].axvline(results["trained_context"], color="gray", linestyle=":")
        axes[0, col].set_title(kind, fontsize=9)
        axes[0, col].set_xlabel("context (tokens)")
        axes[1, col].set_xlabel("depth")
        for ax in axes[:, col]:
            ax.set_ylim(-0.05, 1.05)
            ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("accuracy (mean over depths)")
    axes[1, 0].set_ylabel("accuracy (mean over contexts)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"Retrieval through the cache; trained context {results['trained_context']} tokens (dotted)",
                 fontsize=9)
    save_png(fig, path)


def _parser() -> cli.Parser:
    p = cli.Parser(prog="python -m snapmla_jax.fidelity_long", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(LONG_MODEL_DIR),
                   help="train_demo output directory (default: the shipped model trained to retrieve at 16k "
                        "tokens); filler comes from its held-out text")
    p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS), help="context lengths in tokens")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS),
                   help="needle depths, fractions in [0, 1]")
    p.add_argument("--trials", type=int, default=4, help="tasks per kind and (context, depth)")
    p.add_argument("--tasks", nargs="+", choices=long_context_tasks.TASK_KINDS,
                   default=list(long_context_tasks.TASK_KINDS), help="task kinds")
    p.add_argument("--schemes", nargs="+", choices=tuple(CACHE_SCHEMES), default=["bf16", "fp8"],
                   help="cache schemes (emulated_*: FP8 round trip into a BF16 cache)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per decode call")
    p.add_argument("--batch-size", type=int, default=8, help="tasks per decode batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the first trial")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="write_kv/mla_decode backend (default auto)")
    p.add_argument("--json", help="write all rows to this file")
    p.add_argument("--markdown", help="write the table to this file")
    p.add_argument("--plot", help="write accuracy against context and depth to this PNG")
    return p


def _check_args(args) -> None:
    cli.check_positive(args, "trials", "chunk", "batch_size")
    if args.seed < 0:
        raise cli.UsageError(f"--seed: expected an int >= 0, got {args.seed}")
    for depth in args.depths:
        if not 0.0 <= depth <= 1.0:
            raise cli.UsageError(f"--depths: expected fractions in [0, 1], got {depth}")
    for flag in ("json", "markdown", "plot"):
        cli.check_output_file(f"--{flag}", getattr(args, flag))


def _long_context(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _check_args(args)
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
    note = trained_context_note(trained, args.contexts)
    print(note, flush=True)
    rows = evaluate(model, contexts=args.contexts, depths=args.depths, kinds=args.tasks, trials=args.trials,
                    schemes=args.schemes, text=text, backend=backend, chunk=args.chunk, batch_size=args.batch_size,
                    seed=args.seed)
    results = {"trained_context": trained, "trained_context_note": note, "rows": rows, "trials": args.trials,
               "backend": backend, "device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
               "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
               "command": "python -m snapmla_jax.fidelity_long " + " ".join(argv)}
    markdown = to_markdown(results)
    print(markdown)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(markdown)
    if args.plot:
        plot(results, args.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input or out of memory)."""
    return cli.run(PROG, _long_context, argv, out_of_memory_hint="try fewer --contexts, a smaller --batch-size or "
                                                                  "--chunk")


if __name__ == "__main__":
    sys.exit(main())
