"""DeepSeek mixture-of-experts feed-forward: router, dropless routed experts,
shared experts.

Routing (``MLAConfig.topk_method``):
  greedy               top-k of the scores (DeepSeek-V2-Lite).
  group_limited_greedy experts sit in ``n_group`` groups; a group scores its
                       best expert; only the ``topk_group`` best groups compete
                       (DeepSeek-V2).
  noaux_tc             the choice uses scores + ``e_score_correction_bias``; a
                       group scores the sum of its two best experts; the gate
                       weights are the uncorrected scores (DeepSeek-V3).
Scores are softmax or sigmoid of the router logits (``scoring_func``),
optionally renormalized over the chosen k, then times ``routed_scaling_factor``.

The experts are dropless: every (token, expert) assignment is computed, in one
of four ways (``MoE.__call__`` picks by the token count T, a static shape):

* ragged (any T the two below leave): the T*k assignments are sorted by expert so each
  expert's tokens are contiguous, and ``jax.lax.ragged_dot`` multiplies each
  contiguous group by its expert's weights: work proportional to T*k.
* dense (T in the layer's ``dense_token_range``): every expert runs on every token and
  the unchosen (token, expert) pairs get gate weight 0. E/k times the
  arithmetic, but plain batched matrix products that read each expert weight
  once: for a decode step's few tokens the layer's time is its weight read,
  and T <= (matrix rate / memory bandwidth) tokens (~230 in bf16 on an H100)
  keep it there.
* gathered (T <= the layer's ``gather_max_tokens``, checked first): each
  assignment is one vector-matrix product with its expert's weights: a
  one-token decode step reads k experts, not all E (``ragged_dot`` on Hopper
  reads all E at any T). With ``backend`` "pallas" (a decode step on a Hopper GPU)
  two Mosaic GPU launches read the chosen experts' matrices where they lie
  (pallas_kernels/grouped_experts.py, bf16 stacks); with "xla" (the default),
  and elsewhere, jnp gathers them per assignment ([T*k, hidden, inner] copies).
  With the experts split over devices either would move expert weights between
  devices, so the placements (``models.sharding``, the loaders' ``sharding=``)
  turn it off there (``match_dispatch_to_placement``).
* sorted (where dense or ragged would run, from the layer's ``sorted_min_tokens`` on, or its
  ``fp8_sorted_min_tokens`` with block-FP8 stacks (``default_sorted_min_tokens``), when the
  grouped GEMMs run: backend "pallas" on a Hopper GPU or "interpret", bf16 stacks of whole tiles
  or block-FP8 ones): the assignments sorted by expert and cut into chunks of one expert's
  tokens, one GEMM group a chunk (pallas_kernels/grouped_experts.py ``sorted_products``): each chosen
  expert's matrices read once a chunk, as dense reads them, but each token multiplied only by its
  k experts instead of all E. Dense's arithmetic grows with T x E: at a serving batch's token
  counts it sets the step's pace (4 H200s, V2 shapes with FP8 weights, 184 rows of 32k: the FP8
  GEMM launches, dense's and the projections', took 43.5 of the step's 99.6 ms of GPU time; sorted
  made the step 71.5 ms instead of 102.8). Above dense's range (a prompt's prefill) it replaces
  ragged: one V2-Lite layer on an H200, bf16, 0.855 vs 9.29 ms at T = 1024 and 1.20 vs 16.7 at
  1664 (docs/benchmarks/moe_sorted_v2_lite_h200.md), and block-FP8 stacks stay FP8 there.

Expert parallelism (``expert_axis``, set by ``snapmla_jax.data_parallel.place_model``): inside
``jax.shard_map`` over a mesh axis whose devices each hold E / N of the experts
(``models.sharding.expert_sharding``) and their own rows of the batch, a layer gathers every
device's tokens (``all_gather``), routes them all (the router is replicated, so every device
makes the same choice), runs its own experts on the assignments that chose them (the others get
gate weight 0) and returns each device its tokens' sums over all experts (``psum_scatter``, in
float32). Two collectives of T x hidden a layer, against the dispatch's reading of E / N
experts' weights; the shared experts run on each device's own tokens.

Block-FP8 experts (``fp8_weights.BlockFP8Weight`` stacks): on a Hopper GPU the gathered, dense
and sorted dispatches run on the FP8 GEMM (``fp8_weights.fp8_grouped_matmul``, one launch a weight
stack, each matrix's e4m3 bytes read where they lie; ``MoE.fp8_kernel_stacks``; dense's gate and up
skip the experts no token chose), and a gathered call with as many assignments as experts runs
dense (``MoE.dispatch``). The ragged dispatch (where
sorted does not run) and the "xla" backend dequantize the stacks in XLA (``MoE.expert_stacks``).

The choice is three static attributes of each layer, ``MoE.dense_token_range``,
``MoE.gather_max_tokens`` and ``MoE.sorted_min_tokens`` (``set_dense_token_range``,
``set_gather_max_tokens`` and ``set_sorted_min_tokens`` set them on every layer of a model), so
it is part of the layer's graph definition: a jit keyed on ``nnx.split``'s graphdef, or
``nnx.jit``, compiles a new program when it changes (a module-level switch read while tracing
would not be: a jit cache hit would keep the old dispatch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from snapmla_jax.backend import mosaic_kernels_run, resolve_backend, sm_count
from snapmla_jax.fp8_weights import (BlockFP8Weight, QuantizedTokens, dequantize_weight, fp8_grouped_matmul,
                                     kernel_quantizes, kernel_runs, quantize_tokens)
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.layers import MLP
from snapmla_jax.pallas_kernels.grouped_experts import (chunk_rows, combine_assignments, gathered_products,
                                                        grouped_experts, grouped_experts_reference, sorted_experts,
                                                        sorted_products, sorted_takes,
                                                        takes as grouped_experts_takes)

# The default ``MoE.dense_token_range`` of new layers: token counts T (tokens in one call:
# batch x sequence) for which the routed experts run dense (module docstring), as an
# inclusive (low, high) range; None: never dense. By arithmetic, dense reads every expert
# and ragged only the chosen ones; measured, XLA's ragged_dot on Hopper reads every expert's
# weights at any T and runs far below the matrix rate (11 TFLOP/s at T = 512), so dense wins
# nearly everywhere (H200, one layer, bf16): V2-Lite shapes 1.14x at T = 4 to 4.5x at T = 512,
# but 0.72x at T = 1; V3 shapes 1.02x at T = 1 to 2.8x at T = 64 (scripts/bench_moe.py).
# The top, 512, is the largest T measured; the [E, T, inner] activations of dense grow with T
# (1 GB at V3 shapes and T = 512), so prefill-sized calls stay ragged, or run sorted where its
# GEMMs run (``MoE.dispatch``). With the experts split over
# N devices (``data_parallel.place_model``) a layer holds E / N experts and the top becomes 512 N.
DENSE_TOKEN_RANGE: tuple[int, int] | None = (4, 512)


def check_token_range(token_range) -> tuple[int, int] | None:
    """``token_range`` as a (low, high) tuple of ints with 1 <= low <= high, or None; ValueError
    naming ``dense_token_range`` otherwise."""
    if token_range is None:
        return None
    try:
        low, high = (int(v) for v in token_range)
    except (TypeError, ValueError):
        raise ValueError(f"dense_token_range: expected None or (low, high) ints, got {token_range!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"dense_token_range: expected 1 <= low <= high, got {token_range!r}")
    return low, high


# The default ``MoE.gather_max_tokens`` of new layers: calls of at most this many tokens run
# the gathered dispatch (module docstring); 0: never. Set for a decode step on a GPU, where it
# runs as the grouped experts (backend "pallas"): in the 27-layer feed-forward stack of V2-Lite
# shapes on an H100 their Triton launches of the time (the Mosaic ones that replaced them are
# 1.07-1.13x as fast at those shapes on an H200) took 2.36 / 3.11 / 4.69 / 7.31 ms at T = 1 / 2 / 4 / 8
# against the jnp gathered dispatch's 6.70 / 11.7 / 22.0 / 42.7 (XLA compiles its gathers into
# slow reduce fusions there) and ragged / dense's 11.4 / 11.4 / 10.6 / 10.8
# (scripts/bench_ffn_stack.py). With backend "xla" (a CPU, or a caller's choice) the same range
# runs the jnp gather, slower than ragged/dense from T = 2 on a GPU; the CPU's speed is not a target.
GATHER_MAX_TOKENS = 8

# The default ``MoE.sorted_min_tokens`` of new layers: the token count from which the sorted
# dispatch replaces dense where its GEMMs run (module docstring); None: never. One layer on one
# H200 against dense (scripts/bench_moe.py): at V2-Lite's shapes 0.93 / 0.99 / 0.92 / 0.92x as
# fast at T = 16 / 32 / 64 / 128, 1.10 / 1.45 / 2.33 / 2.79x at 256 / 512 / 1024 / 1664
# (docs/benchmarks/moe_sorted_v2_lite_h200.md); at V3's 2.21 / 1.40 / 1.10 / 1.05 / 1.65x at
# T = 16 / 32 / 64 / 128 / 256 and 4.08x at 8 (docs/benchmarks/moe_sorted_v3_h200.md). Under expert
# parallelism, side by side at V2-Lite's capacity batches on 2 H200s (32k context), a step took
# 0.89x dense's time at 392 gathered tokens (FP8 cache) and 0.95x at 218 (BF16 cache); at V2's
# shapes with block-FP8 weights on 4 H200s, 184 gathered tokens, 71.5 ms against dense's
# 102.8 (docs/benchmarks/capacity_sorted.md). Below 160 tokens V2-Lite's shapes lose: their
# experts are small (8.7M parameters), and the sort, the gathers and the launches cost about as
# much as the experts sorted leaves unread. Layers of larger experts (``default_sorted_min_tokens``)
# start at SORTED_MIN_TOKENS_LARGE_EXPERTS instead.
SORTED_MIN_TOKENS: int | None = 160
# The most tokens one sorted dispatch takes at once. Its temporaries (gate and up and the down
# projection's rows in float32, each assignment's output) take ~35 KB an assignment row at
# V2-Lite's shapes, ~1.7x ragged_dot's bf16 ones: ~3.7 GB for one 16k-token prompt. Longer calls
# (prefills) run in blocks of this many tokens one after another (``lax.map``), ~2 GB there;
# each expert's matrices are read once a chunk either way. Read while tracing.
SORTED_BLOCK_TOKENS = 8192
# Parameters an expert (3 x hidden x inner) from which a layer's default is
# SORTED_MIN_TOKENS_LARGE_EXPERTS: V3's 44M won from T = 16 on in the one-layer runs above (sorted
# reads only the chosen experts, 40% of them at 16 tokens), V2's 23.6M at its capacity batch.
LARGE_EXPERT_PARAMS = 16 * 2**20
SORTED_MIN_TOKENS_LARGE_EXPERTS = 16
# The same for block-FP8 expert stacks on the FP8 GEMM (``MoE.fp8_sorted_min_tokens``), where
# dense reads only the chosen experts' gate and up. At V2-Lite's shapes dense's layer grows ~2.7 us
# a token while sorted's stays near 0.26 ms (H100, jax 0.11.2): one layer 0.262 ms dense against
# 0.264 sorted at T = 48 (docs/benchmarks/fp8_experts_t48_h100.md), and at B = 64 a decode step's
# feed-forward blocks 6.88 ms sorted (docs/benchmarks/e2e_fp8_weights_h100_4k.md) against 7.44
# dense (the same command, dense up to 71 tokens). At V3's (32 of its experts, one of 8 GPUs'
# share; docs/benchmarks/fp8_experts_sorted_h100.md, measured before the gated launch) sorted ran
# 0.95 / 0.95 / 0.93 / 0.90x dense at 16 / 32 / 64 / 128, while at V2's shapes on 4 H200s (184
# tokens) it made the step 1.44x as fast (docs/benchmarks/capacity_sorted.md).
FP8_SORTED_MIN_TOKENS = 56
FP8_SORTED_MIN_TOKENS_LARGE_EXPERTS = 160


def default_sorted_min_tokens(cfg: MLAConfig, fp8: bool = False) -> int | None:
    """The ``sorted_min_tokens`` (``fp8``: ``fp8_sorted_min_tokens``) a new ``MoE`` layer of ``cfg``
    starts with: SORTED_MIN_TOKENS (FP8_SORTED_MIN_TOKENS), or the ``_LARGE_EXPERTS`` value where
    an expert holds at least LARGE_EXPERT_PARAMS parameters (SORTED_MIN_TOKENS None: sorted off)."""
    if SORTED_MIN_TOKENS is None:
        return None
    large = 3 * cfg.hidden_size * cfg.moe_intermediate_size >= LARGE_EXPERT_PARAMS
    if fp8:
        return FP8_SORTED_MIN_TOKENS_LARGE_EXPERTS if large else FP8_SORTED_MIN_TOKENS
    return SORTED_MIN_TOKENS_LARGE_EXPERTS if large else SORTED_MIN_TOKENS


def choose_dispatch(num_tokens: int, dense_token_range: tuple[int, int] | None, gather_max_tokens: int) -> str:
    """"gathered", "dense" or "ragged": how a layer with these settings runs a call of
    ``num_tokens`` tokens (module docstring; gathered is checked first)."""
    if num_tokens <= gather_max_tokens:
        return "gathered"
    if dense_token_range is not None and dense_token_range[0] <= num_tokens <= dense_token_range[1]:
        return "dense"
    return "ragged"


def moe_layers(model: nnx.Module) -> list["MoE"]:
    """Every ``MoE`` layer inside ``model`` (itself included)."""
    return [module for _, module in nnx.iter_graph(model) if isinstance(module, MoE)]


def set_gather_max_tokens(model: nnx.Module, max_tokens: int) -> int:
    """Set ``gather_max_tokens`` (an int >= 0; 0: never gathered) on every ``MoE`` layer inside
    ``model``; returns how many layers there were. As ``set_dense_token_range``."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"gather_max_tokens: expected an int >= 0, got {max_tokens!r}")
    layers = moe_layers(model)
    for layer in layers:
        layer.gather_max_tokens = max_tokens
    return len(layers)


