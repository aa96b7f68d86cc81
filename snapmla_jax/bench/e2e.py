"""``python -m snapmla_jax.bench e2e``: end-to-end decode throughput, FP8 vs BF16 cache.

A model with DeepSeek-V2-Lite's shapes (27 layers, hidden 2048, 16 heads,
kv_lora_rank 512, 64 routed experts top-6 + 2 shared, vocab 102400) with random
bf16 weights decodes with ``snapmla_jax.generate``'s compiled decode loop (the
``lax.while_loop`` of ``--steps`` steps: 27 x (write_kv + mla_decode), the
MoE, the LM head and greedy sampling per step, cache donated). Every row holds
``context`` cached tokens (the cache is filled with constant values instead of
a prefill: the attention kernels' time does not depend on the values), each row
starting from a token of its own, so that the rows route to different experts.

Per (batch, context, cache format): generated tokens/s = batch / step time,
and the share of the step spent in attention, measured by timing the same
27 x (write_kv + mla_decode) alone. The feed-forward stack (dense MLP + 26 MoE
layers) is timed alone too, and the step's weight-read floor is computed from
the bytes of the weights a step touches and the copy bandwidth measured in the
run. A (batch, context) whose cache does not fit next to the weights is
reported as such; what fits is read from the device's memory limit, which
XLA's default preallocation puts at 75% of the GPU (on an H100 the BF16 cache
of B=64 x 16k then does not fit): set ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92``
(or higher) in the environment to give the benchmark more.

One compiled program per (batch, cache format) serves every context: the
cache and block table are sized for the largest context that fits, and the
kernels stop at each row's seq_len. Programs are compiled in parallel threads
before the runs; results are written after every run, so a run cut short
still leaves its table (``--out``; default: outside the source tree, printed; ``--publish``:
the repository's docs/benchmarks/). ``--tiny`` runs a 2-layer model on any backend (CPU test).
``--fp8-weights`` makes the linear kernels and routed experts block-FP8 (``fp8_matmul``'s
products; ``--fp8-absorbed`` the attention's w_uk / w_uv too); ``--weights bf16 fp8`` (or
fp8-absorbed; fp8-ffn: the feed-forward blocks' weights only; fp8-large: the weights of
``DECODE_MIN_FP8_ELEMENTS`` elements and more) builds a
model of each kind and times them side by side in one run, plan by plan (one table, the step's
time under each and their ratio; ``--kv-caches fp8`` keeps one cache format; kinds whose models
do not fit the device's memory together are refused before any is built);
``--kernel-quantization ROWS`` has the FP8 GEMM of few tokens quantize x itself up to ROWS rows.
``--profile`` adds each row's GPU time per launch and decode step (``timing.kernel_times_us``)
to the JSON; XLA runs the decode loop's body as a CUDA graph, which the profiler does not see
into, so profile with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=``. The feed-forward stack is
timed in a loop of ``--steps`` steps too, so that its launches run as the step's do.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import gc
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import snapmla_jax.models.moe

from snapmla_jax import models
from snapmla_jax.models import MLAConfig, MLAModel
from snapmla_jax.models.layers import DECODE_MIN_FP8_ELEMENTS, fp8_eligible_weights
from snapmla_jax.models.sharding import key_name
from snapmla_jax import cli, data_parallel, fp8_weights
from snapmla_jax.backend import BACKENDS, resolve_backend
from snapmla_jax.bench import timing
from snapmla_jax.cache import LatentCache, kernel_addressable
from snapmla_jax.decode import mla_decode
from snapmla_jax.fp8_weights import FP8_E4M3_MAX
from snapmla_jax.generate import DecodeState, decode_chunk
from snapmla_jax.capacity import MODEL_SHAPES
from snapmla_jax.paging import allocate_pages
from snapmla_jax.sampling import SamplingConfig
from snapmla_jax.write import write_kv

PAGE_SIZE = 64
GIB = 2**30
# Left free beside weights and caches: logits [B, vocab] f32, MoE temporaries,
# the split-KV partials and XLA's scratch.
HEADROOM_BYTES = 4 * GIB
CACHE_FORMATS = ("fp8", "bf16")
# --weights: the model's linear weights. "fp8": block-FP8 as ``models.quantize_weights`` converts
# them; "fp8-absorbed": the attention's w_uk / w_uv too; "fp8-ffn": the feed-forward blocks' only
# (dense MLPs, shared and routed experts), the attention projections bf16: at a decode step's few
# tokens a small projection's FP8 GEMM and the launches around it may cost more than its bytes save;
# "fp8-large": the weights of at least ``models.layers.DECODE_MIN_FP8_ELEMENTS`` elements only.
WEIGHT_KINDS = ("bf16", "fp8", "fp8-absorbed", "fp8-ffn", "fp8-large")
WEIGHT_TEXT = {"bf16": "bf16", "fp8": "block-FP8", "fp8-absorbed": "block-FP8 (w_uk / w_uv too)",
               "fp8-ffn": "block-FP8 feed-forward (attention projections bf16)",
               "fp8-large": "block-FP8 from 2^24 elements a weight (smaller ones bf16)"}
WEIGHT_STD = 0.02  # of the random weight matrices (GPT-2's init scale; values only need to stay finite)
FP8_VALUE_STD = 64.0  # of a random block-FP8 weight's e4m3 values (well inside +-448)

V2_LITE = MODEL_SHAPES["v2-lite"]
TINY = MLAConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, max_position_embeddings=4096,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1)
PROFILE_TOP = 20  # launches kept per row with --profile
PROFILE_CALLS = 3  # traced decode calls per row with --profile
FULL_GRID = dict(batches=(16, 64, 128), contexts=(4096, 16384, 32768))
TINY_GRID = dict(batches=(2, 3), contexts=(64, 200))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One compiled decode program: a batch size and cache format, and the contexts it serves."""

    batch: int
    kv_cache: str
    contexts: tuple[int, ...]  # those that fit, ascending
    too_big: tuple[int, ...]  # those whose cache does not fit
    num_pages: int
    cache_bytes: int  # for the largest fitting context


