"""Train the small byte-level MLA model shipped as the CLI's default.

    python -m snapmla_jax.train_demo --out DIR [--overwrite] [--config demo|tiny] [--steps 4000] [--max-seconds 240]
        [--seq-len N] [--task-fraction F] [--answer-weight W] [--init-from CKPT]

The model is DeepSeek-shaped where SnapMLA cares (kv_lora_rank 512, RoPE head
dim 64, so the real cache layout and kernels run; a first dense layer, then
MoE layers with routed + shared experts) and small everywhere else. It learns
from Python's standard library (``snapmla_jax.byte_corpus``), one token per
byte. Training needs optax (``pip install -e .[train]``).

The learning rate warms up linearly, then follows a cosine to 10% of the peak.
The cosine's progress is ``max(step / steps, elapsed / max_seconds)``: the run
ends at whichever limit it reaches first, with the schedule finished either
way. Parameters train in float32 and are stored in bfloat16.

DIR becomes an orbax checkpoint (``models.save_checkpoint``: config.json and
state/) that ``python -m snapmla_jax.generate --model DIR`` loads, with beside
it the byte-level ``tokenizer_config.json``, the held-out file list
``heldout_files.json`` and ``train_recipe.json`` (flags, steps, seconds,
losses, device). Its config's ``max_position_embeddings`` is ``--seq-len``: the
context the model was trained for, and so the longest generation allowed.

Long-context training (``--task-fraction``, ``--answer-weight``, ``--init-from``):
a share of the windows are retrieval tasks whose answer ends the window, the
answer bytes' losses weighted above the text's, and a run may start from a saved
checkpoint of the same config (a short-window run continued on long windows).

Every flag and ``--out`` are checked before any work: ``--out`` must be new or an
empty directory, or with ``--overwrite`` hold a snapmla-jax checkpoint, which is
replaced only once the new one is complete. Exit code 0 on success, 2 with a one-line
message on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax.models import MLAConfig, MLAModel
from snapmla_jax.models.checkpoint import (CheckpointError, load_checkpoint, staged_checkpoint_dir, target_problem,
                                          write_checkpoint)
from snapmla_jax import byte_corpus, cli, long_context_tasks

PROG = "snapmla_jax.train_demo"
LN2 = math.log(2.0)
FINAL_LR_FRACTION = 0.1  # the cosine ends at 10% of the peak rather than 0: the last steps still learn


def demo_config(max_position_embeddings: int = 512) -> MLAConfig:
    """The shipped model: ~8M parameters, 16 MB in bfloat16; its context is the 512 tokens
    it was trained on (``TrainRecipe.seq_len``).

    Attention dims are DeepSeek's (latent 512, RoPE 64, nope 64) so the cache
    and decode kernels see production shapes; 4 heads keep kv_b_proj (W_UK,
    W_UV: 512 x H x 64 each) from eating the size budget. Layer 0 is dense
    (DeepSeek's first_k_dense_replace); layers 1-3 route top-2 of 8 small
    experts plus one shared expert.
    """
    return MLAConfig(
        vocab_size=byte_corpus.VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        q_lora_rank=None, max_position_embeddings=max_position_embeddings,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=192,
        first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=True)


def tiny_config() -> MLAConfig:
    """A model small enough to train a few steps on a CPU in a test (same structure as the demo)."""
    return dataclasses.replace(
        demo_config(max_position_embeddings=256), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, moe_intermediate_size=16)


CONFIGS = {"demo": demo_config, "tiny": tiny_config}
# The window length a config trains on when --seq-len is not given: the demo's recipe, and
# short windows for the tiny config's CPU runs.
DEFAULT_SEQ_LEN = {"demo": 512, "tiny": 64}


def _field(default, help_text: str, minimum=None, *, above=None, below=None, maximum=None):
    """A TrainRecipe field: its default, its --help text and its allowed range (checked in
    ``TrainRecipe.__post_init__``): ``>= minimum``, ``> above``, ``< below``, ``<= maximum``."""
    return dataclasses.field(default=default, metadata=dict(help=help_text, minimum=minimum, above=above,
                                                            below=below, maximum=maximum))


@dataclasses.dataclass(frozen=True)
class TrainRecipe:
    """Hyperparameters of one run (stored in train_recipe.json).

    Raises ValueError naming the field for a value of the wrong type or outside its range.
    """

    config: str = dataclasses.field(default="demo", metadata=dict(help="model size: demo (the shipped model) or "
                                                                      "tiny (a few-second CPU run)"))
    steps: int = _field(4000, "optimizer steps at most", 1)
    max_seconds: float = _field(240.0, "training time budget in seconds, after compilation", above=0)
    batch_size: int = _field(64, "windows per step", 1)
    seq_len: int = _field(512, "tokens per training window; the saved model's context "
                               "(default: 512 for demo, 64 for tiny)", 1)
    peak_lr: float = _field(2e-3, "learning rate after warmup", above=0)
    warmup_steps: int = _field(200, "steps of linear learning-rate warmup", 0)
    weight_decay: float = _field(0.1, "decoupled weight decay on matrices", 0)
    grad_clip: float = _field(1.0, "global gradient-norm clip", above=0)
    beta2: float = _field(0.95, "Adam's second-moment decay", above=0, below=1)
    steps_per_call: int = _field(50, "optimizer steps per compiled call", 1)
    heldout_fraction: float = _field(byte_corpus.DEFAULT_HELDOUT_FRACTION, "share of stdlib files held out",
                                     above=0, below=1)
    eval_windows: int = _field(256, "held-out windows scored after training", 1)
    seed: int = _field(0, "seed of the initialization and the batches", 0)
    task_fraction: float = _field(0.0, "share of training windows that are long-range retrieval tasks at random "
                                       "depths (passkey, key-value, multi-hop, copy: snapmla_jax.long_context_tasks) "
                                       "instead of plain text", 0, maximum=1)
    answer_weight: float = _field(1.0, "weight of a task answer byte's loss against a text byte's: an answer is the "
                                       "last few bytes of its window, so at 1 a long window's retrieval signal is "
                                       "a few bytes in thousands", 1)

    def __post_init__(self):
        if self.config not in CONFIGS:
            raise ValueError(f"config: expected one of {sorted(CONFIGS)}, got {self.config!r}")
        for field in dataclasses.fields(self):
            if field.name == "config":
                continue
            value, meta = getattr(self, field.name), field.metadata
            kind = int if field.type in (int, "int") else float
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise ValueError(f"{field.name}: expected {'an int' if kind is int else 'a number'}, got {value!r}")
            wrong = ((meta["minimum"] is not None and not value >= meta["minimum"])
                     or (meta["above"] is not None and not value > meta["above"])
                     or (meta["below"] is not None and not value < meta["below"])
                     or (meta["maximum"] is not None and not value <= meta["maximum"]))
            if wrong or not math.isfinite(value):
                bounds = [f">= {meta['minimum']}" if meta["minimum"] is not None else None,
                          f"> {meta['above']}" if meta["above"] is not None else None,
                          f"< {meta['below']}" if meta["below"] is not None else None,
                          f"<= {meta['maximum']}" if meta["maximum"] is not None else None]
                raise ValueError(f"{field.name}: expected a value {' and '.join(b for b in bounds if b)}, "
                                 f"got {value!r}")


def learning_rate(recipe: TrainRecipe, step: int, elapsed_s: float) -> float:
    """Linear warmup over ``warmup_steps``, then a cosine to FINAL_LR_FRACTION of the peak driven by
    ``max(step / steps, elapsed_s / max_seconds)`` (see the module docstring)."""
    if step < recipe.warmup_steps:
        return recipe.peak_lr * (step + 1) / recipe.warmup_steps
    progress = min(1.0, max(step / recipe.steps, elapsed_s / recipe.max_seconds))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return recipe.peak_lr * (FINAL_LR_FRACTION + (1.0 - FINAL_LR_FRACTION) * cosine)


def token_losses(model: MLAModel, windows: jax.Array) -> jax.Array:
    """Next-token cross entropy in nats: windows [B, S+1] int32 -> [B, S] float32."""
    logits = model(windows[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]


def _import_optax():
    try:
        import optax
    except ImportError as err:
        raise cli.UsageError("train_demo needs optax, which is not installed: pip install -e '.[train]'") from err
    return optax


def _make_chunk_fn(graphdef, rest, tx):
    """A jitted function running ``K`` optimizer steps: (params, opt_state, batches [K, B, S+1] int32,
    loss weights [K, B, S] float32, learning rates [K] float32) -> (params, opt_state, losses [K]),
    the losses unweighted means (nats a token). One call per K steps keeps host dispatch off the
    step time; params and opt_state are donated."""
    optax = _import_optax()

    def loss_fn(params, windows, weights):
        losses = token_losses(nnx.merge(graphdef, params, rest), windows)
        return jnp.sum(losses * weights) / jnp.sum(weights), jnp.mean(losses)

    def step(carry, batch):
        params, opt_state = carry
        windows, weights, lr = batch
        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, windows, weights)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        return (params, opt_state), loss

    def run_chunk(params, opt_state, batches, weights, lrs):
        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), (batches, weights, lrs))
        return params, opt_state, losses

    return jax.jit(run_chunk, donate_argnums=(0, 1))


def training_batch(train_stream: np.ndarray, recipe: TrainRecipe, rng: np.random.Generator, *,
                   filler: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One step's windows, int32 [batch_size, seq_len + 1], and their loss weights, float32
    [batch_size, seq_len] (one per predicted token): random windows of ``train_stream``, and with
    ``task_fraction`` > 0 that share of them long-range tasks whose filler is the same text
    (``long_context_tasks.mixed_windows``), so that the model learns to reach back across the
    whole window. A task's answer bytes weigh ``answer_weight``, every other token 1. ``filler``:
    ``long_context_tasks.filler_bytes(train_stream)``, kept across batches by the caller."""
    shape = (recipe.batch_size, recipe.seq_len)
    if recipe.task_fraction == 0:
        windows = byte_corpus.sample_windows(train_stream, recipe.batch_size, recipe.seq_len + 1, rng)
        return windows, np.ones(shape, np.float32)
    batch = long_context_tasks.mixed_windows(train_stream, recipe.batch_size, recipe.seq_len + 1,
                                             int(rng.integers(2**31)), task_fraction=recipe.task_fraction,
                                             filler=filler)
    # Loss position t predicts token t + 1: a row's answer tokens [a, seq_len] are positions >= a - 1.
    predicts_answer = np.arange(recipe.seq_len)[None, :] >= batch.answer_starts[:, None] - 1
    return batch.tokens, np.where(predicts_answer, recipe.answer_weight, 1.0).astype(np.float32)


def train(cfg: MLAConfig, train_stream: np.ndarray, recipe: TrainRecipe, *, log=print,
          init: MLAModel | None = None) -> tuple[MLAModel, dict]:
    """Train a float32 MLAModel on random windows of ``train_stream`` (int32 [N]), from ``init``'s
    parameters (a model of ``cfg``'s shapes, any dtype) or a fresh initialization.

    Returns (model, history) where history holds per-chunk ``steps``,
    ``loss`` (mean nats per token of the chunk), ``lr`` and ``seconds``, and
    ``compile_seconds``.
    """
    # The model reads the first seq_len tokens of each window (positions 0..seq_len-1).
    if recipe.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len: expected <= max_position_embeddings = {cfg.max_position_embeddings}, "
                         f"got {recipe.seq_len}")
    optax = _import_optax()
    model = MLAModel(cfg, rngs=nnx.Rngs(recipe.seed), dtype=jnp.float32)
    if init is not None:
        nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.float32), nnx.state(init, nnx.Param)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)  # no weight decay on norm scales
    tx = optax.chain(optax.clip_by_global_norm(recipe.grad_clip),
                     optax.scale_by_adam(b2=recipe.beta2),
                     optax.add_decayed_weights(recipe.weight_decay, mask=decay_mask))
    opt_state = tx.init(params)
    run_chunk = _make_chunk_fn(graphdef, rest, tx)
    rng = np.random.default_rng(recipe.seed)
    filler = long_context_tasks.filler_bytes(train_stream) if recipe.task_fraction > 0 else None

    def next_batches(k):
        return tuple(np.stack(parts) for parts in zip(*(training_batch(train_stream, recipe, rng, filler=filler)
                                                        for _ in range(k))))

    history = {"steps": [], "loss": [], "lr": [], "seconds": [], "compile_seconds": 0.0}
    step, start = 0, None
    k = min(recipe.steps_per_call, recipe.steps)
    batches, weights = next_batches(k)
    while step < recipe.steps:
        elapsed = 0.0 if start is None else time.perf_counter() - start
        if start is not None and elapsed >= recipe.max_seconds:
            break
        lrs = np.array([learning_rate(recipe, step + i, elapsed) for i in range(k)], np.float32)
        t0 = time.perf_counter()
        params, opt_state, losses = run_chunk(params, opt_state, jnp.asarray(batches), jnp.asarray(weights),
                                              jnp.asarray(lrs))
        # The next chunk's windows are made while the device runs this one (dispatch is asynchronous).
        k_next = min(recipe.steps_per_call, recipe.steps - step - k)
        if k_next > 0:
            batches, weights = next_batches(k_next)
        losses = np.asarray(losses)  # waits for the chunk
        if start is None:  # the first chunk includes compilation; the time budget starts after it
            history["compile_seconds"] = time.perf_counter() - t0
            start = time.perf_counter()
        step += k
        k = k_next
        history["steps"].append(step)
        history["loss"].append(float(losses.mean()))
        history["lr"].append(float(lrs[-1]))
        history["seconds"].append(time.perf_counter() - start)
        if not np.isfinite(losses).all():
            raise FloatingPointError(f"training diverged at step {step}: loss {losses}")
        log(f"step {step:6d}  loss {losses.mean():.4f} nats/byte ({losses.mean() / LN2:.3f} bits)  "
            f"lr {lrs[-1]:.2e}  {history['seconds'][-1]:.1f}s")
    nnx.update(model, params)
    return model, history