def match_dispatch_to_placement(model: nnx.Module) -> int:
    """Turn the gathered dispatch off (``gather_max_tokens`` 0) in every ``MoE`` layer whose
    expert weights are split over devices: there, gathering the chosen experts would copy
    expert weights between devices (ragged and dense keep each device on its own experts).
    Called by the placements (``models.sharding.shard_model``, the loaders' ``sharding=``);
    returns how many layers it turned off."""
    turned_off = 0
    for layer in moe_layers(model):
        w_gate = layer.w_gate.get_value()
        sharding = getattr(w_gate.values if isinstance(w_gate, BlockFP8Weight) else w_gate, "sharding", None)
        if sharding is not None and not sharding.is_fully_replicated and layer.gather_max_tokens:
            layer.gather_max_tokens = 0
            turned_off += 1
    return turned_off


def set_sorted_min_tokens(model: nnx.Module, min_tokens: int | None) -> int:
    """Set ``sorted_min_tokens`` and ``fp8_sorted_min_tokens`` (an int >= 1, or None: never sorted)
    on every ``MoE`` layer inside ``model``: sorted from ``min_tokens`` on whatever the expert
    stacks hold; returns how many. ValueError naming ``sorted_min_tokens`` otherwise."""
    if min_tokens is not None and (isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1):
        raise ValueError(f"sorted_min_tokens: expected None or an int >= 1, got {min_tokens!r}")
    layers = moe_layers(model)
    for layer in layers:
        layer.sorted_min_tokens = layer.fp8_sorted_min_tokens = min_tokens
    return len(layers)