def cache_bytes_per_token(cfg: MLAConfig, kv_cache: str) -> int:
    """All layers: fp8 512 + 4 + 128 = 644 B per layer, bf16 1024 + 128 = 1152 B."""
    per_layer = cfg.kv_lora_rank * (1 if kv_cache == "fp8" else 2) + cfg.qk_rope_head_dim * 2
    return cfg.num_hidden_layers * (per_layer + (4 if kv_cache == "fp8" else 0))


def memory_text(env: dict) -> str:
    """The sentence saying what memory the cache had room in ("" for runs that did not record it)."""
    if "xla_mem_fraction" not in env:
        return ""
    fraction = env["xla_mem_fraction"]
    setting = f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}" if fraction else "XLA's default 75%"
    return f" Device memory for weights and caches: {setting} of the GPU."


def free_device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats["bytes_in_use"]


def make_plans(cfg: MLAConfig, batches, contexts, total_steps: int, free: int | None,
               kv_caches=CACHE_FORMATS) -> list[Plan]:
    plans = []
    for batch in batches:
        for kv_cache in kv_caches:
            fits, too_big = [], []
            for context in sorted(contexts):
                tokens = batch * (context + total_steps)
                need = tokens * cache_bytes_per_token(cfg, kv_cache)
                # One layer's cache array (up to a page more per row) within the kernels' int32 row indices.
                addressable = kernel_addressable(tokens + PAGE_SIZE * batch)
                (fits if addressable and (free is None or need + HEADROOM_BYTES <= free) else too_big).append(context)
            if fits:
                pages = allocate_pages([fits[-1]] * batch, total_steps, page_size=PAGE_SIZE)
                nbytes = pages.num_pages * PAGE_SIZE * cache_bytes_per_token(cfg, kv_cache)
            else:
                pages, nbytes = None, 0
            plans.append(Plan(batch, kv_cache, tuple(fits), tuple(too_big), pages.num_pages if pages else 0, nbytes))
    return plans


def filled_caches(cfg: MLAConfig, num_pages: int, kv_cache: str, mesh: jax.sharding.Mesh | None = None) -> tuple:
    """Per-layer caches holding constant finite values (the kernels' time does not depend on them).
    ``mesh``: ``num_pages`` pages on each of its devices, the page axis split over it, each device
    making its own (``data_parallel.create_caches``' layout)."""
    def one():
        pages = (num_pages, PAGE_SIZE)
        if kv_cache == "fp8":
            latent = jnp.full((*pages, cfg.kv_lora_rank), 0.5, jnp.float8_e4m3fn)
            scale = jnp.full(pages, 1 / 448, jnp.float32)
        else:
            latent, scale = jnp.full((*pages, cfg.kv_lora_rank), 0.5, jnp.bfloat16), None
        return LatentCache(latent=latent, scale=scale, rope=jnp.full((*pages, cfg.qk_rope_head_dim), 0.5, jnp.bfloat16))
    make = jax.jit(one) if mesh is None else jax.jit(jax.shard_map(
        one, mesh=mesh, in_specs=(), out_specs=jax.sharding.PartitionSpec(mesh.axis_names[0]), check_vma=False))
    return tuple(make() for _ in range(cfg.num_hidden_layers))


def _random_array(key, shape, dtype, role: str = "weight"):
    """A leaf of ``random_model``: "weight" N(0, WEIGHT_STD) (an e4m3 one the values of such a
    weight over a scale of WEIGHT_STD / FP8_VALUE_STD), "scales" that block scale, "norm" ones."""
    if role == "norm":
        return jnp.ones(shape, dtype)
    if role == "scales":
        return jnp.full(shape, WEIGHT_STD / FP8_VALUE_STD, dtype)
    if jnp.dtype(dtype).itemsize == 1:  # block-FP8 values
        values = jax.random.normal(key, shape, jnp.float32) * FP8_VALUE_STD
        return jnp.clip(values, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(dtype)
    return jax.random.normal(key, shape, dtype) * jnp.asarray(WEIGHT_STD, dtype)


def _leaf_role(path, shape) -> str:
    name = key_name(path[-1]) if path else ""
    return "scales" if name == "scales" else "norm" if len(shape) == 1 else "weight"


def abstract_model(cfg: MLAConfig, dtype, *, fp8_weights: bool = False, fp8_absorbed: bool = False,
                   fp8_ffn_only: bool = False, fp8_min_elements: int = 0) -> MLAModel:
    """The shapes and dtypes of ``random_model``'s model (``nnx.eval_shape``: nothing allocated)."""
    def build():
        model = MLAModel(cfg, rngs=nnx.Rngs(0), dtype=dtype)
        if not fp8_weights:
            return model
        paths = [p for p in fp8_eligible_weights(model) if "/mlp/" in p] if fp8_ffn_only else None
        return models.quantize_weights(model, cfg.weight_block_size, paths=paths, absorbed=fp8_absorbed,
                                       min_elements=fp8_min_elements)
    return nnx.eval_shape(build)


def weight_kind_options(weights: str) -> dict:
    """``random_model`` / ``abstract_model``'s FP8 arguments for a WEIGHT_KINDS name."""
    return dict(fp8_weights=weights != "bf16", fp8_absorbed=weights == "fp8-absorbed",
                fp8_ffn_only=weights == "fp8-ffn",
                fp8_min_elements=DECODE_MIN_FP8_ELEMENTS if weights == "fp8-large" else 0)


def check_models_fit(cfg: MLAConfig, kinds, limit_bytes: int | None) -> None:
    """cli.UsageError naming --weights where the models of ``kinds`` (built side by side) with
    HEADROOM_BYTES beside them exceed ``limit_bytes`` (the device memory XLA may use; None:
    unknown, no check): building them would only end in allocator errors and a table of "no room"."""
    if limit_bytes is None:
        return
    sizes = {kind: sum(leaf.size * jnp.dtype(leaf.dtype).itemsize
                       for leaf in jax.tree.leaves(nnx.state(abstract_model(cfg, jnp.bfloat16,
                                                                            **weight_kind_options(kind)))))
             for kind in kinds}
    if sum(sizes.values()) + HEADROOM_BYTES > limit_bytes:
        fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        setting = f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}" if fraction else "XLA's default 75% of the GPU"
        each = ", ".join(f"{kind} {size / GIB:.1f}" for kind, size in sizes.items())
        raise cli.UsageError(f"--weights: the models take {sum(sizes.values()) / GIB:.1f} GiB ({each}) and "
                             f"{HEADROOM_BYTES / GIB:.0f} GiB beside them, where {setting} leaves "
                             f"{limit_bytes / GIB:.1f} GiB; name fewer kinds or raise XLA_PYTHON_CLIENT_MEM_FRACTION")