def heldout_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens from the start of ``stream``: int32 [W, seq_len + 1],
    W = min(max_windows, how many fit). Consecutive windows share one token (the last target of one is
    the first input of the next), so every token after the first is scored once."""
    count = min(max_windows, (stream.shape[0] - 1) // seq_len)
    if count < 1:
        raise ValueError(f"stream: expected at least seq_len + 1 = {seq_len + 1} tokens, got {stream.shape[0]}")
    starts = np.arange(count) * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)


def bits_per_byte(model: MLAModel, windows: np.ndarray, batch_size: int = 16) -> float:
    """Mean next-token loss in bits over targets that are bytes (a file's BOS and EOS are not bytes).

    windows [W, S+1] int32 -> float. Every window starts from an empty context.
    """
    loss_fn = nnx.jit(token_losses)
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        chunk = windows[i:i + batch_size]
        losses = np.asarray(loss_fn(model, jnp.asarray(chunk)), np.float64)
        is_byte = chunk[:, 1:] < byte_corpus.NUM_BYTES
        total += float(losses[is_byte].sum())
        count += int(is_byte.sum())
    return total / count / LN2


def unigram_bits_per_byte(train_stream: np.ndarray, heldout_stream: np.ndarray) -> float:
    """Held-out bits per byte of the add-one-smoothed byte frequencies of the training stream: the
    floor a model must beat to have learned anything beyond byte frequencies."""
    train_bytes = train_stream[train_stream < byte_corpus.NUM_BYTES]
    held_bytes = heldout_stream[heldout_stream < byte_corpus.NUM_BYTES]
    counts = np.bincount(train_bytes, minlength=byte_corpus.NUM_BYTES).astype(np.float64) + 1.0
    log2p = np.log2(counts / counts.sum())
    return float(-log2p[held_bytes].mean())


def cast_model(model: MLAModel, dtype) -> MLAModel:
    """A copy of ``model`` whose parameters are stored and computed in ``dtype`` (float32 router-bias
    state, if any, stays float32)."""
    # The new model's structure (its modules' compute dtype) without initializing its weights, and
    # the cast in one program: eager casts compile one program a parameter shape.
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: MLAModel(model.cfg, rngs=nnx.Rngs(0), dtype=dtype)))
    params, rest = nnx.state(model, nnx.Param, ...)
    cast = jax.jit(lambda tree: jax.tree.map(lambda p: p.astype(dtype), tree))(params)
    return nnx.merge(graphdef, cast, rest)


def load_init(path: str, cfg: MLAConfig, config_name: str) -> tuple[MLAModel, dict]:
    """The model at ``--init-from`` ``path`` and what the new record says of it: its path and, when it
    has one, its own ``train_recipe.json`` (so a continued model records the whole recipe). Raises
    cli.UsageError naming --init-from for a directory that is not a checkpoint or holds a model of
    another config than ``cfg`` (its context apart)."""
    try:
        model = load_checkpoint(path)
    except CheckpointError as err:
        raise cli.UsageError(f"--init-from: {str(err).removeprefix('ckpt_dir: ')}") from err
    if dataclasses.replace(model.cfg, max_position_embeddings=cfg.max_position_embeddings) != cfg:
        raise cli.UsageError(f"--init-from: {path} holds a model of another config than --config {config_name}")
    record = {"path": str(pathlib.Path(path).resolve())}
    recipe_file = pathlib.Path(path) / "train_recipe.json"
    if recipe_file.is_file():
        previous = json.loads(recipe_file.read_text())
        record.update({key: previous.get(key) for key in ("recipe", "steps_done", "command", "init_from")
                       if previous.get(key) is not None})
    return model, record


def _parser() -> cli.Parser:
    p = cli.Parser(prog="python -m snapmla_jax.train_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True,
                   help="directory for the checkpoint and its metadata: new or empty (or, with --overwrite, a "
                        "snapmla-jax checkpoint)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the snapmla-jax checkpoint at --out (only one of ours; once the new one is complete)")
    p.add_argument("--init-from", metavar="CKPT",
                   help="start from this checkpoint's parameters (a model of --config, trained on any window "
                        "length) instead of a fresh initialization")
    for field in dataclasses.fields(TrainRecipe):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "config":
            p.add_argument(flag, choices=sorted(CONFIGS), default=field.default, help=field.metadata["help"])
        elif field.name == "seq_len":
            p.add_argument(flag, type=int, default=None, help=field.metadata["help"])
        else:
            p.add_argument(flag, type=type(field.default), default=field.default,
                           help=f"{field.metadata['help']} (default {field.default})")
    return p


def _flags() -> dict[str, str]:
    return {field.name: "--" + field.name.replace("_", "-") for field in dataclasses.fields(TrainRecipe)}


def _train_demo(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN[args.config]
    try:
        recipe = TrainRecipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainRecipe)})
    except ValueError as err:
        raise cli.flag_error(err, _flags()) from err
    if recipe.task_fraction > 0:
        try:
            for kind in long_context_tasks.TASK_KINDS:
                long_context_tasks.make_task(kind, recipe.seq_len + 1, 0.5, 0)
        except ValueError as err:
            raise cli.UsageError(f"--seq-len: {recipe.seq_len} tokens are too short for --task-fraction's "
                                 f"long-range tasks ({err})") from err
    out = pathlib.Path(args.out)
    problem = target_problem(out, overwrite=args.overwrite)
    if problem is not None:
        raise cli.UsageError(problem.message("--out", "--overwrite"))
    _import_optax()
    # The saved config states the context the model was trained for: generation stops there.
    cfg = dataclasses.replace(CONFIGS[recipe.config](), max_position_embeddings=recipe.seq_len)
    init, init_record = (None, None) if args.init_from is None else load_init(args.init_from, cfg, recipe.config)
    split = byte_corpus.split_files(heldout_fraction=recipe.heldout_fraction)
    train_stream = byte_corpus.token_stream(split.root, split.train_files)
    held_stream = byte_corpus.token_stream(split.root, split.heldout_files)
    if held_stream.size <= recipe.seq_len:
        raise cli.UsageError(f"--seq-len: the held-out text has {held_stream.size} tokens; expected at most "
                             f"{held_stream.size - 1} for one evaluation window")
    print(f"corpus: {len(split.train_files)} train files ({train_stream.size} tokens), "
          f"{len(split.heldout_files)} held-out files ({held_stream.size} tokens) from {split.root}")

    model, history = train(cfg, train_stream, recipe, init=init)
    shipped = cast_model(model, jnp.bfloat16)
    windows = heldout_windows(held_stream, recipe.seq_len, recipe.eval_windows)
    train_windows = byte_corpus.sample_windows(train_stream, windows.shape[0], recipe.seq_len + 1,
                                               np.random.default_rng(recipe.seed + 1))
    results = {
        "heldout_bits_per_byte_bf16": bits_per_byte(shipped, windows),
        "train_bits_per_byte_bf16": bits_per_byte(shipped, train_windows),
        "heldout_bits_per_byte_f32": bits_per_byte(model, windows),
        "unigram_heldout_bits_per_byte": unigram_bits_per_byte(train_stream, held_stream),
        "heldout_tokens_scored": int(windows.shape[0] * recipe.seq_len),
    }
    print(json.dumps(results, indent=1))

    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(shipped, nnx.Param)))
    record = {
        "recipe": dataclasses.asdict(recipe), "model_config": cfg.to_dict(), "num_params": num_params,
        "steps_done": history["steps"][-1], "train_seconds": history["seconds"][-1],
        "compile_seconds": history["compile_seconds"], "final_train_loss_nats": history["loss"][-1],
        "history": {k: v for k, v in history.items() if k != "compile_seconds"}, **results,
        "device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
        "python_version": sys.version.split()[0],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": "python -m snapmla_jax.train_demo " + " ".join(argv),
    }
    if init_record is not None:
        record["init_from"] = init_record
    # Checkpoint and metadata appear at --out together, once all are written.
    with staged_checkpoint_dir(out, overwrite=args.overwrite) as staging:
        write_checkpoint(shipped, staging)
        byte_corpus.write_file_list(staging / "heldout_files.json", split.heldout_files,
                                    heldout_fraction=recipe.heldout_fraction)
        byte_corpus.write_tokenizer_config(staging / "tokenizer_config.json")
        (staging / "train_recipe.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}: {num_params} parameters, {history['steps'][-1]} steps in {history['seconds'][-1]:.0f}s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input or out of memory)."""
    return cli.run(PROG, _train_demo, argv, out_of_memory_hint="try a smaller --batch-size or --seq-len")


if __name__ == "__main__":
    sys.exit(main())