def set_dense_token_range(model: nnx.Module, token_range: tuple[int, int] | None) -> int:
    """Set ``dense_token_range`` on every ``MoE`` layer inside ``model`` (itself included);
    returns how many layers there were. Programs compiled before keep their dispatch;
    programs keyed on the model's graphdef compile anew."""
    token_range = check_token_range(token_range)
    layers = moe_layers(model)
    for layer in layers:
        layer.dense_token_range = token_range
    return len(layers)


class RouterBias(nnx.Variable):
    """DeepSeek-V3's ``e_score_correction_bias``: set by load balancing outside
    gradient descent, so it is state but not an ``nnx.Param`` (optimizers that
    select ``nnx.Param`` leave it alone)."""


class Router(nnx.Module):
    """Token -> (gate weights [T, k] float32, expert ids [T, k] int32).

    Logits are computed in float32 from a float32 copy of the weight, as
    DeepSeek does: routing decisions are discontinuous, so bf16 rounding of
    the logits would flip experts.
    """

    def __init__(self, cfg: MLAConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.n_routed_experts), dtype))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = RouterBias(jnp.zeros((cfg.n_routed_experts,), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int32)."""
        cfg = self.cfg
        logits = jnp.dot(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
        scores = jax.nn.softmax(logits, axis=-1) if cfg.scoring_func == "softmax" else jax.nn.sigmoid(logits)
        if cfg.topk_method == "greedy":
            weights, ids = jax.lax.top_k(scores, cfg.num_experts_per_tok)
        else:
            choice = scores
            if cfg.topk_method == "noaux_tc":
                choice = scores + self.e_score_correction_bias[...]
            choice = self._keep_best_groups(choice)
            _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
            weights = jnp.take_along_axis(scores, ids, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids.astype(jnp.int32)

    def _keep_best_groups(self, choice: jax.Array) -> jax.Array:
        """choice [T, E] -> same, with experts outside the topk_group best groups set to -inf."""
        cfg = self.cfg
        grouped = choice.reshape(choice.shape[0], cfg.n_group, cfg.experts_per_group)
        if cfg.topk_method == "noaux_tc":
            group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        else:
            group_score = jnp.max(grouped, axis=-1)
        _, best = jax.lax.top_k(group_score, cfg.topk_group)
        keep = jnp.any(best[..., None] == jnp.arange(cfg.n_group), axis=-2)  # [T, n_group]
        return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


def _fp8_products(stacks: tuple[BlockFP8Weight, ...], backend: str) -> tuple:
    """(gate_up, down) for ``gathered_products`` / ``sorted_products`` on block-FP8 (w_gate, w_up,
    w_down): each group's chosen matrices read in FP8 where they lie, gate and up in one launch.
    Both results come in the tokens' dtype: a 16-bit one leaves the kernel token-major, so no XLA
    transpose copies it, and the down projection's rows (one an assignment, weighted and summed in
    float32 after) take half the bytes of float32 ones."""
    w_gate, w_up, w_down = stacks
    return (lambda x, chosen: fp8_grouped_matmul(x, (w_gate, w_up), matrices=chosen, gated=True, out_dtype=x.dtype,
                                                 backend=backend),
            lambda hidden, chosen: fp8_grouped_matmul(hidden, w_down, matrices=chosen, out_dtype=hidden.dtype,
                                                      backend=backend))


def _expert_init(rngs: nnx.Rngs, shape: tuple[int, int, int], dtype) -> nnx.Param:
    # One fan-in-scaled normal matrix per expert (axis 0 indexes experts).
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
    return nnx.Param(init(rngs.params(), shape, dtype))


class MoE(nnx.Module):
    """Routed SwiGLU experts plus always-on shared experts: x [..., hidden] -> same shape and dtype.

    Expert weights: ``w_gate``/``w_up`` [E, hidden, moe_intermediate],
    ``w_down`` [E, moe_intermediate, hidden], or each a ``BlockFP8Weight`` of the transposed
    stack (values [E, out, in], ``models.layers.quantize_weights``), dequantized inside the
    program that uses it (``expert_stacks``). The shared experts form one MLP of width
    ``moe_intermediate_size * n_shared_experts``.
    """

    def __init__(self, cfg: MLAConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        num, hidden, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        self.w_gate = _expert_init(rngs, (num, hidden, inner), dtype)
        self.w_up = _expert_init(rngs, (num, hidden, inner), dtype)
        self.w_down = _expert_init(rngs, (num, inner, hidden), dtype)
        self.shared_experts = (MLP(hidden, inner * cfg.n_shared_experts, dtype=dtype, rngs=rngs)
                               if cfg.n_shared_experts else None)
        # Static (part of the graphdef): which token counts run dense (module docstring).
        self.dense_token_range = check_token_range(DENSE_TOKEN_RANGE)
        self.gather_max_tokens = GATHER_MAX_TOKENS
        self.sorted_min_tokens = default_sorted_min_tokens(cfg)
        self.fp8_sorted_min_tokens = default_sorted_min_tokens(cfg, fp8=True)  # block-FP8 stacks on the FP8 GEMM
        # Static: the mesh axis the routed experts are split over when the layer runs inside
        # ``jax.shard_map`` (module docstring); None: every expert is here.
        self.expert_axis: str | None = None

    def __call__(self, x: jax.Array, *, backend: str = "xla") -> jax.Array:
        """x [..., hidden] -> same; ``backend`` (snapmla_jax.backend) runs the gathered dispatch:
        "xla" in jnp (differentiable), "pallas" / "interpret" as the grouped experts' launches.
        With ``expert_axis`` set, x is this device's tokens and the call must run inside
        ``shard_map`` over that axis (module docstring)."""
        backend = resolve_backend(backend)
        local = x.reshape(-1, x.shape[-1])
        axis = self.expert_axis
        flat = local if axis is None else jax.lax.all_gather(local, axis, axis=0, tiled=True)
        weights, ids = self.gate(flat)
        # Split experts: the partial sums leave in float32, rounded once after the sum over devices.
        out_dtype = flat.dtype if axis is None else jnp.float32
        if axis is not None:
            weights, ids = self._local_assignments(weights, ids, axis)
        name = self.dispatch(flat.shape[0], backend)
        tokens = None  # flat quantized for the routed experts' FP8 GEMMs, where they take it so
        if name == "gathered":
            routed = self._gathered_experts(flat, weights, ids, backend=backend, out_dtype=out_dtype)
        elif name == "sorted":
            tokens = self._sorted_tokens(flat, backend)
            routed = self._sorted_experts(flat, weights, ids, backend=backend, out_dtype=out_dtype, tokens=tokens)
        else:
            dispatch = {"dense": functools.partial(self._dense_experts, backend=backend),
                        "ragged": self._ragged_experts}[name]
            routed = dispatch(flat, weights, ids, out_dtype=out_dtype)
        if axis is not None:
            routed = jax.lax.psum_scatter(routed, axis, scatter_dimension=0, tiled=True).astype(x.dtype)
        if self.shared_experts is not None:
            # Block-FP8 shared experts take the routed experts' quantized tokens where those are
            # this device's and their GEMM would quantize them to the same bytes: one quantizer
            # launch a layer less.
            shared_x = (tokens if tokens is not None and axis is None
                        and self.shared_experts.takes_quantized(local, backend) else local)
            routed = routed + self.shared_experts(shared_x, backend=backend)
        return routed.reshape(x.shape)

    def dispatch(self, num_tokens: int, backend: str) -> str:
        """"gathered", "dense", "sorted" or "ragged": how a call of ``num_tokens`` tokens (all
        devices' with ``expert_axis``) runs with ``backend`` (resolved): ``choose_dispatch`` on the
        layer's settings, except that on the FP8 GEMM (``fp8_kernel_stacks``) a gathered call with
        at least as many assignments as experts runs dense, and that dense and ragged give way to
        sorted from ``sorted_min_tokens`` on where its GEMMs run (``sorted_runs``). Gathered reads one matrix
        an assignment, dense each matrix once (H200, 32 experts of V3's shape, 8 tokens x 8
        assignments: dense 0.422 ms, gathered 0.834; scripts/bench_fp8_experts.py)."""
        name = choose_dispatch(num_tokens, self.dense_token_range, self.gather_max_tokens)
        if (name == "gathered" and num_tokens * self.cfg.num_experts_per_tok >= self.num_local_experts()
                and self.fp8_kernel_stacks(num_tokens, backend) is not None):
            name = "dense"
        if name in ("dense", "ragged") and self.sorted_runs(num_tokens, backend):
            return "sorted"
        return name

    def sorted_chunk(self, num_tokens: int) -> int:
        """Tokens a chunk of the sorted dispatch for a call of ``num_tokens`` tokens
        (``grouped_experts.chunk_rows`` over all the model's experts, wherever they are)."""
        return chunk_rows(num_tokens, self.cfg.num_experts_per_tok, self.cfg.n_routed_experts)

    def sorted_runs(self, num_tokens: int, backend: str) -> bool:
        """Whether a call of ``num_tokens`` tokens may run the sorted dispatch with ``backend``
        (resolved): from ``fp8_sorted_min_tokens`` on with its chunks on the FP8 GEMM
        (``fp8_kernel_stacks``), from ``sorted_min_tokens`` on with them on the bf16 grouped GEMM
        ("pallas" on a Hopper GPU, or "interpret"; ``grouped_experts.sorted_takes``)."""
        chunk = self.sorted_chunk(num_tokens)
        if self.fp8_kernel_stacks(chunk, backend) is not None:
            return self.fp8_sorted_min_tokens is not None and num_tokens >= self.fp8_sorted_min_tokens
        if self.sorted_min_tokens is None or num_tokens < self.sorted_min_tokens:
            return False
        stacks = tuple(w.get_value() for w in (self.w_gate, self.w_up, self.w_down))
        return mosaic_kernels_run(backend) and all(isinstance(w, jax.Array) for w in stacks) and sorted_takes(chunk, *stacks)

    def num_local_experts(self) -> int:
        """The experts whose weights this layer holds: E, or E / N inside ``shard_map`` over N
        devices with the experts split (the leading axis of the stacks as the program sees them)."""
        w_gate = self.w_gate.get_value()
        return (w_gate.values if isinstance(w_gate, BlockFP8Weight) else w_gate).shape[0]

    def _local_assignments(self, weights: jax.Array, ids: jax.Array, axis: str) -> tuple[jax.Array, jax.Array]:
        """Global routing (gate weights [T, k] f32, expert ids [T, k]) -> this device's share: ids
        of its own experts (device i holds experts [i n, (i + 1) n)), and weight 0 (with id 0)
        for assignments to experts held elsewhere."""
        num_local = self.num_local_experts()
        local_ids = ids - jax.lax.axis_index(axis) * num_local
        mine = (local_ids >= 0) & (local_ids < num_local)
        return jnp.where(mine, weights, 0.0), jnp.where(mine, local_ids, 0).astype(ids.dtype)

    def expert_stacks(self, dtype, chosen: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(w_gate, w_up, w_down) as [E, in, out] arrays in ``dtype``: plain weights as they
        are, block-FP8 ones dequantized (values * scale in float32, one rounding to ``dtype``)
        and transposed back. ``chosen`` int32 [n]: only those experts' matrices, [n, in, out].
        XLA computes them inside the calling program. With FP8 weights this is the path where the
        FP8 GEMM kernel does not run (``fp8_kernel_stacks``: the ragged dispatch, the "xla"
        backend, other GPUs): the ragged and dense dispatches read the FP8 bytes of all E experts
        and make a dense copy of them there; the gathered one dequantizes only the chosen
        experts."""
        def dense(weight):
            value = weight.get_value()
            if isinstance(value, BlockFP8Weight):
                if chosen is not None:
                    value = BlockFP8Weight(value.values[chosen], value.scales[chosen], value.block)
                return jnp.swapaxes(dequantize_weight(value, dtype), -1, -2)
            return value if chosen is None else value[chosen]
        return dense(self.w_gate), dense(self.w_up), dense(self.w_down)

    def fp8_kernel_stacks(self, rows: int, backend: str) -> tuple[BlockFP8Weight, ...] | None:
        """(w_gate, w_up, w_down) as they are stored, when all three are block-FP8 and the FP8 GEMM
        kernel runs products of ``rows`` tokens with them (``fp8_weights.kernel_runs``, ``backend``
        resolved); else None."""
        stacks = tuple(w.get_value() for w in (self.w_gate, self.w_up, self.w_down))
        if all(isinstance(w, BlockFP8Weight) and kernel_runs(w, rows, backend) for w in stacks):
            return stacks
        return None

    def _ragged_experts(self, flat: jax.Array, weights: jax.Array, ids: jax.Array, *, out_dtype=None) -> jax.Array:
        """The chosen experts only: flat [T, hidden], gate weights [T, k] f32, expert ids [T, k]
        -> [T, hidden] in ``out_dtype`` (None: flat's dtype) (one grouped product per weight over
        the T*k assignments sorted by expert)."""
        k = self.cfg.num_experts_per_tok
        expert_of = ids.reshape(-1)                        # [T*k], assignment a = token * k + slot
        order = jnp.argsort(expert_of, stable=True)        # assignments grouped by expert
        rows = flat[order // k]                            # [T*k, hidden], sorted by expert
        w_gate, w_up, w_down = self.expert_stacks(flat.dtype)
        group_sizes = jnp.bincount(expert_of, length=w_gate.shape[0]).astype(jnp.int32)
        hidden = (jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, group_sizes))
                  * jax.lax.ragged_dot(rows, w_up, group_sizes))
        out_sorted = jax.lax.ragged_dot(hidden, w_down, group_sizes)
        per_assignment = jnp.zeros_like(out_sorted).at[order].set(out_sorted)   # back to token-major order
        return combine_assignments(per_assignment, weights).astype(out_dtype or flat.dtype)

    def _gathered_experts(self, flat: jax.Array, weights: jax.Array, ids: jax.Array, *,
                          backend: str = "xla", out_dtype=None) -> jax.Array:
        """Each assignment's vector-matrix products with its expert's weights, the same arguments
        and result as ``_ragged_experts``: for the few tokens this runs on, k experts' bytes a
        token instead of all E. ``backend`` "pallas" on a Hopper GPU, or "interpret": the
        grouped-experts launches (each chosen matrix read where it lies; bf16 stacks of the shapes
        ``grouped_experts.takes``); otherwise jnp, with [T*k, hidden, inner] gathered copies."""
        fp8_stacks = self.fp8_kernel_stacks(flat.shape[0], backend)
        if fp8_stacks is not None:
            # Each assignment's matrices read in FP8 where they lie: gate and up (one launch) for all
            # T tokens (the assignment's own row kept), down for the assignment's hidden row.
            out = gathered_products(flat, weights, ids, *_fp8_products(fp8_stacks, backend),
                                    num_experts=fp8_stacks[0].shape[0])
            return out.astype(out_dtype or flat.dtype)
        if any(isinstance(w.get_value(), BlockFP8Weight) for w in (self.w_gate, self.w_up, self.w_down)):
            # Only the chosen experts' FP8 matrices are dequantized: [T*k, ...] stacks, one an
            # assignment, which the assignments then index in order.
            chosen = ids.reshape(-1)
            stacks = self.expert_stacks(flat.dtype, chosen)
            ids = jnp.arange(chosen.shape[0], dtype=ids.dtype).reshape(ids.shape)
        else:
            stacks = self.expert_stacks(flat.dtype)
        experts = (flat, weights, ids, *stacks)
        if mosaic_kernels_run(backend) and grouped_experts_takes(flat.shape[0], *stacks):
            out = grouped_experts(*experts, num_sms=sm_count(), interpret=backend == "interpret")
        else:
            out = grouped_experts_reference(*experts)
        return out.astype(out_dtype or flat.dtype)

    def _sorted_tokens(self, flat: jax.Array, backend: str) -> QuantizedTokens | None:
        """flat [T, hidden] quantized once for the sorted dispatch's FP8 GEMMs (``quantize_tokens``)
        where they run and do not quantize their chunks themselves (``kernel_quantizes``), up to
        SORTED_BLOCK_TOKENS tokens; else None. ``backend`` resolved."""
        num_tokens = flat.shape[0]
        if num_tokens > SORTED_BLOCK_TOKENS:
            return None
        chunk = self.sorted_chunk(num_tokens)
        if self.fp8_kernel_stacks(chunk, backend) is None or kernel_quantizes(chunk):
            return None
        # The T tokens quantized once and their e4m3 rows and scales gathered into the chunks,
        # not the chunks' rows quantized: those are every token k times over and the empty
        # chunks' zeros (V2-Lite at 128 tokens: 88 chunks of 32, 2,816 rows for 128 tokens).
        return quantize_tokens(flat, backend=backend)

    def _sorted_experts(self, flat: jax.Array, weights: jax.Array, ids: jax.Array, *, backend: str,
                        out_dtype=None, tokens: QuantizedTokens | None = None) -> jax.Array:
        """The assignments sorted by expert into chunks, one GEMM group a chunk (``sorted_runs``
        must hold), the same arguments and result as ``_ragged_experts``; above
        SORTED_BLOCK_TOKENS tokens, in blocks of that many one after another. ``tokens``: flat as
        ``_sorted_tokens`` quantized it (None: quantized here where the FP8 GEMMs need it)."""
        num_tokens = flat.shape[0]
        if num_tokens > SORTED_BLOCK_TOKENS:
            blocks = -(-num_tokens // SORTED_BLOCK_TOKENS)
            pad = blocks * SORTED_BLOCK_TOKENS - num_tokens
            # The padding tokens' gate weights are 0: they take no row of the GEMMs.
            split = lambda a: jnp.pad(a, ((0, pad), (0, 0))).reshape(blocks, SORTED_BLOCK_TOKENS, a.shape[1])
            out = jax.lax.map(lambda block: self._sorted_experts(*block, backend=backend, out_dtype=out_dtype),
                              (split(flat), split(weights), split(ids)))
            return out.reshape(blocks * SORTED_BLOCK_TOKENS, -1)[:num_tokens]
        chunk = self.sorted_chunk(num_tokens)
        fp8_stacks = self.fp8_kernel_stacks(chunk, backend)
        if fp8_stacks is not None:
            # Chunks the GEMM quantizes itself (``kernel_quantizes``) take the tokens as they are.
            if tokens is None:
                tokens = self._sorted_tokens(flat, backend)
            out = sorted_products(flat if tokens is None else tokens, weights, ids,
                                  *_fp8_products(fp8_stacks, backend), num_experts=fp8_stacks[0].shape[0], chunk=chunk)
        else:
            out = sorted_experts(flat, weights, ids, *self.expert_stacks(flat.dtype), chunk=chunk,
                                 num_sms=sm_count(), interpret=backend == "interpret")
        return out.astype(out_dtype or flat.dtype)

    def _dense_experts(self, flat: jax.Array, weights: jax.Array, ids: jax.Array, *, out_dtype=None,
                       backend: str = "xla") -> jax.Array:
        """Every expert on every token, the same arguments and result as ``_ragged_experts``.

        Gate and up are batched products over the experts ([E, T, I]); each expert's
        activations are scaled by its gate weight per token (0 where not chosen) before the
        down projection, which is then one product contracting experts and features together
        ([T, E*I] x [E*I, hidden]): no [E, T, hidden] intermediate, and the weights are read in
        their stored layout.

        Block-FP8 experts where the FP8 GEMM kernel runs (``fp8_kernel_stacks``; ``backend``
        resolved): the same products as two FP8 GEMM launches over the stacks' e4m3 bytes, one
        writing silu(gate) * up in the tokens' dtype (``gated``), then the down projection summed
        over the experts inside its launch; gate and up skip the experts that no token chose.
        """
        num_tokens = flat.shape[0]
        fp8_stacks = self.fp8_kernel_stacks(num_tokens, backend)
        num_experts = self.num_local_experts()
        gate_of = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
            jnp.arange(num_tokens)[:, None], ids].add(weights)                 # [T, E]
        if fp8_stacks is not None:
            w_gate, w_up, w_down = fp8_stacks
            # Gate and up skip the experts no token chose (negative ids): at 16 tokens of V2-Lite's
            # top-6 of 64, ~13 experts on average, a fifth of the launch's bytes (H100: 107.8 vs
            # 132.6 us). The down projection's summed launch reads every expert: one that skips
            # them (its groups looked up on the device) ran 65.0 vs 69.4 us at 51 of 64 chosen,
            # 75.8 with all chosen, plus ~5.6 us of launches for its plan (docs/models.md).
            chosen = jnp.any(gate_of != 0, axis=0)                            # [E]
            matrices = jnp.where(chosen, jnp.arange(num_experts, dtype=jnp.int32), -1)
            # silu(gate) * up from one launch whose CTAs multiply the tokens by both matrices' rows,
            # rounded once to the tokens' dtype as the bf16 experts round it; [E, I, T] as the
            # kernel writes it, transposed once below inside XLA's fusion of the gate weights.
            hidden = fp8_grouped_matmul(flat[None], (w_gate, w_up), matrices=matrices, transposed=True, gated=True,
                                        out_dtype=flat.dtype, backend=backend)
            # A skipped expert's rows are left unwritten: zeros, not whatever lies there, go on.
            weighted = jnp.where(chosen[:, None, None], hidden.astype(jnp.float32) * gate_of.T[:, None, :], 0.0)
            scaled = jnp.swapaxes(weighted.astype(flat.dtype), 1, 2)                  # [E, T, I]
            out = fp8_grouped_matmul(scaled, w_down, sum_groups=True, backend=backend)
            return out.astype(out_dtype or flat.dtype)
        w_gate, w_up, w_down = self.expert_stacks(flat.dtype)
        tokens = jnp.broadcast_to(flat, (num_experts, *flat.shape))            # [E, T, hidden]
        hidden = (jax.nn.silu(jnp.einsum("eth,ehi->eti", tokens, w_gate))
                  * jnp.einsum("eth,ehi->eti", tokens, w_up))
        scaled = (hidden.astype(jnp.float32) * gate_of.T[:, :, None]).astype(hidden.dtype)
        return jnp.einsum("eti,eid->td", scaled, w_down, preferred_element_type=out_dtype).astype(out_dtype or flat.dtype)