def random_model(cfg: MLAConfig, dtype, seed: int = 0, mesh: jax.sharding.Mesh | None = None, *,
                 fp8_weights: bool = False, fp8_absorbed: bool = False, fp8_ffn_only: bool = False,
                 fp8_min_elements: int = 0) -> MLAModel:
    """An MLAModel with random weights drawn on the device directly in ``dtype``:
    N(0, WEIGHT_STD) matrices, unit norm scales. One small compiled generator per
    distinct shape and placement, instead of running the model's initializers op by op.
    ``mesh``: each array made where ``data_parallel.place_model`` puts it (the routed experts
    split over the mesh, the rest replicated), so that no device holds the whole model.
    ``fp8_weights``: the weights ``models.quantize_weights`` converts are made block-FP8 directly
    (e4m3 values, one float32 scale a ``cfg.weight_block_size`` block), never held in ``dtype``:
    a model whose bf16 weights would not fit the devices can be made. ``fp8_absorbed``: with
    ``fp8_weights``, the attention's w_uk / w_uv too (``quantize_weights(absorbed=True)``).
    ``fp8_ffn_only``: with ``fp8_weights``, only the feed-forward blocks' weights (paths under
    "mlp/"), the attention's in ``dtype``. ``fp8_min_elements``: with ``fp8_weights``, weights of
    fewer elements stay in ``dtype`` (``quantize_weights(min_elements=...)``)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, fp8_weights=fp8_weights, fp8_absorbed=fp8_absorbed,
                                               fp8_ffn_only=fp8_ffn_only, fp8_min_elements=fp8_min_elements))
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    key = jax.random.key(seed)
    makers: dict = {}
    values = []
    for i, (path, leaf) in enumerate(paths_leaves):
        shape, leaf_dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        role = _leaf_role(path, shape)
        spec = None if mesh is None else data_parallel.param_spec(path, mesh.axis_names[0])
        if (shape, leaf_dtype, role, spec) not in makers:
            sharding = None if mesh is None else jax.sharding.NamedSharding(mesh, spec)
            makers[shape, leaf_dtype, role, spec] = jax.jit(
                functools.partial(_random_array, shape=shape, dtype=leaf_dtype, role=role), out_shardings=sharding)
        values.append(makers[shape, leaf_dtype, role, spec](jax.random.fold_in(key, i)))
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, values))
    return model if mesh is None else data_parallel.place_model(model, mesh)


def abstract_caches(model: MLAModel, num_pages: int, kv_cache: str):
    return jax.eval_shape(lambda: model.init_cache(num_pages, PAGE_SIZE, kv_cache=kv_cache))


def decode_state(caches, batch: int, total_steps: int, vocab_size: int) -> DecodeState:
    """The decode loop's state at step 1, each row's last token a different one (rows that all
    held one token would route alike, and a MoE that skips the experts no token chose would read
    k of them where a serving batch's rows read up to k x batch)."""
    first = jax.random.randint(jax.random.key(batch), (batch, 1), 0, vocab_size, jnp.int32)
    return DecodeState(caches=caches, tokens=jnp.broadcast_to(first, (batch, total_steps)),
                       step=jnp.asarray(1, jnp.int32), finished=jnp.zeros((batch,), bool))


@functools.partial(jax.jit, static_argnames=("softmax_scale", "backend"), donate_argnames=("caches",))
def attention_layers(caches, latent, k_rope, slots, q_latent, q_rope, block_table, seq_lens, *, softmax_scale,
                     backend):
    """A decode step's attention alone: per layer, write one token per row, then ``mla_decode``.

    latent [B, R], k_rope [B, Dr], slots [B] int32, q_latent [B, 1, H, R],
    q_rope [B, 1, H, Dr]. Returns (caches, outputs [L, B, 1, H, R])."""
    new, outs = [], []
    for cache in caches:
        cache = write_kv(cache, latent, k_rope, slots, backend=backend)
        outs.append(mla_decode(q_latent, q_rope, cache, block_table, seq_lens, softmax_scale=softmax_scale,
                               backend=backend))
        new.append(cache)
    return tuple(new), jnp.stack(outs)


@functools.partial(jax.jit, static_argnames=("graphdef", "backend", "steps"))
def feed_forward_stack(params, x, *, graphdef, backend: str = "xla", steps: int = 1):
    """A decode step's feed-forward alone: every layer's norm + dense MLP / MoE on x [B, 1, hidden]
    (``backend``: as the decode step passes it to the MoE's gathered dispatch), ``steps`` times in
    a ``lax.fori_loop``: the decode loop runs its body as one CUDA graph, and launched one by one
    the stack's small launches took up to 4x the step at one token (H100)."""
    model = nnx.merge(graphdef, params)

    def stack(_, x):
        for layer in model.layers:
            x = layer.feed_forward(x, backend)
        return x
    return jax.lax.fori_loop(0, steps, stack, x)


def weight_bytes_touched(cfg: MLAConfig, params, batch: int, dispatch: str = "ragged") -> tuple[int, int]:
    """(all weight bytes, bytes a step of ``batch`` tokens reads): the embedding counts
    ``batch`` rows; routed experts whole where the MoE runs them ``dispatch`` "dense" (every
    matrix once; block-FP8 experts' gate and up skip the experts no token chose), else by the
    expected share any token picks, 1 - (1 - k/E)^batch (uniform routing; ``routed_dispatch``
    gives a model's dispatch)."""
    total = unread = 0
    expert = {"w_gate": 0, "w_up": 0, "w_down": 0}
    fp8_experts = False
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        nbytes = leaf.size * leaf.dtype.itemsize
        names = {getattr(key, "key", None) for key in path}
        total += nbytes
        for name in names & expert.keys():
            expert[name] += nbytes
            fp8_experts |= leaf.dtype == jnp.float8_e4m3fn
        if "embed_tokens" in names:
            unread += nbytes - min(nbytes, batch * nbytes // leaf.shape[0])
    if not cfg.n_routed_experts or (dispatch == "dense" and not fp8_experts):
        skipped = 0.0
    else:
        share = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch
        skippable = expert["w_gate"] + expert["w_up"] + (0 if dispatch == "dense" else expert["w_down"])
        skipped = (1 - share) * skippable
    return total, int(total - unread - skipped)


def routed_dispatch(model, batch: int, backend: str) -> str:
    """How ``model``'s MoE layers run a call of ``batch`` tokens with ``backend`` (``MoE.dispatch``:
    with FP8 weights a gathered call of as many assignments as experts runs dense, and sorted
    takes over from ``sorted_min_tokens``); "dense" without MoE layers."""
    layers = models.moe.moe_layers(model)
    return layers[0].dispatch(batch, resolve_backend(backend)) if layers else "dense"


def moe_dispatch_text(token_range, gather_max: int = 0, sorted_min: int | None = None,
                      fp8_sorted_min: int | None = None) -> str:
    """How the table's MoE layers ran their routed experts, for its header."""
    parts = [f"gathered up to {gather_max} tokens a call"] if gather_max else []
    if token_range is not None:
        parts.append(f"dense for {token_range[0]}..{token_range[1]} tokens")
    if not parts and sorted_min is None:
        return "ragged (`jax.lax.ragged_dot`) at every token count"
    text = ", ".join(parts + ["ragged otherwise"])
    if sorted_min is not None:
        text += (f"; sorted instead of dense or ragged from {sorted_min} tokens where its grouped GEMMs "
                 "run")
        if fp8_sorted_min not in (None, sorted_min):
            text += f" (from {fp8_sorted_min} on block-FP8 experts, `MoE.fp8_sorted_min_tokens`)"
    return text + " (`MoE.gather_max_tokens`, `MoE.dense_token_range`, `MoE.sorted_min_tokens`)"


def moe_dispatch(model) -> dict:
    """The dispatch the model's MoE layers share: ``dense_moe_tokens`` (their
    ``dense_token_range``), ``gather_moe_tokens`` (their ``gather_max_tokens``) and
    ``sorted_moe_tokens`` (their ``sorted_min_tokens``), ``fp8_sorted_moe_tokens`` (their
    ``fp8_sorted_min_tokens``); None, 0, None and None without MoE layers.
    ValueError if the layers differ (this benchmark sets one for all)."""
    found = {(module.dense_token_range, module.gather_max_tokens, module.sorted_min_tokens,
              module.fp8_sorted_min_tokens) for module in models.moe.moe_layers(model)}
    if len(found) > 1:
        raise ValueError(f"model: MoE layers with different dispatches {sorted(map(str, found))}")
    token_range, gather_max, sorted_min, fp8_sorted_min = found.pop() if found else (None, 0, None, None)
    return {"dense_moe_tokens": token_range, "gather_moe_tokens": gather_max, "sorted_moe_tokens": sorted_min,
            "fp8_sorted_moe_tokens": fp8_sorted_min}


def timed_calls(call, iters: int) -> float:
    """Median seconds of ``call()`` (which synchronises) over ``iters`` calls after one warm-up call."""
    call()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class Runner:
    """Compiles the programs of every plan (in parallel threads) and runs them one plan at a time.
    ``weights``: the model's kind (WEIGHT_KINDS), recorded in its rows; ``pool`` (the compile
    threads) and ``compile_seconds`` (filled by name): shared by the runners of one run (``label``
    then names their programs)."""

    def __init__(self, cfg: MLAConfig, model: MLAModel, *, steps: int, iters: int, backend: str,
                 pool: concurrent.futures.Executor, compile_seconds: dict[str, float], profile: bool = False,
                 weights: str = "bf16", label: str = ""):
        self.cfg, self.steps, self.iters, self.backend = cfg, steps, iters, backend
        self.graphdef, self.params = nnx.split(model)
        self.model, self.weights, self.label = model, weights, label
        # The decode state holds every step the timed calls run: a warm-up and ``iters`` calls,
        # and with ``profile`` a warm-up and PROFILE_CALLS traced calls more.
        self.total_steps = 1 + (iters + 1 + (1 + PROFILE_CALLS if profile else 0)) * steps
        self.pool, self.compile_seconds, self.profile = pool, compile_seconds, profile

    def _submit(self, name: str, lowered):
        name = f"{self.label} {name}" if self.label else name

        def compile_():
            start = time.perf_counter()
            compiled = lowered.compile()
            self.compile_seconds[name] = time.perf_counter() - start
            return compiled
        return self.pool.submit(compile_)

    def _inputs(self, plan: Plan):
        cfg, batch = self.cfg, plan.batch
        pages = allocate_pages([plan.contexts[-1]] * batch, self.total_steps, page_size=PAGE_SIZE)
        rng = np.random.default_rng(0)
        vectors = dict(
            latent=jnp.asarray(rng.standard_normal((batch, cfg.kv_lora_rank)), jnp.bfloat16),
            k_rope=jnp.asarray(rng.standard_normal((batch, cfg.qk_rope_head_dim)), jnp.bfloat16),
            q_latent=jnp.asarray(rng.standard_normal((batch, 1, cfg.num_attention_heads, cfg.kv_lora_rank)),
                                 jnp.bfloat16),
            q_rope=jnp.asarray(rng.standard_normal((batch, 1, cfg.num_attention_heads, cfg.qk_rope_head_dim)),
                               jnp.bfloat16))
        return pages, vectors

    def submit(self, plan: Plan) -> dict:
        """Lower this plan's decode and attention programs here, compile them in the pool."""
        pages, vectors = self._inputs(plan)
        caches = abstract_caches(self.model, plan.num_pages, plan.kv_cache)
        batch = plan.batch
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
        table = jax.ShapeDtypeStruct(pages.block_table.shape, jnp.int32)
        state = jax.eval_shape(lambda c: decode_state(c, batch, self.total_steps, self.cfg.vocab_size), caches)
        decode = decode_chunk.lower(self.params, state, lengths, table, jax.random.key(0),
                                     jax.ShapeDtypeStruct((), jnp.int32), graphdef=self.graphdef,
                                     sampling=SamplingConfig(), eos_id=None, backend=self.backend)
        attention = attention_layers.lower(caches, vectors["latent"], vectors["k_rope"], lengths,
                                           vectors["q_latent"], vectors["q_rope"], table, lengths,
                                           softmax_scale=self.cfg.softmax_scale, backend=self.backend)
        name = f"B={batch} {plan.kv_cache}"
        return dict(decode=self._submit(f"decode {name}", decode),
                    attention=self._submit(f"attention {name}", attention))

    def submit_ffn(self, batch: int):
        x = jax.ShapeDtypeStruct((batch, 1, self.cfg.hidden_size), self.model.dtype)
        return self._submit(f"ffn B={batch}", feed_forward_stack.lower(self.params, x, graphdef=self.graphdef,
                                                                        backend=self.backend, steps=self.steps))

    def run(self, plan: Plan, programs: dict, ffn) -> list[dict]:
        """Time decode and attention for every context of ``plan`` (one cache allocation)."""
        pages, vectors = self._inputs(plan)
        batch, table = plan.batch, jnp.asarray(pages.block_table)
        decode, attention = programs["decode"].result(), programs["attention"].result()
        holder = {"caches": filled_caches(self.cfg, plan.num_pages, plan.kv_cache)}
        # Rows of their own, as the step's: they route to different experts.
        x = jax.random.normal(jax.random.key(batch), (batch, 1, self.cfg.hidden_size), self.model.dtype)
        ffn_ms = timed_calls(lambda: ffn.result()(self.params, x).block_until_ready(), self.iters) / self.steps * 1e3
        key = jax.random.key(0)
        rows = []
        for context in plan.contexts:
            lengths = jnp.full((batch,), context, jnp.int32)
            state = {"s": decode_state(holder.pop("caches"), batch, self.total_steps, self.cfg.vocab_size)}

            def decode_call():
                stop = jnp.asarray(int(state["s"].step) + self.steps, jnp.int32)
                state["s"] = decode(self.params, state["s"], lengths, table, key, stop)
                int(state["s"].step)

            step_ms = timed_calls(decode_call, self.iters) / self.steps * 1e3
            launches = timing.kernel_times_us(decode_call, (), calls=PROFILE_CALLS) if self.profile else {}
            holder["caches"] = state.pop("s").caches
            positions = np.full(batch, context)
            slots = jnp.asarray(pages.block_table[np.arange(batch), positions // PAGE_SIZE] * PAGE_SIZE
                                + positions % PAGE_SIZE, jnp.int32)
            seq_lens = jnp.asarray(positions + 1, jnp.int32)

            def attention_call():
                holder["caches"], out = attention(holder["caches"], vectors["latent"], vectors["k_rope"], slots,
                                                  vectors["q_latent"], vectors["q_rope"], table, seq_lens)
                out.block_until_ready()

            attention_ms = timed_calls(attention_call, max(self.iters, 5)) * 1e3
            rows.append(dict(batch=batch, context=context, kv_cache=plan.kv_cache, weights=self.weights,
                             status="ok", step_ms=step_ms,
                             tokens_per_s=batch / step_ms * 1e3, attention_ms=attention_ms,
                             attention_share=attention_ms / step_ms, ffn_ms=ffn_ms, ffn_share=ffn_ms / step_ms,
                             cache_gib=batch * context * cache_bytes_per_token(self.cfg, plan.kv_cache) / GIB))
            if launches:  # per decode step, largest first
                rows[-1]["step_launch_us"] = {name: us / self.steps
                                              for name, us in list(launches.items())[:PROFILE_TOP]}
                rows[-1]["step_launch_us_total"] = sum(launches.values()) / self.steps
            print(f"  B={batch} ctx={context} {plan.kv_cache} cache, {self.weights} weights: {step_ms:.2f} ms/step, "
                  f"{rows[-1]['tokens_per_s']:.0f} tok/s, attention {attention_ms:.2f} ms, ffn {ffn_ms:.2f} ms",
                  flush=True)
        holder.clear()  # the caches go before the next plan allocates its own
        gc.collect()
        return rows


def _cell(row: dict | None, field: str, fmt: str) -> str:
    """A table cell: the value, the status of a row that did not run (tokens/s column), or "-"."""
    if row is not None and row["status"] == "ok":
        return format(row[field], fmt)
    return row["status"] if row is not None and field == "tokens_per_s" else "-"


def activation_text(env: dict) -> str:
    """Where the FP8 products' activations were quantized, for the header ("" with bf16 weights)."""
    rows = env.get("kernel_quantization_rows")
    if rows is None:
        return ""
    # Runs before the Mosaic GPU quantizer recorded no quantizer: XLA's.
    above = "one Mosaic GPU launch" if env.get("activation_quantizer") == "mosaic" else "XLA"
    where = (f"in the FP8 GEMM itself up to {rows} row{'s' if rows > 1 else ''}, by {above} above" if rows
             else f"by {above}")
    one_row = env.get("xla_product_rows", 0)  # runs before it recorded none: every product on the GEMM
    if one_row:
        where += (f"; matrix products of up to {one_row} row{'s' if one_row > 1 else ''} by XLA, the weight "
                  "dequantized in the product")
    return f" (activations quantized {where})"


def decoding_text(env: dict) -> str:
    """The tables' sentences on how the steps ran: the loop, the backend, the copy bandwidth, the
    MoE's dispatch and the memory setting."""
    moe = moe_dispatch_text(env.get("dense_moe_tokens"), env.get("gather_moe_tokens", 0), env.get("sorted_moe_tokens"),
                            env.get("fp8_sorted_moe_tokens"))
    return (f"Greedy decoding in the compiled `lax.while_loop` of `snapmla_jax.generate` ({env['steps']} steps per "
            f"call, median of {env['iters']} calls), every row holding `context` cached tokens; backend "
            f"`{env['backend']}`. Copy bandwidth measured in this run: {env['copy_gbps']:.0f} GB/s. MoE routed "
            f"experts: {moe}.{memory_text(env)}")


def compile_text(env: dict) -> str:
    """The tables' closing line of compile times ("" without them)."""
    compiled = env.get("compile_seconds", {})
    if not compiled:
        return ""
    return ("Compile times (s, parallel threads): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(compiled.items()))
            + "\n")


def markdown(env: dict, rows: list[dict], batches, contexts) -> str:
    by_key = {(r["batch"], r["context"], r["kv_cache"]): r for r in rows}
    lines = [
        "# End-to-end decode: FP8 vs BF16 latent cache\n",
        f"Device {env['device']}, jax {env['jax']}, {env['date']}. Produced by `python -m snapmla_jax.bench e2e` "
        "(the published table with `--publish`).\n",
        f"Model: {env['model']} with random {env.get('weights', 'bf16')} weights{activation_text(env)} "
        f"({env['params_b']:.2f} B parameters, "
        f"{env['weights_gib']:.1f} GiB). {decoding_text(env)}\n",
        f"Columns: generated tokens/s (= batch / step time); attention = {env['layers']} x (write_kv + "
        f"mla_decode) timed alone, as a share of the step; FFN = the {env['layers']} feed-forward blocks "
        f"(dense MLP / MoE) timed alone (a loop of {env['steps']} steps, per step); floor = (weight bytes the step reads + cache bytes) / copy bandwidth.\n",
    ]
    header = ["batch", "context", "FP8 tok/s", "BF16 tok/s", "FP8 / BF16", "FP8 ms/step", "BF16 ms/step",
              "attn share FP8", "attn share BF16", "FFN ms", "floor ms FP8", "floor ms BF16"]
    table = []
    for batch in batches:
        for context in contexts:
            fp8, bf16 = by_key.get((batch, context, "fp8")), by_key.get((batch, context, "bf16"))
            ratio = (format(fp8["tokens_per_s"] / bf16["tokens_per_s"], ".2f")
                     if fp8 and bf16 and fp8["status"] == bf16["status"] == "ok" else "-")
            ok = fp8 if fp8 and fp8["status"] == "ok" else bf16 if bf16 and bf16["status"] == "ok" else None
            table.append([batch, context, _cell(fp8, "tokens_per_s", ".0f"), _cell(bf16, "tokens_per_s", ".0f"),
                          ratio, _cell(fp8, "step_ms", ".2f"), _cell(bf16, "step_ms", ".2f"),
                          _cell(fp8, "attention_share", ".0%"), _cell(bf16, "attention_share", ".0%"),
                          _cell(ok, "ffn_ms", ".2f"), _cell(fp8, "floor_ms", ".2f"), _cell(bf16, "floor_ms", ".2f")])
    lines.append(timing.markdown_table(header, table))
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        span = lambda values, fmt: f"{format(min(values), fmt)} to {format(max(values), fmt)}"
        attention = [f"{kv.upper()} {span([r['attention_share'] for r in ok if r['kv_cache'] == kv], '.0%')}"
                     for kv in CACHE_FORMATS if any(r["kv_cache"] == kv for r in ok)]
        lines.append(f"\nShare of the step: attention {', '.join(attention)}; feed-forward "
                     f"{span([r['ffn_share'] for r in ok], '.0%')}. Step time / floor: "
                     f"{span([r['step_ms'] / r['floor_ms'] for r in ok], '.1f')}.\n")
    if compile_text(env):
        lines.append(compile_text(env))
    return "\n".join(lines)


def compared_markdown(env: dict, rows: list[dict], batches, contexts) -> str:
    """The table of a run of several weight kinds (``--weights``): per (batch, context, cache
    format) each model's step, FFN and floor, and each kind's tokens/s over the first kind's."""
    kinds = env["weights_compared"]
    base = kinds[0]
    by_key = {(r["batch"], r["context"], r["kv_cache"], r["weights"]): r for r in rows}
    sizes = ", ".join(f"{WEIGHT_TEXT[w]} {env['weights_gib_each'][w]:.1f} GiB" for w in kinds)
    lines = [
        "# End-to-end decode: weights side by side\n",
        f"Device {env['device']}, jax {env['jax']}, {env['date']}. Produced by "
        f"`{env.get('command', 'python -m snapmla_jax.bench e2e --weights ' + ' '.join(kinds))}`: one model of "
        "each kind in one process, each plan (batch, cache format) timed on every model back to back.\n",
        f"Model: {env['model']} with random weights ({sizes}){activation_text(env)}. {decoding_text(env)}\n",
        f"Columns: ms per decode step; {', '.join(f'{w} / {base}' for w in kinds[1:])}: generated tokens/s over "
        f"the {base} model's; FFN = the {env['layers']} feed-forward blocks timed alone (a loop of "
        f"{env['steps']} steps, per step); floor = (weight bytes the step reads + cache bytes) / copy bandwidth.\n",
    ]
    header = (["batch", "context", "cache"] + [f"{w} ms/step" for w in kinds] + [f"{w} / {base}" for w in kinds[1:]]
              + [f"FFN ms {w}" for w in kinds] + [f"floor ms {w}" for w in kinds])
    table = []
    for batch in batches:
        for context in contexts:
            for kv in CACHE_FORMATS:
                cells = [by_key.get((batch, context, kv, w)) for w in kinds]
                if not any(cells):
                    continue
                first = cells[0]
                ratios = [format(c["tokens_per_s"] / first["tokens_per_s"], ".2f")
                          if first and c and first["status"] == c["status"] == "ok" else "-" for c in cells[1:]]
                steps = [_cell(c, "step_ms", ".2f") if c and c["status"] == "ok" else (c or {}).get("status", "-")
                         for c in cells]
                table.append([batch, context, kv.upper()] + steps + ratios
                             + [_cell(c, "ffn_ms", ".2f") for c in cells] + [_cell(c, "floor_ms", ".2f") for c in cells])
    lines.append(timing.markdown_table(header, table))
    if compile_text(env):
        lines.append("\n" + compile_text(env))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The benchmark; raises cli.UsageError for bad flags (``python -m snapmla_jax.bench e2e``
    prints it on one line, exit code 2); exit code 2 without a CUDA GPU unless ``--tiny``."""
    parser = cli.Parser(prog="python -m snapmla_jax.bench e2e", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer model and small shapes, on any backend (a CPU test of the plumbing)")
    parser.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    parser.add_argument("--contexts", type=int, nargs="*", help="override the context lengths")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed call (default 8)")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per measurement (default 3)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="write_kv/mla_decode backend (default auto)")
    parser.add_argument("--threads", type=int, default=8, help="parallel compilations (default 8)")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="the linear kernels and routed experts block-FP8 (models.quantize_weights' layout)")
    parser.add_argument("--fp8-absorbed", action="store_true",
                        help="with --fp8-weights: the attention's w_uk / w_uv block-FP8 too (their products the FP8 "
                             "GEMM, one group a head, instead of XLA's bf16 einsums)")
    parser.add_argument("--weights", nargs="+", choices=WEIGHT_KINDS, default=None,
                        help="build a model of each kind and time them side by side, plan by plan: bf16, fp8 (as "
                             "--fp8-weights), fp8-absorbed (as --fp8-absorbed), fp8-ffn (FP8 feed-forward blocks, "
                             "bf16 attention projections), fp8-large (FP8 from 2^24 elements a weight); the first "
                             "is the ratios' baseline "
                             "(default: bf16, or what --fp8-weights / --fp8-absorbed say)")
    parser.add_argument("--kv-caches", nargs="+", choices=CACHE_FORMATS, default=list(CACHE_FORMATS),
                        help="the latent cache formats to run (default: fp8 bf16)")
    parser.add_argument("--kernel-quantization", type=int, metavar="ROWS", default=None,
                        help="with --fp8-weights: the FP8 GEMM of few tokens quantizes x itself for products of at "
                             "most ROWS rows (fp8_weights.KERNEL_QUANTIZES_MAX_ROWS; 0: XLA quantizes; default: the "
                             "library's)")
    parser.add_argument("--xla-quantizes", action="store_true",
                        help="with --fp8-weights: XLA's launches quantize the FP8 products' activations instead of "
                             "one Mosaic GPU launch (fp8_weights.MOSAIC_QUANTIZES off)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each row's GPU time per launch and decode step (JAX profiler) in the JSON")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new runs after this many seconds")
    cli.add_bench_output_flags(parser, "e2e.json / e2e.md")
    moe = parser.add_mutually_exclusive_group()
    moe.add_argument("--dense-moe", type=int, nargs=2, metavar=("LOW", "HIGH"), default=None,
                     help="run the routed experts dense for LOW..HIGH tokens a call "
                          "(MoE.dense_token_range; default: the library's, models.moe.DENSE_TOKEN_RANGE)")
    moe.add_argument("--ragged-moe", action="store_true",
                     help="run the routed experts ragged at every token count (MoE.dense_token_range None, "
                          "MoE.gather_max_tokens 0, MoE.sorted_min_tokens None)")
    parser.add_argument("--gather-moe", type=int, metavar="MAX", default=None,
                        help="run the gathered dispatch (on a GPU the grouped-experts kernel) for calls of at "
                             "most MAX tokens (MoE.gather_max_tokens; 0: never; default: the library's, "
                             "models.moe.GATHER_MAX_TOKENS)")
    args = parser.parse_args(argv)
    args.command = timing.command_text("python -m snapmla_jax.bench e2e", sys.argv[1:] if argv is None else argv)
    cli.check_positive(args, "steps", "iters", "threads")
    for flag in ("batches", "contexts"):
        if any(v < 1 for v in getattr(args, flag) or []):
            raise cli.UsageError(f"--{flag}: expected ints >= 1, got {' '.join(map(str, getattr(args, flag)))}")
    if args.budget_s is not None and not args.budget_s > 0:
        raise cli.UsageError(f"--budget-s: expected a number of seconds > 0, got {args.budget_s}")
    if args.dense_moe is not None:
        try:
            models.moe.check_token_range(args.dense_moe)
        except ValueError as err:
            raise cli.UsageError(f"--dense-moe: {cli.one_line(err)}") from err
    if args.gather_moe is not None and (args.gather_moe < 0 or args.ragged_moe):
        raise cli.UsageError("--gather-moe: expected an int >= 0, and not with --ragged-moe")
    if args.fp8_absorbed and not args.fp8_weights:
        raise cli.UsageError("--fp8-absorbed: makes w_uk / w_uv FP8 beside the FP8 weights; pass --fp8-weights")
    if args.weights is not None and args.fp8_weights:
        raise cli.UsageError("--weights: names every model of the run; not with --fp8-weights / --fp8-absorbed")
    if args.weights is None:
        args.weights = ["fp8-absorbed" if args.fp8_absorbed else "fp8" if args.fp8_weights else "bf16"]
    if len(set(args.weights)) < len(args.weights):
        raise cli.UsageError(f"--weights: expected distinct kinds, got {' '.join(args.weights)}")
    args.kv_caches = [kv for kv in CACHE_FORMATS if kv in args.kv_caches]
    if args.kernel_quantization is not None and (args.kernel_quantization < 0 or args.weights == ["bf16"]):
        raise cli.UsageError("--kernel-quantization: expected an int >= 0, with --fp8-weights (or fp8 in --weights)")
    if args.xla_quantizes and args.weights == ["bf16"]:
        raise cli.UsageError("--xla-quantizes: with --fp8-weights (or fp8 in --weights)")
    cli.backend(args.backend)
    args.out = cli.bench_output_dir(args)
    if not args.tiny and timing.missing_gpu("e2e benchmark",
                                            "the V2-Lite-sized model needs a CUDA GPU (use --tiny elsewhere)"):
        return 2
    rows = fp8_weights.KERNEL_QUANTIZES_MAX_ROWS if args.kernel_quantization is None else args.kernel_quantization
    # Every program of the run is traced with these settings.
    with fp8_weights.kernel_quantization(rows), fp8_weights.mosaic_quantization(not args.xla_quantizes):
        return run(args)


def run(args: argparse.Namespace) -> int:
    """The benchmark for ``main``'s parsed arguments; returns the exit code."""
    start = time.perf_counter()
    cfg = TINY if args.tiny else V2_LITE
    grid = dict(TINY_GRID if args.tiny else FULL_GRID)
    for key in grid:
        if getattr(args, key):
            grid[key] = tuple(getattr(args, key))
    env = timing.environment()
    env["copy_gbps"] = timing.measure_copy_gbps((64 << 20) if args.tiny else (2 << 30))
    # What fits is read from the device's memory limit, which this variable sets (XLA's default
    # preallocation: 75%); recorded so that a table's "no room" cells can be read.
    env["xla_mem_fraction"] = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    compared = len(args.weights) > 1
    check_models_fit(cfg, args.weights, free_device_bytes())
    env["command"] = args.command
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.threads)
    compile_seconds: dict[str, float] = {}
    runners = []
    for weights in args.weights:  # every model built before the plans read what memory is left
        model = random_model(cfg, jnp.bfloat16, **weight_kind_options(weights))
        if args.dense_moe is not None or args.ragged_moe:
            models.moe.set_dense_token_range(model, None if args.ragged_moe else tuple(args.dense_moe))
        if args.gather_moe is not None or args.ragged_moe:
            models.moe.set_gather_max_tokens(model, 0 if args.ragged_moe else args.gather_moe)
        if args.ragged_moe:
            models.moe.set_sorted_min_tokens(model, None)
        runners.append(Runner(cfg, model, steps=args.steps, iters=args.iters, backend=args.backend, pool=pool,
                              compile_seconds=compile_seconds, profile=args.profile, weights=weights,
                              label=weights if compared else ""))
    env.update(moe_dispatch(runners[0].model))
    if compared:
        env["weights_compared"] = list(args.weights)
        env["weights_gib_each"] = {r.weights: weight_bytes_touched(cfg, r.params, 1)[0] / GIB for r in runners}
    env["weights"] = " / ".join(WEIGHT_TEXT[w] for w in args.weights)
    if any(w != "bf16" for w in args.weights):
        env["kernel_quantization_rows"] = fp8_weights.KERNEL_QUANTIZES_MAX_ROWS
        env["xla_product_rows"] = fp8_weights.XLA_MAX_ROWS
        env["activation_quantizer"] = "mosaic" if fp8_weights.MOSAIC_QUANTIZES else "xla"
    weights_total = weight_bytes_touched(cfg, runners[0].params, 1)[0]
    env.update(model="tiny (2 layers)" if args.tiny else "DeepSeek-V2-Lite shapes",
               params_b=sum(x.size for x in jax.tree.leaves(runners[0].params)) / 1e9,
               weights_gib=weights_total / GIB, layers=cfg.num_hidden_layers, steps=args.steps, iters=args.iters,
               backend=args.backend, compile_seconds=compile_seconds)
    total_steps = runners[0].total_steps
    plans = make_plans(cfg, grid["batches"], grid["contexts"], total_steps, free_device_bytes(), args.kv_caches)
    print(f"{env}\nmodels built in {time.perf_counter() - start:.0f} s; plans: "
          + "; ".join(f"B={p.batch} {p.kv_cache} ctx {list(p.contexts)} ({p.cache_bytes / GIB:.1f} GiB cache; "
                      f"no room: {list(p.too_big)})" for p in plans), flush=True)
    programs, ffns = {}, {}
    for plan in plans:  # in run order, so that the first runs' programs compile first
        if plan.contexts:
            for i, runner in enumerate(runners):
                programs[id(plan), i] = runner.submit(plan)
                if (plan.batch, i) not in ffns:
                    ffns[plan.batch, i] = runner.submit_ffn(plan.batch)
    # Every program compiled before anything is timed: XLA autotunes on the GPU while it
    # compiles, and a timing beside other programs' compilations ran up to 3x slow (H100,
    # B=16 x 16k BF16: 51.7 ms a step in one such run, 15-17 ms alone).
    concurrent.futures.wait([future for futures in programs.values() for future in futures.values()]
                            + list(ffns.values()))
    rows = []
    write = lambda: timing.write_results(args.out, "e2e", env, rows,
                                         (compared_markdown if compared else markdown)(env, rows, grid["batches"],
                                                                                       grid["contexts"]))
    for plan in plans:
        need = lambda c: plan.batch * c * cache_bytes_per_token(cfg, plan.kv_cache) / GIB
        for runner in runners:
            rows += [dict(batch=plan.batch, context=c, kv_cache=plan.kv_cache, weights=runner.weights,
                          status=f"no room ({need(c):.0f} GiB cache)") for c in plan.too_big]
        if not plan.contexts:
            continue
        for i, runner in enumerate(runners):  # one plan's models back to back: side by side
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                rows += [dict(batch=plan.batch, context=c, kv_cache=plan.kv_cache, weights=runner.weights,
                              status="not run (time budget)") for c in plan.contexts]
                continue
            try:
                new = runner.run(plan, programs[id(plan), i], ffns[plan.batch, i])
            except Exception as err:  # one failing shape must not lose the others' results
                traceback.print_exc()
                reason = " ".join(str(err).split())[:120]
                print(f"B={plan.batch} {plan.kv_cache} {runner.weights} weights failed: {reason}", flush=True)
                new = [dict(batch=plan.batch, context=c, kv_cache=plan.kv_cache, weights=runner.weights,
                            status=f"failed: {reason}") for c in plan.contexts]
            for row in new:
                if row["status"] == "ok":
                    touched = weight_bytes_touched(cfg, runner.params, row["batch"],
                                                   routed_dispatch(runner.model, row["batch"], args.backend))[1]
                    cache = row["batch"] * row["context"] * cache_bytes_per_token(cfg, row["kv_cache"])
                    row["floor_ms"] = (touched + cache) / (env["copy_gbps"] * 1e9) * 1e3
            rows += new
            write()
    write()
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"done in {time.perf_counter() - start:.0f} s; wrote {args.out / 'e2e.json'} and {args.out / 'e2e.md'}",
          flush=True)
    return 0
